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

import collections
import contextvars
import dataclasses
import functools
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax._src import config as _jax_config
from jax._src import core as _jax_core
import opt_einsum as _opt_einsum

from jbackends._src import sdp_backends as _sdp

__all__ = [
    "BackendFlags",
    "Flag",
    "FlagsFrozenError",
    "FlagsOutOfSyncError",
    "FlagsTracingError",
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


class FlagsTracingError(RuntimeError):
    """A process default was changed while JAX traces a function: use `with_backends` there."""


# --------------------------------------------------------------------------------------------------
# Parsers: each canonicalises a value or raises with the allowed values in the message.
# --------------------------------------------------------------------------------------------------


def _parse_bool(name: str, value: Any) -> bool:
    """True/False, a NumPy bool (`np.True_`), or a concrete 0-d bool array; nothing else."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, _jax_core.Tracer):
        raise TypeError(
            f"flag {name!r} expects a bool, got a traced value {value!r}: flags are read at trace time, "
            "so they must be concrete Python / NumPy bools (choose them outside the jitted function)"
        )
    if getattr(value, "shape", None) == () and getattr(value, "dtype", None) == np.bool_:
        return bool(value)  # a 0-d numpy / jax bool array
    raise TypeError(
        f"flag {name!r} expects a bool (True or False; NumPy bools are accepted), got "
        f"{type(value).__name__} {value!r}"
    )


def _parse_int(name: str, value: Any, minimum: int = 0) -> int:
    """A Python or NumPy integer (not a bool) >= `minimum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
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


# SDPA backends are declared in `sdp_backends` (a leaf module); flag values hold their ints.
_SDP_NAMES = {int(b): b.name for b in _sdp.RUNNABLE}
_SDP_DEFAULT_ORDER = tuple(int(b) for b in _sdp.DEFAULT_ORDER)


def _parse_sdpa_priority(name: str, value: Any) -> tuple[int, ...]:
    """Canonical form: a full permutation of (0, 1, 2, 3); listed backends first, the rest after."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        value = (value,)
    order: list[int] = []
    for item in value:
        if isinstance(item, str):
            code = _sdp.lookup(item)
            if code is None:
                raise ValueError(
                    f"flag {name!r}: unknown SDPA backend {item!r}; expected SDPBackend members "
                    f"{list(_SDP_NAMES.values())}"
                )
        elif isinstance(item, int) and not isinstance(item, bool) or hasattr(item, "value"):
            code = int(getattr(item, "value", item))
        else:
            raise TypeError(f"flag {name!r} expects SDPBackend members, got {type(item).__name__} {item!r}")
        if code not in _SDP_NAMES:
            raise ValueError(
                f"flag {name!r}: {item!r} cannot be prioritised; expected one of "
                f"{[f'SDPBackend.{n}' for n in _SDP_NAMES.values()]}"
            )
        code = int(code)
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
    *(_bool(_sdp.FLAG[b], True, _sdp.HELP[b], torch=(f"torch.backends.cuda.enable_{_sdp.FLAG[b]}_sdp",),
            mirrors=_sdp_mirrors(_sdp.FLAG[b]))
      for b in _sdp.DECLARATION_ORDER),
    Flag("flash_cpu_kernel", "auto",
         "Which implementations may run the FLASH SDPA backend when lowered for CPU: 'auto' (the C++ "
         "kernel through jax.ffi where it can run the call, else blockwise XLA), 'cpp' (only the C++ "
         "kernel: FLASH is unavailable on CPU for a call it cannot run, and explain() says why), 'xla' "
         "(only blockwise XLA: portable jax.export artifacts, no custom call).",
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
#
# Process defaults are *published*: one immutable `_Publication` (values, jit key, sequence number)
# replaces the previous one under `_defaults_lock`, together with the global values of the two JAX user
# contexts that make up the jit key. Readers never look at a half-updated state.
#
# JAX reads its jit key (the C++ dispatch cache, the trace cache, nested jits) at several moments of a
# call, before and while a function is traced, and another thread may publish new defaults at any of
# those moments. Two rules keep every cache entry consistent with its key:
#
# 1. One snapshot per trace. The first flag read inside a top-level trace (the outermost JAX trace of
#    this thread) pins the publication then in force: every later read in that trace (nested jits,
#    scans, `with_backends` scopes inside it) starts from the same defaults, and this thread's value of
#    `_DEFAULTS_KEY` is pinned to that publication's key until JAX drops the trace object, so nested
#    jits are looked up and filed under the pinned key too. A function calling two kernels can no
#    longer mix two flag states, nor pick up a nested executable traced under other defaults.
# 2. Keys read before the pin are retired. The key the call itself is filed under was read before its
#    first flag read, from a publication between the last one this thread saw (`last_seq`) and the
#    pinned one. Every such publication whose key differs from the pinned one is retired: its epoch is
#    bumped, so publishing those flags again later yields a new key, and the entry filed under the old
#    key is never looked up again.
#
# Retiring costs a retrace, and happens only when a publication falls between a thread's last look at
# the defaults and its next trace; flags set again later without such an overlap hit the cache as
# before. An unscoped thread never raises because another thread changed a default: it traces with
# the defaults it pinned.
#
# Scoped overrides live in a `contextvars.ContextVar`. While a scope makes the traced flags differ from
# the defaults, this thread's value of `_JIT_KEY` is a tagged tuple of the scope's traced flags (the
# entry's flags are then exactly its key, whatever the defaults); otherwise it is unset and the global
# value (the defaults' traced flags) is in force, so equal flag sets share cache entries. If another
# thread then changes the defaults under such a scope, its next trace switches it to its tagged key
# and retires the keys the call may be filed under (`_adopt_scope`).

# Process state survives `importlib.reload` (a reload re-executes this module in the same namespace):
# defaults set before the reload stay in force, and the JAX precision saved by the bridge is not lost.
_previous_defaults = globals().get("_DEFAULTS", {})
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in _DECLARATIONS}
_DEFAULTS.update({k: v for k, v in _previous_defaults.items() if k in _DEFAULTS})
del _previous_defaults
_defaults_lock = globals().get("_defaults_lock") or threading.RLock()
_frozen = globals().get("_frozen", False)
# defaults changed through set_flags (bridged to JAX where relevant)
_explicit_defaults: set[str] = {n for n in globals().get("_explicit_defaults", ()) if n in _DEFAULTS}

_Overrides = tuple  # sorted tuple of (name, value): immutable and hashable
_OVERRIDES: contextvars.ContextVar[_Overrides] = globals().get("_OVERRIDES") or contextvars.ContextVar(
    "jbackends_overrides", default=()
)
_SCOPED_TAG = "jbackends-scope"  # first item of a scoped jit key: never equal to a defaults key


def _key_of(values: Mapping[str, Any]) -> tuple:
    return tuple(values[n] for n in _TRACED)


@dataclasses.dataclass(frozen=True, eq=False)
class _Publication:
    """One atomic state of the process defaults and of the jit-key values published with it."""

    seq: int
    values: Mapping[str, Any]
    key: tuple  # traced flags: the global value of _JIT_KEY
    gkey: tuple  # (key, epoch): the value of _DEFAULTS_KEY
    jax_precision: str | None  # JAX's default_matmul_precision bridged from these defaults, if any


# The jit key, in two user contexts, each created once per process (`importlib.reload` re-executes this
# module in the same namespace, so existing contexts are reused rather than registering new ones):
#
# * `_JIT_KEY`: global value = the defaults' traced flags; thread-local value = a scope's tagged key.
# * `_DEFAULTS_KEY`: global only, `(defaults' traced flags, epoch)`. JAX's thread-local value shadows
#   the global one, so without it a thread inside a scope would keep its key after another thread
#   called `set_flags`; with it, every thread retraces, and the epoch lets rule 2 retire a key.
_JIT_KEY = globals().get("_JIT_KEY") or jax.make_user_context(default_value=_key_of(_DEFAULTS))
_DEFAULTS_KEY = globals().get("_DEFAULTS_KEY") or jax.make_user_context(default_value=None)
_UNSET = None  # filled lazily: the marker jax uses for "no thread-local value"
# Per thread: jbackends' ownership of JAX's thread-local default_matmul_precision (`_sync_precision`),
# the last publication seen (`last_seq`) and the pinned trace (`trace_ref`, `record`).
_thread_state = globals().get("_thread_state") or threading.local()

_epochs: dict[tuple, int] = globals().get("_epochs", {})
_history: collections.deque = globals().get("_history") or collections.deque(maxlen=256)
_retired_count = globals().get("_retired_count", 0)  # keys retired so far (for tests and the report)


def _make_publication(values: Mapping[str, Any]) -> _Publication:
    """Build and publish a new `_Publication` (under `_defaults_lock`)."""
    global _PUB
    previous = globals().get("_PUB")
    key = _key_of(values)
    bridged = any(n in _explicit_defaults for n in _PRECISION_FLAGS)
    pub = _Publication(seq=(previous.seq + 1 if previous is not None else 0), values=dict(values),
                       key=key, gkey=(key, _epochs.setdefault(key, 0)),
                       jax_precision=_PRECISION_TO_JAX[values["float32_matmul_precision"]] if bridged else None)
    # JAX's values first, then the publication: a reader that sees `_PUB.seq == n` knows JAX's key is
    # publication n's or newer (rule 2 relies on it).
    _JIT_KEY.set_global(pub.key)
    _DEFAULTS_KEY.set_global(pub.gkey)
    _PUB = pub
    _history.append(pub)
    return pub


def _retire(gkey: tuple, keep: tuple | None = None) -> None:
    """Never publish `gkey` again (under `_defaults_lock`): entries filed under it become unreachable."""
    global _retired_count
    key, epoch = gkey
    if gkey != keep and _epochs.get(key, 0) == epoch:
        _epochs[key] = epoch + 1
        _retired_count += 1


def _retire_since(lo: int | None, keep: tuple | None) -> None:
    """Retire the keys of every publication with `seq >= lo` (all of them if `lo` is None or too old)."""
    if lo is None or not _history or lo < _history[0].seq:
        for key in list(_epochs):
            _retire((key, _epochs[key]), keep)
        return
    for pub in list(_history):
        if pub.seq >= lo:
            _retire(pub.gkey, keep)


class _TraceRecord:
    """A top-level trace in progress in one thread, and the publication it pinned."""

    __slots__ = ("pub", "lo", "thread", "saved", "saved_precision")

    def __init__(self, pub: _Publication, lo: int | None):
        self.pub, self.lo, self.thread = pub, lo, threading.get_ident()
        self.saved = self.saved_precision = None

    def pin(self) -> None:
        """This thread's defaults key, and JAX's matmul precision bridged from the defaults (unless a
        scope owns it), follow the pinned publication until `release`."""
        self.saved = _DEFAULTS_KEY._obj.swap_local(self.pub.gkey)
        if self.pub.jax_precision is not None and not getattr(_thread_state, "precision_owned", False):
            self.saved_precision = (_jax_config.default_matmul_precision.swap_local(self.pub.jax_precision),)

    def release(self) -> None:
        _DEFAULTS_KEY._obj.set_local(self.saved)
        if self.saved_precision is not None:
            _jax_config.default_matmul_precision.set_local(self.saved_precision[0])
        ts = _thread_state
        if getattr(ts, "record", None) is self:
            ts.record = ts.trace_ref = None


def _end_trace(record: _TraceRecord) -> None:
    """JAX dropped the pinned trace: give this thread the global defaults key back."""
    if threading.get_ident() == record.thread and getattr(_thread_state, "record", None) is record:
        record.release()


def _outermost_trace() -> Any:
    trace = _jax_core.trace_ctx.trace
    while True:
        parent = getattr(trace, "parent_trace", None)
        if parent is None or isinstance(parent, _jax_core.EvalTrace):
            return trace
        trace = parent


def _unpin_ended() -> None:
    """Release a pin whose trace ended where its finalizer could not (another thread's GC)."""
    ts = _thread_state
    record = getattr(ts, "record", None)
    if record is not None:
        ref = ts.trace_ref
        if ref is None or ref() is None or not _tracing():
            record.release()


def _trace_record() -> _TraceRecord | None:
    """This thread's record for the top-level trace in progress (pinning one at the first read)."""
    ts = _thread_state
    if not _tracing():
        if getattr(ts, "record", None) is not None:
            _unpin_ended()
        return None
    outer = _outermost_trace()
    ref = getattr(ts, "trace_ref", None)
    if ref is not None and ref() is outer:
        return ts.record
    previous = getattr(ts, "record", None)
    if previous is not None:  # a pin whose finalizer has not run here: release it first
        previous.release()
    with _defaults_lock:
        pub = _PUB
        lo = getattr(ts, "last_seq", None)
        if lo != pub.seq:  # JAX may have read the key of any publication since `lo`: rule 2
            _retire_since(lo, keep=pub.gkey)
        ts.last_seq = pub.seq
    record = _TraceRecord(pub, lo)
    record.pin()
    try:
        ts.trace_ref = weakref.ref(outer)
    except TypeError:  # not weak-referenceable: held, and released at this thread's next read outside it
        ts.trace_ref = lambda: outer
    else:
        weakref.finalize(outer, _end_trace, record)
    ts.record = record
    return record


_snapshot_cache: dict[tuple, Any] = {}


def _effective(overrides: _Overrides, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    out = dict(_PUB.values if values is None else values)
    out.update(overrides)
    return out


def _snapshot(overrides: _Overrides, pub: _Publication) -> Any:
    cache_key = (overrides, pub.seq)
    snap = _snapshot_cache.get(cache_key)
    if snap is None:
        snap = BackendFlags(**_effective(overrides, pub.values))
        if len(_snapshot_cache) > 512:
            _snapshot_cache.clear()
        _snapshot_cache[cache_key] = snap
    return snap


def _publication_in_force() -> _Publication:
    """The pinned publication under a trace, else the current one (recording it as seen)."""
    record = _trace_record()
    if record is not None:
        return record.pub
    pub = _PUB
    _thread_state.last_seq = pub.seq
    return pub


def current_flags() -> Any:
    """The flags in force in the current context, as a frozen, hashable `BackendFlags`.

    Under a trace these are the flags the trace pinned (see `trace_flags`).

    Example:
      >>> import jbackends as jb
      >>> with jb.with_backends(flash=False):
      ...     jb.current_flags().flash
      False
    """
    return _snapshot(_OVERRIDES.get(), _publication_in_force())


def _thread_key_for(snap: Any, pub: _Publication) -> tuple:
    """The value `_JIT_KEY` must have in this thread for the flags `snap` (see the State notes)."""
    key = tuple(getattr(snap, n) for n in _TRACED)
    return pub.key if key == pub.key else (_SCOPED_TAG, key)


def _expected_key() -> tuple:
    pub = _publication_in_force()
    return _thread_key_for(_snapshot(_OVERRIDES.get(), pub), pub)


def _set_thread_key() -> None:
    """Make this thread's jit key and JAX matmul precision mirror the ContextVar.

    The key's thread-local value is unset when the traced flags in force equal the defaults' (the global
    value is then in force, and such a scope shares cache entries with unscoped code).
    """
    global _UNSET
    overrides = dict(_OVERRIDES.get())
    obj = _JIT_KEY._obj
    expected = _expected_key() if any(n in overrides for n in _TRACED) else None
    # Which scope this thread's key was computed for, when that scope equals the defaults (see
    # `_adopt_scope`); an asyncio task that did not sync has other overrides.
    _thread_state.shared_for = _OVERRIDES.get() if expected is not None else None
    if expected is not None and expected[:1] == (_SCOPED_TAG,):
        obj.swap_local(expected)
    else:
        if _UNSET is None:
            from jax._src.config import config_ext

            _UNSET = config_ext.unset
        obj.set_local(_UNSET)
    _sync_precision(overrides)


with _defaults_lock:
    _make_publication(_DEFAULTS)
    _thread_state.last_seq = _PUB.seq


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


def _adopt_scope(record: _TraceRecord, key: tuple) -> None:
    """Under a trace: this thread's scope shared the defaults' key, and another thread changed them.

    The scope's flags win (they are what the code in the scope asked for): from now on this thread
    uses the scope's own tagged key, nested jits included. The call itself was filed under the
    defaults' key with the scope's flags, so every key it may have read is retired (rule 2) and the
    current defaults are published again under a fresh epoch.
    """
    _JIT_KEY._obj.swap_local((_SCOPED_TAG, key))
    _thread_state.shared_for = None
    with _defaults_lock:
        _retire_since(record.lo, None)
        _make_publication(_PUB.values)


def _tracing() -> bool:
    return not _jax_core.trace_state_clean()


def trace_flags() -> Any:
    """The flags a kernel must use while it is being traced (the one trace-time accessor).

    Under a trace, every read in one top-level trace starts from the same snapshot of the process
    defaults (pinned at the first read; see the State notes in this module), so a function calling
    several kernels never mixes two flag states, whatever other threads publish meanwhile. The scoped
    overrides of the running context apply on top. It then checks that JAX's jit key for this thread
    agrees with these flags: a disagreement means the cache entry being built would be filed under
    other flags (an asyncio task that resumed on a thread whose key another task set, or a scope that
    leaves a flag to the defaults while another thread's `set_flags` changed that flag), so it raises
    `FlagsOutOfSyncError`. A thread with no scope never raises; nor does a scope whose flags equal
    the old defaults (it shared their key): it keeps its flags under its own key from then on. Outside
    a trace it re-syncs the key silently.
    """
    record = _trace_record()
    if record is None:
        pub = _PUB
        _thread_state.last_seq = pub.seq
        snap = _snapshot(_OVERRIDES.get(), pub)
        if _JIT_KEY.value != _thread_key_for(snap, pub):
            _set_thread_key()
        return snap
    pub = record.pub
    snap = _snapshot(_OVERRIDES.get(), pub)
    actual = _JIT_KEY.value
    key = tuple(getattr(snap, n) for n in _TRACED)
    scoped = isinstance(actual, tuple) and actual[:1] == (_SCOPED_TAG,)
    # A tagged key must name exactly these flags; the defaults' key must come with the pinned defaults.
    if not scoped and key != pub.key and _OVERRIDES.get() and \
            getattr(_thread_state, "shared_for", None) == _OVERRIDES.get():
        _adopt_scope(record, key)  # a scope equal to the old defaults, which another thread changed
    elif (actual != (_SCOPED_TAG, key)) if scoped else (key != pub.key):
        raise FlagsOutOfSyncError(
            "jbackends flags in this context differ from the jit key of this thread, so a compiled "
            "function would be cached under the wrong flags. This happens when asyncio tasks (or "
            "code that sets the ContextVar directly) interleave on one thread, or when another thread "
            "changed a process default (jb.set_flags) that this thread's with_backends scope does not "
            "override: call jb.sync() before calling jitted functions (or use jb.jit, which does), or "
            "enter jb.with_backends(...) again. "
            f"context={dict(zip(_TRACED, key))} "
            f"key={dict(zip(_TRACED, actual[1] if scoped else pub.key))}"
        )
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

    Omitted flags are unchanged. The new defaults are published atomically: a trace running in another
    thread keeps the defaults it started with, and its cache entry is never reused under other flags.

    Raises:
      FlagsFrozenError: after `disable_global_flags()`.
      FlagsTracingError: called while JAX traces a function (use `with_backends` there).
      TypeError / ValueError: an unknown flag or a bad value (the message names the flag).

    Example:
      >>> import jbackends as jb
      >>> jb.set_flags(flash=False); jb.current_flags().flash
      False
      >>> jb.reset_flags()
    """
    _refuse_under_trace("set_flags", flags)
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
    """Restore every process default to its declared (torch) default (not allowed under a trace)."""
    _refuse_under_trace("reset_flags", {})
    if _frozen:
        raise FlagsFrozenError("process defaults are frozen (jb.disable_global_flags())")
    with _defaults_lock:
        _DEFAULTS.clear()
        _DEFAULTS.update({f.name: f.default for f in _DECLARATIONS})
        _explicit_defaults.clear()
        _publish_defaults()


def _publish_defaults() -> None:
    """After `_DEFAULTS` changed (under `_defaults_lock`): publish it, with both jit keys and JAX's precision."""
    _make_publication(_DEFAULTS)
    _thread_state.last_seq = _PUB.seq
    _bridge_global_precision()
    # This thread may hold a local key computed against the old defaults.
    if dict(_OVERRIDES.get()):
        _set_thread_key()


def _refuse_under_trace(where: str, flags: Mapping[str, Any]) -> None:
    if _tracing():
        scoped = ", ".join(f"{k}={v!r}" for k, v in flags.items()) or "..."
        raise FlagsTracingError(
            f"jb.{where}() called while JAX is tracing a function (inside jax.jit, grad, vmap, scan, ...). "
            "A process default set here would change at trace time only (not when the compiled function "
            "runs, and not at all on a cache hit) and would leak to every other thread. Use a scope "
            f"inside the function instead: `with jb.with_backends({scoped}): ...`, or call "
            f"jb.{where}() before tracing."
        )


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
        """Decorate `fun`: every call runs in the scope (see the class docstring).

        Coroutine functions hold the scope for the whole coroutine. Generator and async generator
        functions hold it while their body runs, from the first `next()` to the end (also in the
        `finally` blocks run by `close()`), and not while the consumer runs between two items.
        """
        updates = self._updates
        if inspect.isgeneratorfunction(fun):

            @functools.wraps(fun)
            def generator_wrapper(*args, **kwargs):
                scope = with_backends(**updates)
                with scope:
                    gen = fun(*args, **kwargs)
                send, error = None, None
                while True:
                    try:
                        with scope:
                            item = gen.send(send) if error is None else gen.throw(error)
                    except StopIteration as stop:
                        return stop.value
                    finally:
                        error = None
                    try:
                        send = yield item
                    except GeneratorExit:
                        with scope:
                            gen.close()
                        raise
                    except BaseException as e:  # thrown in by the consumer: deliver it in the scope
                        send, error = None, e

            return generator_wrapper

        if inspect.isasyncgenfunction(fun):

            @functools.wraps(fun)
            async def async_generator_wrapper(*args, **kwargs):
                scope = with_backends(**updates)
                with scope:
                    agen = fun(*args, **kwargs)
                send, error = None, None
                while True:
                    try:
                        with scope:
                            item = await (agen.asend(send) if error is None else agen.athrow(error))
                    except StopAsyncIteration:
                        return
                    finally:
                        error = None
                    try:
                        send = yield item
                    except GeneratorExit:
                        with scope:
                            await agen.aclose()
                        raise
                    except BaseException as e:
                        send, error = None, e

            return async_generator_wrapper

        if inspect.iscoroutinefunction(fun):

            @functools.wraps(fun)
            async def async_wrapper(*args, **kwargs):
                with with_backends(**updates):
                    return await fun(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fun)
        def wrapper(*args, **kwargs):
            with with_backends(**updates):
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


# The start of JAX's error for compiler options on a jit that is not top-level (jax 0.10 - 0.12).
_JAX_OPTIONS_REFUSAL = "`compiler_options` can only be passed to top-level `jax.jit`"


def _staging() -> bool:
    """Whether a jit called now would be staged into an enclosing jaxpr (not compiled top-level)."""
    if not _tracing():
        return False
    from jax._src.interpreters import partial_eval as pe

    trace = _jax_core.trace_ctx.trace
    while trace is not None and not isinstance(trace, _jax_core.EvalTrace):
        if isinstance(trace, pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


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

    XLA takes compiler options for a top-level compilation only. Where a `jb.jit` function is called
    matters:

    * at top level, under an eager `jax.vmap` or `jax.jvp`, and (jax >= 0.12) under an eager
      `jax.grad` / `jax.vjp`, whose pieces JAX compiles as top-level jits: the options apply;
    * inside an outer `jb.jit`: a plain inner jit, and the outer one carries the same options;
    * staged into a plain `jax.jit`, `lax.scan`, `jax.make_jaxpr`, ... (and under an eager `jax.grad`
      on jax <= 0.10, which refuses the options there): a plain inner jit, with a warning naming the
      options that are lost when any are set. JAX's refusal is recognised by its exact message for
      these options, so a `ValueError` raised by the function itself propagates unchanged.

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
    _options_of: dict[int, dict] = {}

    def _is_options_refusal(e: ValueError, f: Callable) -> bool:
        opts = _options_of.get(id(f))
        return bool(opts) and str(e).startswith(_JAX_OPTIONS_REFUSAL) and f"compiler_options={opts!r}" in str(e)

    lock = threading.Lock()

    def _for_current() -> Callable:
        opts = {**compiler_options(trace_flags()), **user_options}
        key = tuple(sorted(opts.items()))
        f = jitted.get(key)
        if f is None:
            with lock:
                f = jitted.setdefault(key, jax.jit(fun, compiler_options=opts, **jit_kwargs))
                _options_of[id(f)] = opts
        return f

    name = getattr(fun, "__name__", "jit")

    def _plain() -> Callable:
        f = jitted.get(None)
        if f is None:
            with lock:
                f = jitted.setdefault(None, jax.jit(fun, **jit_kwargs))
        return f

    def _warn_lost(reason: str) -> None:
        changed = [n for n in _COMPILE_TIME if getattr(current_flags(), n) != FLAGS[n].default]
        if changed or user_options:
            warnings.warn(
                f"jb.jit({name}) runs {reason}: XLA compiler options only apply to a top-level jit, so "
                f"{', '.join(changed + sorted(user_options))} will not take effect here; make the "
                "outer function a jb.jit",
                stacklevel=3,
            )

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if _tracing() and _IN_JB_JIT.get():
            # Inside an outer jb.jit, which carries the same options (JAX accepts compiler options on
            # top-level jits only): a plain inner jit.
            return _plain()(*args, **kwargs)
        if _staging():
            # Staged into another jaxpr (jax.jit, lax.scan, make_jaxpr, ...): JAX would trace the
            # function, then refuse the options. Go straight to a plain jit and say what is lost.
            _warn_lost("inside a function staged by jax.jit (or lax.scan, make_jaxpr, ...)")
            return _plain()(*args, **kwargs)
        f = _for_current()
        token = _IN_JB_JIT.set(True)
        try:
            if current_flags().verbose >= 2:  # per-call device time, inside jb.verbose(2) only
                from jbackends._src import verbose

                return verbose.call(name, f, *args, **kwargs)
            return f(*args, **kwargs)
        except ValueError as e:
            # Under an eager transformation JAX may stage the jit after all (jax <= 0.10 refuses under
            # an eager grad; jax 0.12 compiles each piece as a top-level jit, with the options). Only
            # JAX's own refusal of *these* options falls back; any other ValueError is the caller's.
            if not _is_options_refusal(e, f):
                raise
            _warn_lost("under another trace (an eager grad / vjp on this JAX version)")
            return _plain()(*args, **kwargs)
        finally:
            _IN_JB_JIT.reset(token)

    wrapper.lower = lambda *a, **k: _for_current().lower(*a, **k)  # type: ignore[attr-defined]
    wrapper.executables = jitted  # type: ignore[attr-defined]  (option tuple -> jax.jit), for tests
    return wrapper
