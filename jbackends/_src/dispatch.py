"""The one dispatcher: which implementation runs a call on each lowering platform, and why not the others.

SDPA (`attention_dispatch`) and int4 (`jbackends.quantized`) describe their kernels as
:class:`Implementation` objects in ordered lists (their registries) and choose with :func:`choose`;
:func:`by_platform` then combines one choice per lowering platform with ``jax.lax.platform_dependent``.

An implementation answers three questions:

* ``unsupported(call, platform, device) -> list[str]``: why it cannot run ``call`` when lowered for
  ``platform`` (empty: it can). ``device`` is a mapping of what is known about the target device
  (``compute_capability``, ``cudnn_version``, ...; empty when nothing is assumed).
* ``options(flags, platform) -> dict``: the keyword options its ``run`` takes from the flags in force
  (kernels never read flags themselves).
* ``run(call, **options)``: compute.

Ranking hook: :func:`set_ranker` installs, per operation, a function that reorders the runnable
implementations of one backend for one call (a cost model or a table measured on the device). Without
one, registry order decides. Rankers see only implementations that can run the call, so they can never
pick one that cannot. They are read at trace time and are not part of the jit key.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax._src import core as _jax_core

__all__ = [
    "Implementation",
    "Choice",
    "forward_mode_active",
    "lazy",
    "choose",
    "set_ranker",
    "ranker",
    "by_platform",
    "canonical_platform",
    "default_platform",
    "GPU_LOWERING",
]

#: Lowering platforms that are GPUs (each gets its own ``platform_dependent`` branch). Not
#: ``pallas_kernels.gpu.GPU_PLATFORMS``, the names under which a kernel sees an NVIDIA GPU.
GPU_LOWERING = ("cuda", "rocm")


def forward_mode_active() -> bool:
    """Whether forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``'s outer pass) is
    tracing the current call: a JVP trace below the current one, with no staging (``jax.jit``) trace
    between. A function staged by a jit inside ``jax.jvp`` is not detected: its jaxpr is cached
    and reused outside the jvp, so the choice there must not depend on it (JAX's own error stands)."""
    trace = _jax_core.trace_ctx.trace
    while trace is not None and not isinstance(trace, _jax_core.EvalTrace):
        kind = type(trace).__name__
        if kind == "JVPTrace":
            return True
        if "Jaxpr" in kind:  # DynamicJaxprTrace and kin: a staged (cached) trace
            return False
        trace = getattr(trace, "parent_trace", None)
    return False


def _no_options(flags: Any, platform: str) -> dict:
    del flags, platform
    return {}


def lazy(path: str) -> Callable[..., Any]:
    """``"package.module:function"`` as a callable that imports the module at its first call (kernel
    modules, and optional extensions, load only when a call needs them)."""
    module, _, attr = path.partition(":")

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__qualname__ = call.__name__ = path
    return call


@dataclasses.dataclass(frozen=True, eq=False)
class Implementation:
    """One kernel or fallback that can serve an operation.

    Attributes:
      name: short unique name (``"triton_flash"``, ``"cpp_flash"``); what ``explain`` reports.
      technology: what it is built with (``"Pallas Triton"``, ``"C++ (jax.ffi)"``, ``"XLA"``, ...).
      platforms: lowering platforms it runs on; None for every platform XLA lowers for.
      unsupported: ``(call, platform, device) -> list[str]`` (see the module docstring).
      run: ``(call, **options) -> result``.
      options: ``(flags, platform) -> dict`` of ``run`` keyword options.
      description: one line for reports and docs.
      forward_mode: False for a ``jax.custom_vjp`` kernel, which cannot run under forward-mode
        autodiff (`forward_mode_active`); None (not declared) never refuses a call for it.
      symbolic_shapes: True when it traces calls whose arrays have symbolic dimensions (a
        shape-polymorphic ``jax.export``); the others are refused such calls with a reason, before
        their ``unsupported`` (whose shape checks could not decide) is asked.
    """

    name: str
    technology: str
    platforms: tuple[str, ...] | None
    unsupported: Callable[[Any, str, Mapping[str, Any]], Sequence[str]]
    run: Callable[..., Any]
    options: Callable[[Any, str], dict] = _no_options
    description: str = ""
    forward_mode: bool | None = None
    symbolic_shapes: bool = False

    def reasons(self, call: Any, platform: str, device: Mapping[str, Any] | None = None) -> list[str]:
        """Why this implementation cannot run ``call`` on ``platform`` (empty if it can)."""
        if self.platforms is not None and platform not in self.platforms:
            return [f"{self.technology} runs on {'/'.join(self.platforms)} only (lowering for {platform})"]
        if not self.symbolic_shapes and has_symbolic_dims(call):
            return ["symbolic dimensions (a shape-polymorphic jax.export): its shape checks need sizes"]
        why = list(self.unsupported(call, platform, device or {}))
        if self.forward_mode is False and forward_mode_active():
            why.append(
                "forward-mode autodiff (jax.jvp, jacfwd, hessian) is tracing this call, and this "
                "kernel's gradient is a custom_vjp (reverse mode only)"
            )
        return why

    def run_jitted(self, call: Any, options: Mapping[str, Any]) -> Any:
        """``run(call, **options)`` as one ``jax.jit`` (``options`` static): what dispatch calls.

        Under a trace it is a nested jit that XLA inlines. Called eagerly (a notebook cell, a research
        loop without ``jax.jit``) it compiles once per shape, dtype and option set, where eager JAX
        would compile and dispatch each op of the kernel on its own, forward and backward: a small
        MATH call's first run ~5x faster, a blockwise XLA kernel's every run (its loops re-trace when
        run eagerly) ~100x. ``jax.disable_jit()`` still runs it op by op. The options must be
        hashable (they are the flags' values: bools, strings, numbers).
        """
        return _jitted(self)(call, tuple(sorted(options.items())))

    def __repr__(self) -> str:
        return f"<Implementation {self.name} ({self.technology})>"


@functools.lru_cache(maxsize=None)  # one per Implementation (hashed by identity): a handful
def _jitted(impl: Implementation) -> Callable[..., Any]:
    def run(call, options):
        return impl.run(call, **dict(options))

    run.__name__ = run.__qualname__ = impl.name  # profiles and HLO show jit(<implementation>)
    return jax.jit(run, static_argnums=1)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs ``call`` on ``platform``: ``chosen`` (None if nothing can) and, per candidate not
    chosen, why (``reasons``: implementation name -> reason)."""

    platform: str
    chosen: Implementation | None
    candidates: tuple[Implementation, ...]
    reasons: Mapping[str, str]


Ranker = Callable[[Sequence[Implementation], Any, str, Mapping[str, Any]], Sequence[Implementation]]
_RANKERS: dict[str, Ranker] = {}
_RANKERS_LOCK = threading.Lock()


def set_ranker(op: str, fn: Ranker | None) -> Ranker | None:
    """Install ``fn(runnable, call, platform, device) -> reordered runnable`` for operation ``op``
    (``"sdpa"``, ``"int4"``); None removes it. Returns the previous ranker.

    The ranker sees only the implementations that can run the call, in registry order, and must return
    a permutation of them (a cost model, or a table measured on the device). It is process-wide and read
    when a call is traced: a function already traced (and cached by ``jax.jit``) keeps its choice until
    it is traced again (``jax.clear_caches()``, or new shapes or flags)."""
    if fn is not None and not callable(fn):
        raise TypeError(f"`fn` must be callable or None; got {type(fn).__name__}")
    with _RANKERS_LOCK:
        previous = _RANKERS.pop(op, None)
        if fn is not None:
            _RANKERS[op] = fn
    return previous


def ranker(op: str) -> Ranker | None:
    """The ranker installed for ``op`` (None: registry order)."""
    return _RANKERS.get(op)


def has_symbolic_dims(call: Any) -> bool:
    """Whether an array of ``call`` (a pytree) has a symbolic dimension (``jax.export.symbolic_shape``);
    a call record that is no pytree of arrays says so itself (its ``symbolic``)."""
    if isinstance(getattr(call, "symbolic", None), bool):
        return call.symbolic
    return any(jax.export.is_symbolic_dim(d) for x in jax.tree.leaves(call) for d in getattr(x, "shape", ()))


def choose(
    op: str,
    candidates: Sequence[Implementation],
    call: Any,
    platform: str,
    *,
    device: Mapping[str, Any] | None = None,
    excluded: Mapping[str, str] | None = None,
) -> Choice:
    """The first candidate (in registry order, or the ranker's) that can run ``call`` on ``platform``.

    ``excluded`` maps implementation names to the reason they may not be used (a flag's filter); those
    are never chosen.
    """
    device = dict(device or {})
    excluded = dict(excluded or {})
    reasons: dict[str, str] = {}
    runnable = []
    for impl in candidates:
        why = impl.reasons(call, platform, device)
        if impl.name in excluded:  # what it cannot do first: that holds whatever the flags say
            reasons[impl.name] = "; ".join(why + [excluded[impl.name]])
            continue
        if why:
            reasons[impl.name] = "; ".join(why)
        else:
            runnable.append(impl)
    rank = _RANKERS.get(op)
    if rank is not None and len(runnable) > 1:
        ranked = list(rank(tuple(runnable), call, platform, device))
        if sorted(map(id, ranked)) != sorted(map(id, runnable)):
            raise ValueError(
                f"the ranker for {op!r} must return a permutation of its candidates; got "
                f"{[getattr(i, 'name', i) for i in ranked]}"
            )
        runnable = ranked
    chosen = runnable[0] if runnable else None
    for impl in runnable[1:]:
        reasons[impl.name] = f"lower priority than {chosen.name}"
    return Choice(platform=platform, chosen=chosen, candidates=tuple(candidates), reasons=reasons)


def by_platform(
    branches: Mapping[str, Callable[..., Any]], default: Callable[..., Any], *operands: Any
) -> Any:
    """``default(*operands)`` when there is nothing to choose, else one ``jax.lax.platform_dependent``
    with a branch per lowering platform (``default`` serves every platform without one)."""
    if not branches:
        return default(*operands)
    return jax.lax.platform_dependent(*operands, default=default, **branches)


#: The platform names a caller may give (``platforms=``, ``explain(platform=...)``); "gpu" is canonicalised.
PLATFORM_NAMES = ("cpu", "cuda", "gpu", "rocm", "tpu")


def canonical_platform(p: str) -> str:
    """Lowering-platform name: ``"gpu"`` becomes ``"cuda"`` or ``"rocm"``, others unchanged."""
    p = p.lower()
    if p == "gpu":
        try:
            version = jax.devices("gpu")[0].client.platform_version.lower()
        except Exception:  # noqa: BLE001 - no GPU backend: name the common one
            version = "cuda"
        return "rocm" if "rocm" in version else "cuda"
    return p


def default_platform() -> str:
    """The lowering platform of JAX's default backend."""
    return canonical_platform(jax.default_backend())
