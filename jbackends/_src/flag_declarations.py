"""The flag registry: every backend flag, declared once, and what is derived from the declarations.

Every backend flag is declared exactly once, as a `Flag` in `DECLARATIONS` below. Everything else is
derived from that table: the `BackendFlags` snapshot class, the validation of `with_backends(...)` /
`set_flags(...)` (`flag_scope`), the jit key (`flag_state`), the XLA compiler options that `jb.jit`
passes (`jit`), the docstrings, and the torch-shaped mirror modules (`jb.cuda.enable_flash_sdp`,
`jb.cudnn.deterministic = True`, ...; see `_src/mirror.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from jax._src import core as _jax_core
import opt_einsum as _opt_einsum

from jbackends._src import sdp_backends as _sdp

if TYPE_CHECKING:
    from jbackends._src.flag_scope import with_backends

__all__ = [
    "COMPILE_TIME",
    "DECLARATIONS",
    "FLAGS",
    "PRECISION_FLAGS",
    "PRECISION_TO_JAX",
    "TRACED",
    "BackendFlags",
    "Flag",
    "Mirror",
    "flags_doc",
]


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


def _choice(
    *allowed: str, aliases: Mapping[str, str] | None = None, refused: Mapping[str, str] | None = None
) -> Callable[[str, Any], str]:
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
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool) or hasattr(item, "value"):
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
      compiler_options: for compile-time flags, (value, all flags) -> the XLA compiler options `jb.jit`
        passes; none at the flag's default, so XLA's defaults and the user's `XLA_FLAGS` stand.
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
    compiler_options: Callable[[Any, Any], Mapping[str, Any]] | None = None
    implies: Callable[[Any], Mapping[str, Any]] | None = None
    requires: Callable[[Any, Mapping[str, Any]], str | None] | None = None

    # The three accessors below reach the state and scope modules, which are built on this one: they
    # import them when called, so this module stays the bottom layer of the flags.
    @property
    def value(self) -> Any:
        """The value in force in the current context."""
        from jbackends._src.flag_state import current_flags

        return getattr(current_flags(), self.name)

    def set(self, value: Any) -> None:
        """Set the process default (like `set_flags(**{name: value})`)."""
        from jbackends._src.flag_scope import set_flags

        set_flags(**{self.name: value})

    def __call__(self, value: Any) -> "with_backends":
        """Scoped override: `with jb.flags.deterministic(True): ...` (also a decorator)."""
        from jbackends._src.flag_scope import with_backends

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
PRECISION_TO_JAX = {"highest": "float32", "high": "tensorfloat32", "medium": "bfloat16"}
_OPT_EINSUM_STRATEGIES = tuple(_opt_einsum.paths._PATH_OPTIONS)  # auto, greedy, optimal, dp, ...

DECLARATIONS: tuple[Flag, ...] = (
    # ---- scaled dot product attention (torch.backends.cuda.*_sdp*, torch.nn.attention.sdpa_kernel)
    *(
        _bool(
            _sdp.FLAG[b],
            True,
            _sdp.HELP[b],
            torch=(f"torch.backends.cuda.enable_{_sdp.FLAG[b]}_sdp",),
            mirrors=_sdp_mirrors(_sdp.FLAG[b]),
        )
        for b in _sdp.DECLARATION_ORDER
    ),
    Flag(
        "flash_cpu_kernel",
        "auto",
        "Which implementations may run the FLASH SDPA backend when lowered for CPU: 'auto' (the C++ "
        "kernel through jax.ffi where it can run the call, else blockwise XLA), 'cpp' (only the C++ "
        "kernel: FLASH is unavailable on CPU for a call it cannot run, and explain() says why), 'xla' "
        "(only blockwise XLA: portable jax.export artifacts, no custom call).",
        _choice("auto", "cpp", "xla"),
    ),
    Flag(
        "flash_cuda_kernel",
        "auto",
        "Which Pallas kernels may run the FLASH SDPA backend when lowered for CUDA: 'auto' (the Triton "
        "decode kernel for short queries, then the Mosaic GPU kernel where it can run the call "
        "(measured 1.2-2.8x the Triton flash kernel's speed on an H200; not yet for local windows), then "
        "the Triton flash kernel), "
        "'triton' (only the Triton kernels), 'mosaic' (only the Mosaic GPU FlashAttention-3 kernels: sm90, float16 / bfloat16, "
        "head dims 64 / 128 / 256 (at 256 with the Triton backward), causal or not, soft cap, segment ids, "
        "dropout, query / key lengths, local windows, boolean masks, an additive bias in the inputs' dtype (not at "
        "head dim 256); explain() says why it cannot run a call).",
        _choice("auto", "triton", "mosaic"),
    ),
    Flag(
        "sdpa_priority",
        _SDP_DEFAULT_ORDER,
        "Order in which enabled SDPA backends are tried (SDPBackend members; unlisted ones follow).",
        _parse_sdpa_priority,
        torch=("torch.nn.attention.sdpa_kernel(set_priority=True)",),
        implies=lambda v: {"sdpa_prefer_faster": False},  # an order the user set is never reordered
    ),
    _bool(
        "sdpa_prefer_faster",
        True,
        "While sdpa_priority is at its default, try first an enabled SDPA backend measured faster for "
        "the call on the target device (cuDNN over the Pallas kernels on sm90+ in half precision; "
        "jbackends._src.sdpa_speed). sdpa_kernel(..., set_priority=True) turns it off in its scope.",
    ),
    _bool(
        "allow_fp16_bf16_reduction_math_sdp",
        False,
        "Let the math SDPA backend reduce fp16/bf16 inputs in low precision instead of float32.",
        torch=("torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp",),
        mirrors=(
            ("cuda", "setter", "allow_fp16_bf16_reduction_math_sdp"),
            ("cuda", "getter", "fp16_bf16_reduction_math_sdp_allowed"),
        ),
    ),
    # ---- matmul precision (torch.backends.cuda.matmul.*, torch.set_float32_matmul_precision)
    _bool(
        "allow_tf32",
        False,
        "Allow TF32 for float32 matmuls (sets float32_matmul_precision to 'high', False to 'highest').",
        torch=("torch.backends.cuda.matmul.allow_tf32",),
        mirrors=(("cuda.matmul", "attr", "allow_tf32"),),
        implies=lambda v: {"float32_matmul_precision": "high" if v else "highest"},
    ),
    Flag(
        "float32_matmul_precision",
        "highest",
        "Internal precision of float32 matmuls: 'highest' (fp32), 'high' (TF32), 'medium' (bf16). "
        "Bridged to jax.default_matmul_precision where set; until a precision flag is set, JAX's own "
        "default stands (XLA's DEFAULT: TF32 for float32 dots on Ampere and newer GPUs) while "
        "the getter reports torch's default 'highest'.",
        _choice("highest", "high", "medium"),
        torch=("torch.set_float32_matmul_precision", "torch.get_float32_matmul_precision"),
        mirrors=(
            ("", "setter", "set_float32_matmul_precision"),
            ("", "getter", "get_float32_matmul_precision"),
        ),
        implies=lambda v: {"allow_tf32": v != "highest"},
    ),
    _bool(
        "allow_fp16_reduced_precision_reduction",
        True,
        "Allow fp16 matmuls to reduce in fp16. False makes jb.einsum request float32 accumulation "
        "(preferred_element_type=float32, then a cast back) for fp16 operands; plain jnp matmuls are "
        "untouched (XLA's CPU and GPU GEMMs accumulate fp16 in fp32 anyway).",
        torch=("torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",),
        mirrors=(("cuda.matmul", "attr", "allow_fp16_reduced_precision_reduction"),),
    ),
    _bool(
        "allow_bf16_reduced_precision_reduction",
        True,
        "Allow bf16 matmuls to reduce in bf16. False makes jb.einsum request float32 accumulation "
        "(preferred_element_type=float32, then a cast back) for bf16 operands; plain jnp matmuls are "
        "untouched (XLA's CPU and GPU GEMMs accumulate bf16 in fp32 anyway).",
        torch=("torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",),
        mirrors=(("cuda.matmul", "attr", "allow_bf16_reduced_precision_reduction"),),
    ),
    # ---- cuDNN (torch.backends.cudnn.*)
    _bool(
        "cudnn_enabled",
        True,
        "Allow cuDNN-backed kernels (cuDNN SDPA, cuDNN GEMM fusions).",
        torch=("torch.backends.cudnn.enabled",),
        mirrors=(("cudnn", "attr", "enabled"),),
        compiler_options=lambda v, flags: {} if v else {"xla_gpu_cudnn_gemm_fusion_level": 0},
    ),
    _bool(
        "cudnn_allow_tf32",
        True,
        "Allow TF32 in convolutions run through jb.conv / flax convs in scope.",
        torch=("torch.backends.cudnn.allow_tf32",),
        mirrors=(("cudnn", "attr", "allow_tf32"),),
    ),
    _bool(
        "deterministic",
        False,
        "Require deterministic kernels (XLA: xla_gpu_deterministic_ops through jb.jit; "
        "jbackends kernels pick deterministic variants).",
        torch=("torch.backends.cudnn.deterministic",),
        mirrors=(("cudnn", "attr", "deterministic"),),
        # False (torch's "not required") leaves XLA's setting, `XLA_FLAGS` included, as it is.
        compiler_options=lambda v, flags: {"xla_gpu_deterministic_ops": True} if v else {},
    ),
    _bool(
        "benchmark",
        False,
        "Search GPU kernel configurations exhaustively at compile time (xla_gpu_exhaustive_tiling_search "
        "through jb.jit). XLA autotunes with its default search either way, unlike cuDNN's heuristics.",
        torch=("torch.backends.cudnn.benchmark",),
        mirrors=(("cudnn", "attr", "benchmark"),),
        traced=False,
        compiler_options=lambda v, flags: {"xla_gpu_exhaustive_tiling_search": True} if v else {},
    ),
    Flag(
        "benchmark_limit",
        10,
        "Most autotuning candidates tried per kernel when benchmark=True (xla_gpu_autotune_max_solutions).",
        functools.partial(_parse_int, minimum=0),
        torch=("torch.backends.cudnn.benchmark_limit",),
        mirrors=(("cudnn", "attr", "benchmark_limit"),),
        traced=False,
        compiler_options=lambda v, flags: {"xla_gpu_autotune_max_solutions": v} if flags.benchmark else {},
    ),
    # ---- linear algebra / BLAS library choice (torch.backends.cuda.preferred_*_library)
    Flag(
        "preferred_linalg_library",
        "default",
        "GPU linear-algebra library preference: 'default', 'cusolver' or 'magma'. In JAX it selects the "
        "GPU nonsymmetric eigensolver of jb.linalg.eig / eigvals (lax.linalg.EigImplementation); every "
        "other JAX linalg op has one GPU implementation (cuSOLVER/cuBLAS) and CPU always uses LAPACK.",
        _choice("default", "cusolver", "magma"),
        torch=("torch.backends.cuda.preferred_linalg_library",),
        mirrors=(("cuda", "getset", "preferred_linalg_library"),),
    ),
    Flag(
        "preferred_blas_library",
        "cublas",
        "GPU BLAS preference: 'cublas' or 'cublaslt' (xla_gpu_enable_cublaslt through jb.jit). torch's "
        "spellings 'default' and 'hipblas' mean 'cublas', 'hipblaslt' means 'cublaslt'.",
        _choice(
            "cublas",
            "cublaslt",
            aliases={"default": "cublas", "hipblas": "cublas", "hipblaslt": "cublaslt", "lt": "cublaslt"},
            refused={
                "ck": "(ROCm composable kernels) has no XLA counterpart; XLA chooses between "
                "cuBLAS/hipBLAS and cuBLASLt/hipBLASLt only: use 'cublas' or 'cublaslt'"
            },
        ),
        torch=("torch.backends.cuda.preferred_blas_library",),
        traced=False,
        mirrors=(("cuda", "getset", "preferred_blas_library"),),
        compiler_options=lambda v, flags: {"xla_gpu_enable_cublaslt": True} if v == "cublaslt" else {},
    ),
    # ---- opt_einsum (torch.backends.opt_einsum.*)
    _bool(
        "opt_einsum_enabled",
        True,
        "Let jb.einsum optimise contraction order with opt_einsum.",
        torch=("torch.backends.opt_einsum.enabled",),
        mirrors=(("opt_einsum", "attr", "enabled"),),
    ),
    Flag(
        "opt_einsum_strategy",
        "auto",
        "opt_einsum path strategy used by jb.einsum.",
        _choice(*_OPT_EINSUM_STRATEGIES),
        torch=("torch.backends.opt_einsum.strategy",),
        mirrors=(("opt_einsum", "attr", "strategy"),),
        requires=lambda v, values: (
            None
            if values["opt_einsum_enabled"]
            else (
                "opt_einsum is not enabled, so setting a `strategy` will not have an effect; "
                "set opt_einsum_enabled=True (jb.opt_einsum.enabled = True) first"
            )
        ),
    ),
    # ---- nn.MultiheadAttention fast path (torch.backends.mha.*)
    _bool(
        "mha_fastpath",
        True,
        "Let jb.nn.MultiHeadAttention use the fused SDPA dispatch.",
        torch=("torch.backends.mha.set_fastpath_enabled",),
        mirrors=(("mha", "setter", "set_fastpath_enabled"), ("mha", "getter", "get_fastpath_enabled")),
    ),
    # ---- quantized kernels (torch.backends.quantized.engine)
    Flag(
        "quantized_engine",
        "auto",
        "int4 matmul engine: 'auto' (Pallas on GPU, XLA/C++ on CPU), 'pallas' (only Pallas; no fallback), 'xla'.",
        _choice("auto", "pallas", "xla"),
        torch=("torch.backends.quantized.engine",),
        mirrors=(("quantized", "attr", "engine"),),
    ),
    # ---- verbosity (torch.backends.mkl.verbose / mkldnn.verbose): runtime only, never in the jit key
    Flag(
        "verbose",
        0,
        "Report dispatch decisions and compilations to the 'jbackends' logger (0 off, 1, 2).",
        functools.partial(_parse_int, minimum=0),
        torch=("torch.backends.mkl.verbose", "torch.backends.mkldnn.verbose"),
        traced=False,
    ),
)

FLAGS: Mapping[str, Flag] = {f.name: f for f in DECLARATIONS}
TRACED = tuple(f.name for f in DECLARATIONS if f.traced)
COMPILE_TIME = tuple(f.name for f in DECLARATIONS if f.compiler_options is not None)
PRECISION_FLAGS = ("allow_tf32", "float32_matmul_precision")


def flags_doc() -> str:
    rows = []
    for f in DECLARATIONS:
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
        "BackendFlags", [(f.name, Any) for f in DECLARATIONS], frozen=True
    )
BackendFlags.__module__ = __name__
BackendFlags.__doc__ = (
    "Frozen, hashable snapshot of every backend flag (an attribute per short name).\n\n"
    "    Obtain it with `jb.current_flags()`; kernels use `trace_flags()`.\n\n    Flags:\n" + flags_doc()
)
