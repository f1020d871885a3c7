"""SDPA dispatch: which implementation runs a call, in flag priority order, with a reason per backend.

The table :data:`IMPLEMENTATIONS` maps each backend (``SDPBackend`` value) to its implementation
module per lowering platform; adding a kernel for a platform is one entry. Each module exposes
``unsupported(args, platform) -> list[str]`` and ``attention(args, *, config=None, **opts)``.

Rules (the contract the public API in ``jbackends.attention`` documents):

* The flags in force at trace time (:func:`trace_flags`) give the enabled set and the order
  (``sdpa_priority``). Disabled backends are never used, not even as a fallback.
* The first enabled backend in priority order whose ``unsupported`` list is empty runs.
* When none can, one :class:`NoAvailableBackendError` names every enabled backend and its reasons
  (and which backends the flags disabled).
* MATH (the reference) can run every call on every platform.
* When a call is lowered for several platforms (``platforms=("cpu", "cuda")``), the choice is made
  per platform and combined with ``jax.lax.platform_dependent``.
"""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

import jax

from jbackends._src.sdp_backends import DEFAULT_ORDER, FLAG, RUNNABLE, SDPBackend
from pallas_kernels.attention import base

__all__ = [
    "IMPLEMENTATIONS",
    "NAMES",
    "NoAvailableBackendError",
    "Decision",
    "canonical_platform",
    "default_platform",
    "decide",
    "implementation_for",
    "run",
]

MATH, FLASH, EFFICIENT, CUDNN = (int(b) for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION,
                                                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION))
NAMES = {int(b): b.name for b in RUNNABLE}
FLAG_OF = {int(b): flag for b, flag in FLAG.items()}

#: backend -> {lowering platform or "default": implementation module path}.
#: FLASH / EFFICIENT run the Pallas Triton kernels on CUDA and the blockwise XLA implementations
#: everywhere else; CUDNN exists on CUDA only; MATH everywhere.
IMPLEMENTATIONS: dict[int, dict[str, str]] = {
    FLASH: {"cuda": "pallas_kernels.attention.flash",
            "default": "pallas_kernels.attention.xla_flash"},
    EFFICIENT: {"cuda": "pallas_kernels.attention.mem_efficient",
                "default": "pallas_kernels.attention.xla_mem_efficient"},
    CUDNN: {"cuda": "pallas_kernels.attention.cudnn"},
    MATH: {"default": "pallas_kernels.attention.base"},
}


class NoAvailableBackendError(RuntimeError):
  """No enabled SDPA backend can run the call; the message has every enabled backend's reasons."""


def canonical_platform(p: str) -> str:
  """Lowering-platform name: ``"gpu"`` becomes ``"cuda"`` or ``"rocm"``, others unchanged."""
  p = p.lower()
  if p == "gpu":
    try:
      version = jax.devices("gpu")[0].client.platform_version.lower()
    except Exception:  # noqa: BLE001
      version = "cuda"
    return "rocm" if "rocm" in version else "cuda"
  return p


def default_platform() -> str:
  return canonical_platform(jax.default_backend())


def implementation_for(backend: int, platform: str) -> Optional[ModuleType]:
  """The implementation module of ``backend`` on ``platform`` (None if there is none)."""
  table = IMPLEMENTATIONS[backend]
  path = table.get(platform, table.get("default"))
  return None if path is None else importlib.import_module(path)


def backend_reasons(args: base.AttentionArgs, backend: int, platform: str,
                    device_info: Optional[Mapping[str, Any]] = None) -> list:
  """Why ``backend`` cannot run ``args`` on ``platform`` (flags aside); empty if it can."""
  impl = implementation_for(backend, platform)
  if impl is None:
    return [f"no {NAMES[backend]} implementation for platform {platform!r}"]
  if backend == CUDNN and device_info:
    return list(impl.unsupported(args, platform, **dict(device_info)))
  return list(impl.unsupported(args, platform))


@dataclasses.dataclass(frozen=True)
class Decision:
  """One dispatch decision: the backend chosen on ``platform`` and why each other one was not."""
  platform: str
  chosen: Optional[int]
  order: tuple
  reasons: Mapping[int, str]

  @property
  def chosen_name(self) -> Optional[str]:
    return None if self.chosen is None else NAMES[self.chosen]

  def error(self) -> NoAvailableBackendError:
    enabled = [b for b in self.order if not self.reasons[b].startswith("disabled")]
    lines = [f"  {NAMES[b]}: {self.reasons[b]}" for b in enabled]
    disabled = [NAMES[b] for b in self.order if b not in enabled]
    msg = (f"No enabled SDPA backend can run this call on {self.platform!r}. Enabled backends, "
           f"in priority order:\n" + ("\n".join(lines) if lines else "  (none)"))
    if disabled:
      msg += (f"\nDisabled by the flags (never used as a fallback): {', '.join(disabled)}. "
              "Enable one with jb.attention.sdpa_kernel([...]) or jb.with_backends(math=True).")
    return NoAvailableBackendError(msg)


def decide(args: base.AttentionArgs, flags: Any, platform: str, *,
           only: Optional[int] = None,
           device_info: Optional[Mapping[str, Any]] = None) -> Decision:
  """Chooses the backend for ``args`` on ``platform`` under ``flags`` (a ``BackendFlags``).

  ``only`` forces one backend (an explicit ``implementation=``), ignoring the enable flags.
  """
  order = tuple(b for b in flags.sdpa_priority if b in NAMES)
  order = order + tuple(int(b) for b in DEFAULT_ORDER if int(b) not in order)
  reasons: dict[int, str] = {}
  chosen = None
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
    why = backend_reasons(args, b, platform, device_info)
    if chosen is not None:
      reasons[b] = (f"lower priority than {NAMES[chosen]}" if not why
                    else "; ".join(why))
      continue
    if why:
      reasons[b] = "; ".join(why)
    else:
      chosen = b
  return Decision(platform=platform, chosen=chosen, order=order, reasons=reasons)


def _options(backend: int, flags: Any, platform: str) -> dict:
  if backend == MATH:
    return dict(low_precision=bool(flags.allow_fp16_bf16_reduction_math_sdp))
  if backend in (FLASH, EFFICIENT) and platform == "cuda":
    return dict(allow_tf32=bool(flags.allow_tf32))
  if backend == FLASH and platform == "cpu":
    return dict(cpu_kernel=flags.flash_cpu_kernel)
  return {}


def run(args: base.AttentionArgs, flags: Any, platforms: Sequence[str],
        optional_platforms: Sequence[str] = (), *, only: Optional[int] = None, op: str = "sdpa",
        shapes: Optional[tuple] = None):
  """Decides per platform and runs: ``(out, lse, decisions)``.

  Raises NoAvailableBackendError when a platform of ``platforms`` has no enabled backend that can run
  the call. ``optional_platforms`` are chosen for as well, so that a function traced here and exported
  for one of them carries that platform's kernel; one with no enabled backend that can run the call,
  or whose kernel fails to trace, gets no branch of its own. Every platform without a branch (also
  TPU / ROCm exports) lowers the XLA-path choice (the CPU decision, else the first required one): the
  XLA implementations run anywhere XLA does.
  """
  from jbackends._src.verbose import report_dispatch  # noqa: PLC0415 - cheap, avoids cycles

  decisions = []
  for p in tuple(platforms) + tuple(optional_platforms):
    d = decide(args, flags, p, only=only)
    if d.chosen is None:
      if p in optional_platforms:
        continue
      raise d.error()
    decisions.append(d)
    if p in optional_platforms:
      continue  # chosen so an export for it carries its kernel; not what runs here, so not reported
    report_dispatch(op, f"{d.chosen_name}@{p}", {NAMES[b]: r for b, r in d.reasons.items()},
                    shapes or (tuple(args.q.shape), tuple(args.k.shape), tuple(args.v.shape)),
                    (str(args.q.dtype),))

  def branch(d):
    impl = implementation_for(d.chosen, d.platform)
    opts = _options(d.chosen, flags, d.platform)
    return lambda a: impl.attention(a, **opts)

  def combined(ds):
    # The XLA-path choice (CPU's, else the first required platform's) also serves every platform
    # without a branch of its own; it is passed once, as the default, so it is traced once.
    fallback = next((d for d in ds if d.platform == "cpu"), ds[0])
    if len(ds) == 1:
      return branch(ds[0])(args)
    return jax.lax.platform_dependent(
        args, **{d.platform: branch(d) for d in ds if d is not fallback}, default=branch(fallback))

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
