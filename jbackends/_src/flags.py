"""The flag registry, the state that JAX traces through, and `with_backends`.

Every backend flag is declared exactly once, as a `Flag` in `_DECLARATIONS` below. Everything else is
derived from that table: the `BackendFlags` snapshot class, the validation of `with_backends(...)` /
`set_flags(...)`, the jit key, the XLA compiler options that `jb.jit` passes, the docstrings, and the
torch-shaped mirror modules (`jb.cuda.enable_flash_sdp`, `jb.cudnn.deterministic = True`, ...; see
`_src/mirror.py`).

State model:

* Process defaults live in a module-level dict (torch semantics: they reach every thread and every later
  notebook cell, also when set inside `contextvars.copy_context().run(...)`).
* Scoped overrides live in a `contextvars.ContextVar` (the source of truth for scopes).
* A `jax.make_user_context` (created once per process; a module reload reuses it) mirrors a hashable,
  canonical tuple of the *trace-affecting* flags, so `jax.jit`, `lax.scan` body caches etc. retrace
  exactly when those flags change. Its global value mirrors the process defaults; its thread-local value
  mirrors the ContextVar of whichever scope last touched this thread. A second, global-only user context
  mirrors the process defaults alone, so a `set_flags` in one thread changes the key of every thread,
  including one whose thread-local value was computed against the old defaults (see `_JIT_KEY`).
* Scoped precision flags are bridged to JAX's thread-local `default_matmul_precision` in step with the
  jit key (`_sync_precision`); process-default precision flags to JAX's global one.
* `trace_flags()` is the one accessor kernels use at trace time. It recomputes the tuple from the
  ContextVar and compares it with the jit key: under a trace, a disagreement (e.g. an asyncio task that
  resumed on a thread whose key another task set) raises `FlagsOutOfSyncError` instead of silently
  poisoning a cache entry; outside a trace it re-syncs the key and continues.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from jax._src import config as _jax_config
from jax._src import core as _jax_core
import opt_einsum as _opt_einsum

__all__ = [
    "BackendFlags",
    "Flag",
    "FlagsFrozenError",
    "FlagsOutOfSyncError",
    "current_flags",
    "disable_global_flags",
    "enable_global_flags",
    "flags_frozen",
    "jit",
    "propagate",
    "reset_flags",
    "set_flags",
    "sync",
    "trace_flags",
    "with_backends",
]


class FlagsFrozenError(RuntimeError):
    """Raised when a process default is changed after `disable_global_flags()`."""


class FlagsOutOfSyncError(RuntimeError):
    """The jit key of this thread does not match the flags of the running context (see `sync`)."""


# --------------------------------------------------------------------------------------------------
# Parsers: each canonicalises a value or raises with the allowed values in the message.
# --------------------------------------------------------------------------------------------------


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    # numpy / jax scalar booleans are fine; arrays and other types are not.
    if type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"flag {name!r} expects a bool, got {type(value).__name__} {value!r}")


def _parse_int(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"flag {name!r} expects an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"flag {name!r} expects an int >= {minimum}, got {value}")
    return int(value)


def _choice(*allowed: str, aliases: Mapping[str, str] | None = None,
            refused: Mapping[str, str] | None = None) -> Callable[[str, Any], str]:
    """A string flag: one of `allowed`; `aliases` map other spellings; `refused` values get their message."""
    aliases = dict(aliases or {})
    refused = dict(refused or {})

    def parse(name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(
                f"flag {name!r} expects a str, one of {list(allowed)}, got {type(value).__name__} {value!r}"
            )
        if value.lower() in refused:
            raise ValueError(f"flag {name!r}: {value!r} {refused[value.lower()]}")
        canon = aliases.get(value.lower(), value.lower())
        if canon not in allowed:
            raise ValueError(f"flag {name!r} must be one of {list(allowed)}, got {value!r}")
        return canon

    parse.allowed = allowed  # type: ignore[attr-defined]
    return parse


# SDPBackend values (torch.nn.attention.SDPBackend): MATH=0, FLASH_ATTENTION=1,
# EFFICIENT_ATTENTION=2, CUDNN_ATTENTION=3. Kept as ints here so the flags core does not import the
# attention module; `jb.attention.SDPBackend` is the public enum with the same values.
_SDP_NAMES = {0: "MATH", 1: "FLASH_ATTENTION", 2: "EFFICIENT_ATTENTION", 3: "CUDNN_ATTENTION"}
_SDP_DEFAULT_ORDER = (1, 2, 3, 0)


def _parse_sdpa_priority(name: str, value: Any) -> tuple[int, ...]:
    """Canonical form: a full permutation of (0, 1, 2, 3); listed backends first, the rest after."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        value = (value,)
    order: list[int] = []
    for item in value:
        if isinstance(item, str):
            key = item.upper()
            by_name = {v: k for k, v in _SDP_NAMES.items()}
            by_name.update({"FLASH": 1, "EFFICIENT": 2, "MEM_EFFICIENT": 2, "CUDNN": 3})
            if key not in by_name:
                raise ValueError(
                    f"flag {name!r}: unknown SDPA backend {item!r}; expected SDPBackend members "
                    f"{list(_SDP_NAMES.values())}"
                )
            code = by_name[key]
        elif isinstance(item, int) and not isinstance(item, bool) or hasattr(item, "value"):
            code = int(getattr(item, "value", item))
        else:
            raise TypeError(f"flag {name!r} expects SDPBackend members, got {type(item).__name__} {item!r}")
        if code not in _SDP_NAMES:
            raise ValueError(
                f"flag {name!r}: {item!r} cannot be prioritised; expected one of "
                f"{[f'SDPBackend.{n}' for n in _SDP_NAMES.values()]}"
            )
        if code in order:
            raise ValueError(f"flag {name!r}: backend {_SDP_NAMES[code]} listed twice in {value!r}")
        order.append(code)
    return tuple(order) + tuple(c for c in _SDP_DEFAULT_ORDER if c not in order)


# --------------------------------------------------------------------------------------------------
# The declaration type.
# --------------------------------------------------------------------------------------------------

# Where a flag appears in the torch-shaped mirror. `kind` is one of:
#   "setter"  -> module function `name(value)` that sets the process default (torch: enable_flash_sdp)
#   "getter"  -> module function `name()` returning the value in force (torch: flash_sdp_enabled)
#   "attr"    -> property `module.name` (get: value in force; set: process default)
#   "getset"  -> function `name(value=None)`: returns the value in force, sets the default if given
Mirror = tuple[str, str, str]  # (module path relative to jbackends, kind, name)


@dataclasses.dataclass(frozen=True, eq=False)
class Flag:
    """One backend flag, declared once.

    Attributes:
      name: the short name, the `with_backends` keyword and the `BackendFlags` attribute.
      default: the process default at import (torch 2.x's default).
      help: one line of documentation.
      parse: `(name, value) -> canonical value`; raises `TypeError`/`ValueError` naming the allowed values.
      torch: the torch spelling(s) this flag mirrors, for docs and the environment report.
      mirrors: where the torch-shaped modules expose it (see `Mirror`).
      traced: whether the flag can change what a traced function computes (part of the jit key).
      compiler_options: for compile-time flags, value -> XLA compiler options `jb.jit` passes.
      implies: value -> other flags set together with it (torch couples allow_tf32 and the precision).
      requires: (value, all values after the update) -> an error message if the combination is refused.
    """

    name: str
    default: Any
    help: str
    parse: Callable[[str, Any], Any]
    torch: tuple[str, ...] = ()
    mirrors: tuple[Mirror, ...] = ()
    traced: bool = True
    compiler_options: Callable[[Any], Mapping[str, Any]] | None = None
    implies: Callable[[Any], Mapping[str, Any]] | None = None
    requires: Callable[[Any, Mapping[str, Any]], str | None] | None = None

    @property
    def value(self) -> Any:
        """The value in force in the current context."""
        return getattr(current_flags(), self.name)

    def set(self, value: Any) -> None:
        """Set the process default (like `set_flags(**{name: value})`)."""
        set_flags(**{self.name: value})

    def __call__(self, value: Any) -> "with_backends":
        """Scoped override: `with jb.flags.deterministic(True): ...` (also a decorator)."""
        return with_backends(**{self.name: value})

    def __bool__(self) -> bool:
        raise TypeError(
            f"bool() of the flag object {self.name!r} is ambiguous; did you mean to use "
            f"'jb.flags.{self.name}.value' (or jb.current_flags().{self.name})?"
        )

    def __repr__(self) -> str:
        return f"Flag({self.name!r}, default={self.default!r}, value={self.value!r})"


def _bool(name, default, help, **kw) -> Flag:
    return Flag(name, default, help, _parse_bool, **kw)


def _sdp_mirrors(short: str) -> tuple[Mirror, ...]:
    return (("cuda", "setter", f"enable_{short}_sdp"), ("cuda", "getter", f"{short}_sdp_enabled"))


# torch's "medium" lets float32 matmuls use bf16 internally where a fast kernel exists, else it acts as
# "high". JAX's "bfloat16" (Precision.DEFAULT, XLA's fastest) is that portable hint. The explicit dot
# algorithm BF16_BF16_F32 would be stricter, but XLA refuses algorithms a device cannot run (no bf16
# tensor cores on Colab's T4; the TF32 preset does not even compile on CPU), so presets are not used.
_PRECISION_TO_JAX = {"highest": "float32", "high": "tensorfloat32", "medium": "bfloat16"}
_OPT_EINSUM_STRATEGIES = tuple(_opt_einsum.paths._PATH_OPTIONS)  # auto, greedy, optimal, dp, ...

_DECLARATIONS: tuple[Flag, ...] = (
    # ---- scaled dot product attention (torch.backends.cuda.*_sdp*, torch.nn.attention.sdpa_kernel)
    _bool("flash", True, "Allow the flash attention SDPA backend (Pallas on GPU, blockwise XLA on CPU).",
          torch=("torch.backends.cuda.enable_flash_sdp",), mirrors=_sdp_mirrors("flash")),
    _bool("mem_efficient", True, "Allow the memory-efficient SDPA backend (supports an additive bias).",
          torch=("torch.backends.cuda.enable_mem_efficient_sdp",), mirrors=_sdp_mirrors("mem_efficient")),
    _bool("math", True, "Allow the reference (math) SDPA backend, which can serve every call.",
          torch=("torch.backends.cuda.enable_math_sdp",), mirrors=_sdp_mirrors("math")),
    _bool("cudnn", True, "Allow the cuDNN SDPA backend (GPU only, via jax.nn's cudnn implementation).",
          torch=("torch.backends.cuda.enable_cudnn_sdp",), mirrors=_sdp_mirrors("cudnn")),
    Flag("flash_cpu_kernel", "auto",
         "What runs the FLASH SDPA backend when lowered for CPU: 'auto' (the C++ kernel through jax.ffi "
         "where it can run the call, else blockwise XLA), 'cpp' (the C++ kernel or an error saying why "
         "not), 'xla' (blockwise XLA only: portable jax.export artifacts, no custom call).",
         _choice("auto", "cpp", "xla")),
    Flag("sdpa_priority", _SDP_DEFAULT_ORDER,
         "Order in which enabled SDPA backends are tried (SDPBackend members; unlisted ones follow).",
         _parse_sdpa_priority, torch=("torch.nn.attention.sdpa_kernel(set_priority=True)",)),
    _bool("allow_fp16_bf16_reduction_math_sdp", False,
          "Let the math SDPA backend reduce fp16/bf16 inputs in low precision instead of float32.",
          torch=("torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp",),
          mirrors=(("cuda", "setter", "allow_fp16_bf16_reduction_math_sdp"),
                   ("cuda", "getter", "fp16_bf16_reduction_math_sdp_allowed"))),
    # ---- matmul precision (torch.backends.cuda.matmul.*, torch.set_float32_matmul_precision)
    _bool("allow_tf32", False,
          "Allow TF32 for float32 matmuls (sets float32_matmul_precision to 'high', False to 'highest').",
          torch=("torch.backends.cuda.matmul.allow_tf32",), mirrors=(("cuda.matmul", "attr", "allow_tf32"),),
          implies=lambda v: {"float32_matmul_precision": "high" if v else "highest"}),
    Flag("float32_matmul_precision", "highest",
         "Internal precision of float32 matmuls: 'highest' (fp32), 'high' (TF32), 'medium' (bf16). "
         "Bridged to jax.default_matmul_precision where set.",
         _choice("highest", "high", "medium"),
         torch=("torch.set_float32_matmul_precision", "torch.get_float32_matmul_precision"),
         mirrors=(("", "setter", "set_float32_matmul_precision"), ("", "getter", "get_float32_matmul_precision")),
         implies=lambda v: {"allow_tf32": v != "highest"}),
    _bool("allow_fp16_reduced_precision_reduction", True,
          "Allow fp16 matmuls to reduce in fp16. False makes jb.einsum request float32 accumulation "
          "(preferred_element_type=float32, then a cast back) for fp16 operands; plain jnp matmuls are "
          "untouched (XLA's CPU and GPU GEMMs accumulate fp16 in fp32 anyway).",
          torch=("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",),
          mirrors=(("cuda.matmul", "attr", "allow_fp16_reduced_precision_reduction"),)),
    _bool("allow_bf16_reduced_precision_reduction", True,
          "Allow bf16 matmuls to reduce in bf16. False makes jb.einsum request float32 accumulation "
          "(preferred_element_type=float32, then a cast back) for bf16 operands; plain jnp matmuls are "
          "untouched (XLA's CPU and GPU GEMMs accumulate bf16 in fp32 anyway).",
          torch=("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",),
          mirrors=(("cuda.matmul", "attr", "allow_bf16_reduced_precision_reduction"),)),
    # ---- cuDNN (torch.backends.cudnn.*)
    _bool("cudnn_enabled", True, "Allow cuDNN-backed kernels (cuDNN SDPA, cuDNN GEMM fusions).",
          torch=("torch.backends.cudnn.enabled",), mirrors=(("cudnn", "attr", "enabled"),),
          compiler_options=lambda v: {} if v else {"xla_gpu_cudnn_gemm_fusion_level": 0}),
    _bool("cudnn_allow_tf32", True, "Allow TF32 in convolutions run through jb.conv / flax convs in scope.",
          torch=("torch.backends.cudnn.allow_tf32",), mirrors=(("cudnn", "attr", "allow_tf32"),)),
    _bool("deterministic", False,
          "Require deterministic kernels (XLA: xla_gpu_deterministic_ops through jb.jit; "
          "jbackends kernels pick deterministic variants).",
          torch=("torch.backends.cudnn.deterministic",), mirrors=(("cudnn", "attr", "deterministic"),),
          compiler_options=lambda v: {"xla_gpu_deterministic_ops": v}),
    _bool("benchmark", False,
          "Search GPU kernel configurations exhaustively at compile time (xla_gpu_exhaustive_tiling_search "
          "through jb.jit). XLA autotunes with its default search either way, unlike cuDNN's heuristics.",
          torch=("torch.backends.cudnn.benchmark",), mirrors=(("cudnn", "attr", "benchmark"),), traced=False,
          compiler_options=lambda v: {"xla_gpu_exhaustive_tiling_search": v}),
    Flag("benchmark_limit", 10,
         "Most autotuning candidates tried per kernel when benchmark=True (xla_gpu_autotune_max_solutions).",
         functools.partial(_parse_int, minimum=0), torch=("torch.backends.cudnn.benchmark_limit",),
         mirrors=(("cudnn", "attr", "benchmark_limit"),), traced=False,
         compiler_options=lambda v: {"xla_gpu_autotune_max_solutions": v}),
    # ---- linear algebra / BLAS library choice (torch.backends.cuda.preferred_*_library)
    Flag("preferred_linalg_library", "default",
         "GPU linear-algebra library preference: 'default', 'cusolver' or 'magma'. In JAX it selects the "
         "GPU nonsymmetric eigensolver of jb.linalg.eig / eigvals (lax.linalg.EigImplementation); every "
         "other JAX linalg op has one GPU implementation (cuSOLVER/cuBLAS) and CPU always uses LAPACK.",
         _choice("default", "cusolver", "magma"), torch=("torch.backends.cuda.preferred_linalg_library",),
         mirrors=(("cuda", "getset", "preferred_linalg_library"),)),
    Flag("preferred_blas_library", "cublas",
         "GPU BLAS preference: 'cublas' or 'cublaslt' (xla_gpu_enable_cublaslt through jb.jit). torch's "
         "spellings 'default' and 'hipblas' mean 'cublas', 'hipblaslt' means 'cublaslt'.",
         _choice("cublas", "cublaslt",
                 aliases={"default": "cublas", "hipblas": "cublas", "hipblaslt": "cublaslt", "lt": "cublaslt"},
                 refused={"ck": "(ROCm composable kernels) has no XLA counterpart; XLA chooses between "
                                "cuBLAS/hipBLAS and cuBLASLt/hipBLASLt only: use 'cublas' or 'cublaslt'"}),
         torch=("torch.backends.cuda.preferred_blas_library",), traced=False,
         mirrors=(("cuda", "getset", "preferred_blas_library"),),
         compiler_options=lambda v: {"xla_gpu_enable_cublaslt": v == "cublaslt"}),
    # ---- opt_einsum (torch.backends.opt_einsum.*)
    _bool("opt_einsum_enabled", True, "Let jb.einsum optimise contraction order with opt_einsum.",
          torch=("torch.backends.opt_einsum.enabled",), mirrors=(("opt_einsum", "attr", "enabled"),)),
    Flag("opt_einsum_strategy", "auto", "opt_einsum path strategy used by jb.einsum.",
         _choice(*_OPT_EINSUM_STRATEGIES), torch=("torch.backends.opt_einsum.strategy",),
         mirrors=(("opt_einsum", "attr", "strategy"),),
         requires=lambda v, values: None if values["opt_einsum_enabled"] else (
             "opt_einsum is not enabled, so setting a `strategy` will not have an effect; "
             "set opt_einsum_enabled=True (jb.opt_einsum.enabled = True) first")),
    # ---- nn.MultiheadAttention fast path (torch.backends.mha.*)
    _bool("mha_fastpath", True, "Let jb.nn.MultiHeadAttention use the fused SDPA dispatch.",
          torch=("torch.backends.mha.set_fastpath_enabled",),
          mirrors=(("mha", "setter", "set_fastpath_enabled"), ("mha", "getter", "get_fastpath_enabled"))),
    # ---- quantized kernels (torch.backends.quantized.engine)
    Flag("quantized_engine", "auto", "int4 matmul engine: 'auto' (Pallas on GPU, XLA/C++ on CPU), 'pallas', 'xla'.",
         _choice("auto", "pallas", "xla"), torch=("torch.backends.quantized.engine",),
         mirrors=(("quantized", "attr", "engine"),)),
    # ---- verbosity (torch.backends.mkl.verbose / mkldnn.verbose): runtime only, never in the jit key
    Flag("verbose", 0, "Report dispatch decisions and compilations to the 'jbackends' logger (0 off, 1, 2).",
         functools.partial(_parse_int, minimum=0), torch=("torch.backends.mkl.verbose", "torch.backends.mkldnn.verbose"),
         traced=False),
)

FLAGS: Mapping[str, Flag] = {f.name: f for f in _DECLARATIONS}
_TRACED = tuple(f.name for f in _DECLARATIONS if f.traced)
_COMPILE_TIME = tuple(f.name for f in _DECLARATIONS if f.compiler_options is not None)
_PRECISION_FLAGS = ("allow_tf32", "float32_matmul_precision")


def _flags_doc() -> str:
    rows = []
    for f in _DECLARATIONS:
        allowed = getattr(f.parse, "allowed", None)
        extra = f" One of {list(allowed)}." if allowed else ""
        kind = "" if f.traced else " (not traced)"
        rows.append(f"      {f.name} (default {f.default!r}){kind}: {f.help}{extra}")
    return "\n".join(rows)


BackendFlags = globals().get("BackendFlags")
if BackendFlags is None or tuple(f.name for f in dataclasses.fields(BackendFlags)) != tuple(FLAGS):
    # (A reload keeps the class, so snapshots taken before it still compare equal and `isinstance`
    # against `jb.BackendFlags` keeps working.)
    BackendFlags = dataclasses.make_dataclass(
        "BackendFlags", [(f.name, Any) for f in _DECLARATIONS], frozen=True
    )
BackendFlags.__module__ = __name__
BackendFlags.__doc__ = (
    "Frozen, hashable snapshot of every backend flag (an attribute per short name).\n\n"
    "    Obtain it with `jb.current_flags()`; kernels use `trace_flags()`.\n\n    Flags:\n" + _flags_doc()
)


# --------------------------------------------------------------------------------------------------
# State.
# --------------------------------------------------------------------------------------------------

# Process state survives `importlib.reload` (a reload re-executes this module in the same namespace):
# defaults set before the reload stay in force, and the JAX precision saved by the bridge is not lost.
_previous_defaults = globals().get("_DEFAULTS", {})
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in _DECLARATIONS}
_DEFAULTS.update({k: v for k, v in _previous_defaults.items() if k in _DEFAULTS})
del _previous_defaults
_defaults_lock = globals().get("_defaults_lock") or threading.RLock()
_defaults_version = globals().get("_defaults_version", 0) + 1
_frozen = globals().get("_frozen", False)
# defaults changed through set_flags (bridged to JAX where relevant)
_explicit_defaults: set[str] = {n for n in globals().get("_explicit_defaults", ()) if n in _DEFAULTS}

_Overrides = tuple  # sorted tuple of (name, value): immutable and hashable
_OVERRIDES: contextvars.ContextVar[_Overrides] = globals().get("_OVERRIDES") or contextvars.ContextVar(
    "jbackends_overrides", default=()
)


def _key_of(values: Mapping[str, Any]) -> tuple:
    return tuple(values[n] for n in _TRACED)


# The jit key, in two user contexts, each created once per process (`importlib.reload` re-executes this
# module in the same namespace, so existing contexts are reused rather than registering new ones):
#
# * `_JIT_KEY` carries the flags in force. Its global value mirrors the process defaults; its
#   thread-local value (set while a scope overrides a traced flag) mirrors the ContextVar.
# * `_DEFAULTS_KEY` is global only and mirrors the process defaults. JAX's thread-local value shadows
#   the global one, so without it a thread inside a scope would keep a key computed against the old
#   defaults after another thread called `set_flags`, and a plain `jax.jit` call there would hit a
#   cache entry traced under other flags. With it, the key changes in every thread at once; the stale
#   thread then retraces, and `trace_flags` either finds the same flags (the scope overrides the
#   changed default) or raises `FlagsOutOfSyncError`: never a stale executable.
_JIT_KEY = globals().get("_JIT_KEY") or jax.make_user_context(default_value=_key_of(_DEFAULTS))
_JIT_KEY.set_global(_key_of(_DEFAULTS))
_DEFAULTS_KEY = globals().get("_DEFAULTS_KEY") or jax.make_user_context(default_value=_key_of(_DEFAULTS))
_DEFAULTS_KEY.set_global(_key_of(_DEFAULTS))
_UNSET = None  # filled lazily: the marker jax uses for "no thread-local value"
# Per thread: whether jbackends set JAX's thread-local default_matmul_precision, what it was before,
# and the value applied (see `_sync_precision`).
_thread_state = globals().get("_thread_state") or threading.local()

_snapshot_cache: dict[tuple, Any] = {}


def _effective(overrides: _Overrides) -> dict[str, Any]:
    values = dict(_DEFAULTS)
    values.update(overrides)
    return values


def current_flags() -> Any:
    """The flags in force in the current context, as a frozen, hashable `BackendFlags`.

    Example:
      >>> import jbackends as jb
      >>> with jb.with_backends(flash=False):
      ...     jb.current_flags().flash
      False
    """
    overrides = _OVERRIDES.get()
    cache_key = (overrides, _defaults_version)
    snap = _snapshot_cache.get(cache_key)
    if snap is None:
        snap = BackendFlags(**_effective(overrides))
        if len(_snapshot_cache) > 512:
            _snapshot_cache.clear()
        _snapshot_cache[cache_key] = snap
    return snap


def _expected_key() -> tuple:
    snap = current_flags()
    return tuple(getattr(snap, n) for n in _TRACED)


def _set_thread_key() -> None:
    """Make this thread's jit key and JAX matmul precision mirror the ContextVar.

    The key's thread-local value is unset when no traced flag is overridden (the global value, the
    process defaults, is then in force).
    """
    global _UNSET
    overrides = dict(_OVERRIDES.get())
    obj = _JIT_KEY._obj
    if any(n in overrides for n in _TRACED):
        obj.swap_local(_expected_key())
    else:
        if _UNSET is None:
            from jax._src.config import config_ext

            _UNSET = config_ext.unset
        obj.set_local(_UNSET)
    _sync_precision(overrides)


def _sync_precision(overrides: Mapping[str, Any]) -> None:
    """Bridge scoped precision flags to JAX's (thread-local) `default_matmul_precision`.

    JAX's setting is per thread while scopes are per context (asyncio task, `propagate`d worker), so it
    is re-applied from the ContextVar whenever the jit key is (`with_backends`, `sync`, `propagate`).
    jbackends only touches it while a scope overrides a precision flag: it saves what the thread had
    before and restores it when no such scope is in force. A scope that does not change the precision
    leaves JAX's setting alone (so a user's own `jax.default_matmul_precision(...)` inside it stands).
    """
    state = _jax_config.default_matmul_precision
    ts = _thread_state
    owned = getattr(ts, "precision_owned", False)
    if any(n in overrides for n in _PRECISION_FLAGS):
        want = _PRECISION_TO_JAX[overrides["float32_matmul_precision"]]
        if not owned:
            ts.precision_saved = state.swap_local(want)
            ts.precision_owned, ts.precision_applied = True, want
        elif ts.precision_applied != want:
            state.set_local(want)
            ts.precision_applied = want
    elif owned:
        state.set_local(ts.precision_saved)
        ts.precision_owned = False


def sync() -> None:
    """Re-enter this thread's jit key from the flags of the running context.

    `with_backends` keeps the two in step by itself. Call `sync()` at the top of an asyncio task body
    (and after an `await` that may have let another task change flags on this thread) before calling
    plain `jax.jit` functions: JAX's key is per thread, while the flags are per task.

    Example:
      >>> import asyncio, jbackends as jb
      >>> async def task():
      ...     jb.sync()
      ...     return jb.current_flags().flash
      >>> asyncio.run(task())
      True
    """
    _set_thread_key()


def _tracing() -> bool:
    return not _jax_core.trace_state_clean()


def trace_flags() -> Any:
    """The flags a kernel must use while it is being traced (the one trace-time accessor).

    Returns the same snapshot as `current_flags()`, after checking that JAX's jit key for this thread
    agrees with it. Under a trace a disagreement means the cache entry being built would be filed under
    other flags, so it raises `FlagsOutOfSyncError`; outside a trace it re-syncs the key silently.
    """
    snap = current_flags()
    expected = tuple(getattr(snap, n) for n in _TRACED)
    actual = _JIT_KEY.value
    if actual != expected:
        if _tracing():
            raise FlagsOutOfSyncError(
                "jbackends flags in this context differ from the jit key of this thread, so a compiled "
                "function would be cached under the wrong flags. This happens when asyncio tasks (or "
                "code that sets the ContextVar directly) interleave on one thread, or when another thread "
                "changed a process default (jb.set_flags) while this thread was inside a with_backends "
                "scope: call jb.sync() before calling jitted functions (or use jb.jit, which does), or "
                "enter jb.with_backends(...) again. "
                f"context={dict(zip(_TRACED, expected))} key={dict(zip(_TRACED, actual or ()))}"
            )
        _set_thread_key()
    return snap


# --------------------------------------------------------------------------------------------------
# Validation, process defaults.
# --------------------------------------------------------------------------------------------------


def _validate(updates: Mapping[str, Any], where: str, base: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [k for k in updates if k not in FLAGS]
    if unknown:
        raise TypeError(
            f"{where}() got unknown flag(s) {unknown}; valid flags are: {sorted(FLAGS)}"
        )
    parsed = {k: FLAGS[k].parse(k, v) for k, v in updates.items()}
    if "allow_tf32" in parsed and "float32_matmul_precision" in parsed:
        if parsed["allow_tf32"] != (parsed["float32_matmul_precision"] != "highest"):
            raise ValueError(
                f"{where}(): allow_tf32={parsed['allow_tf32']!r} contradicts "
                f"float32_matmul_precision={parsed['float32_matmul_precision']!r} (torch keeps them consistent: "
                "allow_tf32=True means precision 'high' or 'medium', False means 'highest')"
            )
    implied: dict[str, Any] = {}
    for k, v in parsed.items():
        if FLAGS[k].implies is not None:
            implied.update(FLAGS[k].implies(v))
    implied.update(parsed)
    after = {**base, **implied}
    for k in parsed:
        if FLAGS[k].requires is not None and (problem := FLAGS[k].requires(parsed[k], after)):
            raise ValueError(f"{where}(): {k}={parsed[k]!r}: {problem}")
    for k, v in implied.items():
        try:
            hash(v)
        except TypeError:
            raise TypeError(f"flag {k!r} value must be hashable, got {type(v).__name__}") from None
    return implied


def set_flags(**flags: Any) -> None:
    """Set process defaults (torch semantics: every thread and later notebook cell sees them).

    Omitted flags are unchanged. Raises `FlagsFrozenError` after `disable_global_flags()`.

    Example:
      >>> import jbackends as jb
      >>> jb.set_flags(flash=False); jb.current_flags().flash
      False
      >>> jb.reset_flags()
    """
    parsed = _validate(flags, "set_flags", _DEFAULTS)
    if _frozen:
        raise FlagsFrozenError(
            f"process defaults are frozen (jb.disable_global_flags()); use `with jb.with_backends("
            f"{', '.join(f'{k}={v!r}' for k, v in flags.items())}):` instead"
        )
    with _defaults_lock:
        _DEFAULTS.update(parsed)
        _explicit_defaults.update(parsed)
        _publish_defaults()


def reset_flags() -> None:
    """Restore every process default to its declared (torch) default."""
    if _frozen:
        raise FlagsFrozenError("process defaults are frozen (jb.disable_global_flags())")
    with _defaults_lock:
        _DEFAULTS.clear()
        _DEFAULTS.update({f.name: f.default for f in _DECLARATIONS})
        _explicit_defaults.clear()
        _publish_defaults()


def _publish_defaults() -> None:
    """After `_DEFAULTS` changed (under `_defaults_lock`): snapshots, both jit keys, JAX's precision."""
    global _defaults_version
    _defaults_version += 1
    _JIT_KEY.set_global(_key_of(_DEFAULTS))
    _DEFAULTS_KEY.set_global(_key_of(_DEFAULTS))
    _bridge_global_precision()
    # This thread may hold a local key computed against the old defaults.
    if dict(_OVERRIDES.get()):
        _set_thread_key()


def disable_global_flags() -> None:
    """Freeze process defaults (torch's test guard): bare mutation raises; scoped overrides still work."""
    global _frozen
    _frozen = True


def enable_global_flags() -> None:
    """Undo `disable_global_flags()`."""
    global _frozen
    _frozen = False


def flags_frozen() -> bool:
    """Whether `disable_global_flags()` is in force."""
    return _frozen


# JAX's own default_matmul_precision is bridged only when a precision flag was set explicitly
# (an omitted flag means "unchanged": importing jbackends never changes JAX's behaviour).
_jax_precision_before: list = globals().get("_jax_precision_before", [])


def _bridge_global_precision() -> None:
    if any(n in _explicit_defaults for n in _PRECISION_FLAGS):
        if not _jax_precision_before:
            _jax_precision_before.append(jax.config.jax_default_matmul_precision)
        jax.config.update("jax_default_matmul_precision", _PRECISION_TO_JAX[_DEFAULTS["float32_matmul_precision"]])
    elif _jax_precision_before:
        jax.config.update("jax_default_matmul_precision", _jax_precision_before.pop())


# --------------------------------------------------------------------------------------------------
# with_backends: the scoped override, a context manager and a decorator.
# --------------------------------------------------------------------------------------------------


class with_backends:
    """Override backend flags for a scope: a context manager and a decorator.

    Flags in force when a function is *traced* decide its kernels; a change of flags makes `jax.jit`
    retrace (never a stale executable). Omitted flags are unchanged. Scopes nest, restore on exceptions,
    and are per thread / per asyncio task (`contextvars`).

    Example:
      >>> import jax, jax.numpy as jnp, jbackends as jb
      >>> @jb.with_backends(flash=True, math=False)
      ... @jax.jit
      ... def f(x):
      ...     return x * 2
      >>> with jb.with_backends(deterministic=True):
      ...     jb.current_flags().deterministic
      True

    Args (all keyword-only, all optional):
    {flags}

    Raises:
      TypeError: an unknown flag name (the message lists the valid ones) or a value of the wrong type.
      ValueError: a value outside the allowed set (the message lists it).
    """

    __slots__ = ("_updates", "_stack")

    def __init__(self, **flags: Any):
        self._updates = _validate(flags, "with_backends", _effective(_OVERRIDES.get()))
        self._stack: list = []

    def __enter__(self) -> Any:
        new = dict(_OVERRIDES.get())
        new.update(self._updates)
        token = _OVERRIDES.set(tuple(sorted(new.items())))
        if _tracing() and any(n in self._updates for n in _COMPILE_TIME) and not _IN_JB_JIT.get():
            warnings.warn(
                f"with_backends({', '.join(n for n in self._updates if n in _COMPILE_TIME)}=...) inside a "
                "function traced by plain jax.jit: compile-time flags only take effect through jb.jit "
                "(they become XLA compiler options of the top-level jit)",
                stacklevel=2,
            )
        self._stack.append(token)
        _set_thread_key()  # the jit key and JAX's matmul precision follow the ContextVar
        return current_flags()

    def __exit__(self, *exc) -> None:
        _OVERRIDES.reset(self._stack.pop())
        _set_thread_key()

    def __call__(self, fun: Callable) -> Callable:
        if inspect.iscoroutinefunction(fun):

            @functools.wraps(fun)
            async def async_wrapper(*args, **kwargs):
                with with_backends(**self._updates):
                    return await fun(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fun)
        def wrapper(*args, **kwargs):
            with with_backends(**self._updates):
                return fun(*args, **kwargs)

        return wrapper

    def __repr__(self) -> str:
        return f"with_backends({', '.join(f'{k}={v!r}' for k, v in self._updates.items())})"


with_backends.__doc__ = with_backends.__doc__.replace("{flags}", _flags_doc())


def propagate(fun: Callable) -> Callable:
    """Carry the caller's scoped flags into another thread (e.g. a `ThreadPoolExecutor` worker).

    Process defaults reach every thread anyway; scoped overrides are per context and do not cross a
    thread boundary unless a function is wrapped with `propagate` *in the scope*.

    Example:
      >>> import concurrent.futures, jbackends as jb
      >>> with jb.with_backends(flash=False):
      ...     work = jb.propagate(lambda: jb.current_flags().flash)
      >>> concurrent.futures.ThreadPoolExecutor(1).submit(work).result()
      False
    """
    captured = dict(_OVERRIDES.get())

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        token = _OVERRIDES.set(tuple(sorted({**dict(_OVERRIDES.get()), **captured}.items())))
        _set_thread_key()
        try:
            return fun(*args, **kwargs)
        finally:
            _OVERRIDES.reset(token)
            _set_thread_key()

    return wrapper


# --------------------------------------------------------------------------------------------------
# jb.jit: compile-time flags become XLA compiler options chosen at call time.
# --------------------------------------------------------------------------------------------------

_IN_JB_JIT: contextvars.ContextVar[bool] = globals().get("_IN_JB_JIT") or contextvars.ContextVar(
    "jbackends_in_jit", default=False
)


def compiler_options(flags: Any | None = None) -> dict[str, Any]:
    """The XLA compiler options the compile-time flags map to (what `jb.jit` passes)."""
    flags = flags if flags is not None else current_flags()
    opts: dict[str, Any] = {}
    for name in _COMPILE_TIME:
        opts.update(FLAGS[name].compiler_options(getattr(flags, name)))
    return opts


def jit(fun: Callable | None = None, /, **jit_kwargs: Any) -> Callable:
    """Like `jax.jit`, with compile-time flags turned into XLA compiler options at call time.

    `deterministic`, `benchmark`, `benchmark_limit`, `cudnn_enabled` and `preferred_blas_library` change
    how XLA compiles (`cudnn_enabled` and `deterministic` also take part in tracing, e.g. the SDPA
    choice). `jb.jit` keeps one `jax.jit` per distinct option
    set, so two flag settings never share an executable. Options given in `compiler_options=` win.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> f = jb.jit(lambda x: x + 1)
      >>> with jb.with_backends(deterministic=True):
      ...     float(f(jnp.float32(1)))
      2.0
    """
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    user_options = dict(jit_kwargs.pop("compiler_options", None) or {})
    jitted: dict[tuple, Callable] = {}
    lock = threading.Lock()

    def _for_current() -> Callable:
        opts = {**compiler_options(trace_flags()), **user_options}
        key = tuple(sorted(opts.items()))
        f = jitted.get(key)
        if f is None:
            with lock:
                f = jitted.setdefault(key, jax.jit(fun, compiler_options=opts, **jit_kwargs))
        return f

    name = getattr(fun, "__name__", "jit")

    def _plain() -> Callable:
        f = jitted.get(None)
        if f is None:
            with lock:
                f = jitted.setdefault(None, jax.jit(fun, **jit_kwargs))
        return f

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if _tracing() and _IN_JB_JIT.get():
            # Inside an outer jb.jit, which carries the same options (JAX accepts compiler options on
            # top-level jits only): a plain inner jit.
            return _plain()(*args, **kwargs)
        f = _for_current()
        token = _IN_JB_JIT.set(True)
        try:
            if current_flags().verbose >= 2:  # per-call device time, inside jb.verbose(2) only
                from jbackends._src import verbose

                return verbose.call(name, f, *args, **kwargs)
            return f(*args, **kwargs)
        except ValueError as e:
            # Under another trace (jax.jit, lax.scan, also an eager grad; not an eager vmap) JAX
            # refuses compiler options: run as a plain jit and say which options are lost.
            if "top-level" not in str(e):
                raise
            changed = [n for n in _COMPILE_TIME if getattr(current_flags(), n) != FLAGS[n].default]
            if changed or user_options:
                warnings.warn(
                    f"jb.jit({name}) runs under another trace (jax.jit, lax.scan, grad, ...): "
                    f"XLA compiler options only apply to a top-level jit, so "
                    f"{', '.join(changed + sorted(user_options))} will not take effect here; make the "
                    "outer function a jb.jit",
                    stacklevel=2,
                )
            return _plain()(*args, **kwargs)
        finally:
            _IN_JB_JIT.reset(token)

    wrapper.lower = lambda *a, **k: _for_current().lower(*a, **k)  # type: ignore[attr-defined]
    wrapper.executables = jitted  # type: ignore[attr-defined]  (option tuple -> jax.jit), for tests
    return wrapper
