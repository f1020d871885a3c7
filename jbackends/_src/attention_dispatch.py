"""SDPA dispatch: which backend and implementation run a call, in flag priority order, with reasons.

The implementations live in :mod:`sdpa_registry` (per backend and lowering platform, an ordered list);
the generic choice is :func:`dispatch.choose`.

Rules (the contract the public API in ``jbackends.attention`` documents):

* The flags in force at trace time (:func:`trace_flags`) give the enabled set and the order
  (``sdpa_priority``). Disabled backends are never used, not even as a fallback.
* While the priority is at its default (``sdpa_prefer_faster``), a backend measured faster for the
  call on the target device is tried first (:mod:`sdpa_speed`: cuDNN on sm90+ in half precision).
* A backend can run a call on a platform when one of its implementations there can (after the flags'
  filters, e.g. ``flash_cpu_kernel``); the first enabled backend in priority order that can, runs,
  with its first implementation that can.
* When none can, one :class:`NoAvailableBackendError` names every enabled backend and its reasons
  (and which backends the flags disabled).
* MATH (the reference) can run every call on every platform.
* When a call is lowered for several platforms (``platforms=("cpu", "cuda")``), the choice is made
  per platform and combined with ``jax.lax.platform_dependent``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

from jbackends._src import dispatch, sdpa_registry, sdpa_speed
from jbackends._src.dispatch import PLATFORM_NAMES, Implementation, canonical_platform, default_platform
from jbackends._src import verbose
from jbackends._src.sdp_backends import DEFAULT_ORDER, FLAG, RUNNABLE, SDPBackend
from pallas_kernels.attention import base

__all__ = [
    "NAMES",
    "NoAvailableBackendError",
    "Decision",
    "PLATFORM_NAMES",
    "canonical_platform",
    "default_platform",
    "backend_choice",
    "backend_reasons",
    "decide",
    "run",
]

MATH, FLASH, EFFICIENT, CUDNN = (
    int(b)
    for b in (
        SDPBackend.MATH,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    )
)
NAMES = {int(b): b.name for b in RUNNABLE}
FLAG_OF = {int(b): flag for b, flag in FLAG.items()}


class NoAvailableBackendError(RuntimeError):
    """No enabled SDPA backend can run the call; the message has every enabled backend's reasons."""


def local_device_info(platform: str) -> Optional[Mapping[str, Any]]:
    """What is known about the device a call lowered for ``platform`` will run on: the compute
    capability of the CUDA target (the local GPU, or `pallas_kernels.gpu.cuda_target`'s), for
    implementations that route by it; None when nothing is known (then none is assumed)."""
    if platform != "cuda":
        return None
    from pallas_kernels import gpu  # noqa: PLC0415 - only when lowering for CUDA

    cc = gpu.compute_capability()
    return None if cc is None else {"compute_capability": cc / 10}


def backend_choice(
    args: base.AttentionArgs,
    backend: int,
    platform: str,
    flags: Any = None,
    device_info: Optional[Mapping[str, Any]] = None,
) -> dispatch.Choice:
    """Which implementation of ``backend`` would run ``args`` on ``platform`` (flags give the filters)."""
    excluded = sdpa_registry.flag_filter(flags, backend, platform, args) if flags is not None else {}
    return dispatch.choose(
        "sdpa",
        sdpa_registry.implementations(backend, platform),
        args,
        platform,
        device=device_info,
        excluded=excluded,
    )


def backend_reasons(choice: dispatch.Choice, backend: int) -> list:
    """Why ``backend`` cannot run the call of ``choice`` (empty if it can): the most general
    implementation's reasons first (the last in the list), then the others', named."""
    if choice.chosen is not None:
        return []
    if not choice.candidates:
        return [f"no {NAMES[backend]} implementation for platform {choice.platform!r}"]
    *special, general = choice.candidates
    parts = [choice.reasons[general.name]]
    parts += [
        f"{i.name}: {choice.reasons[i.name]}"
        for i in reversed(special)
        if choice.reasons[i.name] not in parts
    ]
    return parts


def _backend_reason(choice: dispatch.Choice, backend: int) -> str:
    return "; ".join(backend_reasons(choice, backend))


@dataclasses.dataclass(frozen=True)
class Decision:
    """One dispatch decision: the backend chosen on ``platform`` and why each other one was not."""

    platform: str
    chosen: Optional[int]
    order: tuple
    reasons: Mapping[int, str]
    #: the implementation of ``chosen`` that runs, and why not the others of that backend
    implementation: Optional[Implementation] = None
    implementation_reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def chosen_name(self) -> Optional[str]:
        return None if self.chosen is None else NAMES[self.chosen]

    def error(self) -> NoAvailableBackendError:
        enabled = [b for b in self.order if not self.reasons[b].startswith("disabled")]
        lines = [f"  {NAMES[b]}: {self.reasons[b]}" for b in enabled]
        disabled = [NAMES[b] for b in self.order if b not in enabled]
        msg = (
            f"No enabled SDPA backend can run this call on {self.platform!r}. Enabled backends, "
            f"in priority order:\n" + ("\n".join(lines) if lines else "  (none)")
        )
        if disabled:
            msg += (
                f"\nDisabled by the flags (never used as a fallback): {', '.join(disabled)}. "
                "Enable one with jb.attention.sdpa_kernel([...]) or jb.with_backends(math=True)."
            )
        return NoAvailableBackendError(msg)


def decide(
    args: base.AttentionArgs,
    flags: Any,
    platform: str,
    *,
    only: Optional[int] = None,
    device_info: Optional[Mapping[str, Any]] = None,
    unlowerable: Optional[Mapping[int, str]] = None,
) -> Decision:
    """Chooses the backend for ``args`` on ``platform`` under ``flags`` (a ``BackendFlags``).

    ``only`` forces one backend (an explicit ``implementation=``), ignoring the enable flags.
    ``unlowerable`` maps backends this lowering cannot hold to the reason (:func:`run`).
    """
    order = tuple(b for b in flags.sdpa_priority if b in NAMES)
    order = order + tuple(int(b) for b in DEFAULT_ORDER if int(b) not in order)
    if only is None:
        order, measured = sdpa_speed.faster_first(order, flags, args, platform, device_info)
    else:
        measured = {}
    reasons: dict[int, str] = {}
    chosen = None
    choice = None
    for b in order:
        if only is not None and b != only:
            reasons[b] = f"disabled: implementation={NAMES[only]} was requested"
            continue
        if only is None and not getattr(flags, FLAG_OF[b]):
            reasons[b] = f"disabled by the flags ({FLAG_OF[b]}=False)"
            continue
        if b == CUDNN and not flags.cudnn_enabled:
            reasons[b] = "disabled by the flags (cudnn_enabled=False, torch.backends.cudnn.enabled)"
            continue
        c = backend_choice(args, b, platform, flags, device_info)
        if unlowerable and b in unlowerable and c.chosen is not None and chosen is None:  # not here
            reasons[b] = unlowerable[b]
            continue
        if chosen is not None:
            if c.chosen is None:
                reasons[b] = _backend_reason(c, b)
            elif measured.get(b, (None,))[0] == chosen:
                reasons[b] = f"{NAMES[chosen]} runs first, {measured[b][1]}"
            else:
                reasons[b] = f"lower priority than {NAMES[chosen]}"
            continue
        if c.chosen is None:
            reasons[b] = _backend_reason(c, b)
        else:
            chosen, choice = b, c
    return Decision(
        platform=platform,
        chosen=chosen,
        order=order,
        reasons=reasons,
        implementation=None if choice is None else choice.chosen,
        implementation_reasons={} if choice is None else dict(choice.reasons),
    )


def _unlowerable(platform: str, required: Sequence[str]) -> dict:
    """Backends that a lowering for ``platform`` cannot hold, with the reason; ``explain()`` does not
    apply these (it describes the call on a machine of that platform).

    * cuDNN in a lowering for several platforms (``platforms=("cpu", "cuda")``): JAX's cuDNN attention
      primitives lower for CUDA only, and every platform's branch is lowered for all of them.
    * cuDNN where JAX cannot trace it (no cuDNN runtime here, e.g. a CUDA export from a CPU-only
      machine): the export carries the next backend's kernel instead of no CUDA kernel at all.
    """
    if platform != "cuda":
        return {}
    if len(set(required)) > 1 and platform in required:
        return {
            CUDNN: "not in a lowering for several platforms "
            f"({', '.join(required)}): JAX's cuDNN attention lowers for CUDA only"
        }
    from pallas_kernels.attention import cudnn  # noqa: PLC0415 - only when lowering for CUDA

    why = cudnn.runtime_unavailable()
    return {CUDNN: why} if why else {}


def run(
    args: base.AttentionArgs,
    flags: Any,
    platforms: Sequence[str],
    optional_platforms: Sequence[str] = (),
    *,
    only: Optional[int] = None,
    op: str = "sdpa",
    shapes: Optional[tuple] = None,
):
    """Decides per platform and runs: ``(out, lse, decisions)``.

    Raises NoAvailableBackendError when a platform of ``platforms`` has no enabled backend that can run
    the call. ``optional_platforms`` are chosen for as well, so that a function traced here and exported
    for one of them carries that platform's kernel; one with no enabled backend that can run the call,
    or whose kernel fails to trace, gets no branch of its own. Every platform without a branch (also
    TPU / ROCm exports) lowers the XLA-path choice (the CPU decision, else the first required one): the
    XLA implementations run anywhere XLA does.
    """
    decisions = []
    for p in tuple(platforms) + tuple(optional_platforms):
        d = decide(
            args,
            flags,
            p,
            only=only,
            device_info=local_device_info(p),
            unlowerable=_unlowerable(p, platforms),
        )
        if d.chosen is None:
            if p in optional_platforms:
                continue
            raise d.error()
        decisions.append(d)
        if p in optional_platforms:
            continue  # chosen so an export for it carries its kernel; not what runs here, so not reported
        rejected = {NAMES[b]: r for b, r in d.reasons.items()}
        rejected.update({f"{NAMES[d.chosen]}/{name}": r for name, r in d.implementation_reasons.items()})
        verbose.report_dispatch(
            op,
            f"{d.chosen_name}@{p}[{d.implementation.name}]",
            rejected,
            shapes or (tuple(args.q.shape), tuple(args.k.shape), tuple(args.v.shape)),
            (str(args.q.dtype),),
        )

    def branch(impl, platform):
        opts = impl.options(flags, platform)
        return lambda a: impl.run_jitted(a, opts)

    def combined(ds):
        if len(ds) == 1:
            return branch(ds[0].implementation, ds[0].platform)(args)
        # Every platform without a branch of its own lowers the default: the XLA-path choice (CPU's
        # backend, with its implementation for any platform when CPU's own is CPU-only; else the first
        # required platform's), passed once so it is traced once.
        first = next((d for d in ds if d.platform == "cpu"), ds[0])
        default, serves = first.implementation, first
        if default.platforms is not None:
            other = backend_choice(args, first.chosen, "other", flags).chosen
            default, serves = (other, None) if other is not None else (default, first)
        branches = {d.platform: branch(d.implementation, d.platform) for d in ds if d is not serves}
        return dispatch.by_platform(
            branches, branch(default, "other" if serves is None else serves.platform), args
        )

    if not decisions:
        raise ValueError("attention dispatch: no lowering platform to choose for (platforms is empty)")
    required = [d for d in decisions if d.platform in platforms]
    try:
        out, lse = combined(decisions)
    except Exception:  # noqa: BLE001 - an optional platform's kernel must never break a required one
        if len(required) == len(decisions):
            raise
        decisions = required
        out, lse = combined(required)
    return out, lse, tuple(decisions)
