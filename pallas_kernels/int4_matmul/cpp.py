"""The C++ CPU kernels (``csrc/int4_matmul.cc``), called through the XLA FFI.

The shared library is built by ``setup.py`` when the package is installed
(``pip install -e .``); when it is absent (no compiler at install time, or a
non-CPU-only wheel), `available()` is False and callers use `xla.py`.

The kernels take ``x`` float32 or bfloat16 ``[..., K]`` (any leading dims, flattened to
rows), the packed weight ``[N, K/2]``, float32 scales ``[N, K/g]`` and a bias
(zeros with ``has_bias=False`` when there is none). They are multi-threaded
over N on XLA's intra-op thread pool and pick AVX512-VNNI / AVX512BW / AVX2 / scalar
code at run time. ``vmap`` over ``x`` folds the batch into the rows; ``vmap`` over the
weight runs the kernel once per weight (``lax.map``).

Paths (AVX-512; groupsize a multiple of 128 for the dyn-quant ones, else the 32-k block path):

* dyn-quant, up to 8 rows: the row path (one vector accumulator per group, 4 rows share each weight
  load); from 9 rows (measured crossover): the blocked path (16 rows per vector, u8 x s8 dots of a
  broadcast weight against 16 rows, torch's float tail one lane per row). Both bit-exact with torch.
* weight-only, one float32 row with AVX512-VNNI (groupsize a multiple of 128): integer dots, the row
  held as 24-bit block fixed point per 128 k (three int8 digits, six ``vpdpbusd`` per 64 weight
  bytes; within 2^-23 sum_c max_c |x| sum_c |w| plus float32 sums: measured up to 3e-7 of sum |x w|,
  1.4e-6 with heavy-tailed weights and outlier channels); a row with a NaN or inf, a 128-k chunk whose largest |x| is
  outside [2^-96, 2^96], or chunks dominated by a few large values takes the float32 row kernel:
* weight-only, up to 15 rows (11 on Intel CPUs, whose row kernel slows sooner): weights dequantized
  in registers (vpermps on a per-group table); from 16 (12 on Intel): the blocked float GEMM form
  (dequantized weight tiles, 16 rows per vector, K taken in 128-k chunks in the order a chunk's
  weight dwords hold their nibbles, so that a chunk dequantizes with one shift and one permute per
  16 weights); above
  `weight_only_max_rows()` XLA's GEMM on the dequantized weight is faster and runs instead.
* weight-only with bfloat16 activations on a CPU with AVX512-BF16, except Intel ones, where they are
  widened to float32 (`weight_only_bf16_path`, `set_bf16_kernels`): the
  same two forms with ``vdpbf16ps`` (exact bf16 x int4 products, float32 sums, the scales applied per
  group in float32), at any number of rows (ahead of XLA at every size measured on the EPYC, up to
  2048 rows; widened on Intel, they follow the float32 row limit); the result rounded to bfloat16 in
  the kernel.
"""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import ffi, partition
from ..ffi import load_library, xla_pool_setter
from . import base
from .base import PackedInt4Weight

__all__ = [
    "available",
    "isa",
    "set_isa",
    "set_xla_pool",
    "dyn_quant_matmul",
    "weight_only_matmul",
    "unsupported",
    "WEIGHT_ONLY_MAX_ROWS",
    "WEIGHT_ONLY_MAX_ROWS_AVX512",
    "weight_only_max_rows",
    "weight_only_bf16_path",
    "set_bf16_kernels",
]

_DYN_TARGET = "jb_int4_dyn_quant_matmul_f32"
_WO_TARGET = "jb_int4_matmul_f32"
_WO_BF16_TARGET = "jb_int4_matmul_bf16"
_DYN_BF16_TARGET = "jb_int4_dyn_quant_matmul_bf16"
#: The kernels' custom-call targets: a `jax.export` for CPU that carries them needs
#: ``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]`` (an artifact
#: that runs where jbackends is imported: the targets are registered at its import).
TARGETS = (_DYN_TARGET, _WO_TARGET, _WO_BF16_TARGET, _DYN_BF16_TARGET)

#: A name scope around the custom calls, which jax.export's refusal quotes (with the call's location).
EXPORT_HINT = (
    "jbackends C++ int4 kernel: for a portable jax.export pass implementation=xla to the int4 call, "
    "or opt in with disabled_checks="
    "[DisabledSafetyCheck.custom_call(target)] for the jb_int4 targets (pallas_kernels.int4_matmul.cpp.TARGETS)"
)
_MODULE = f"{__package__}._int4_cpu"


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_library(
        _MODULE,
        targets={
            _DYN_TARGET: "JbInt4DynQuantMatmulF32",
            _WO_TARGET: "JbInt4MatmulF32",
            _WO_BF16_TARGET: "JbInt4MatmulBf16",
            _DYN_BF16_TARGET: "JbInt4DynQuantMatmulBf16",
        },
        restypes={
            "JbInt4Isa": ctypes.c_char_p,
            "JbInt4SetIsa": ctypes.c_int,
            "JbInt4SetBf16Kernels": ctypes.c_int,
            "JbInt4WeightOnlyBf16Path": ctypes.c_int,
        },
        argtypes={
            "JbInt4SetIsa": [ctypes.c_char_p],
            "JbInt4SetBf16Kernels": [ctypes.c_char_p],
            "JbInt4SetXlaPool": [ctypes.c_int],
            "JbInt4WeightOnlyBf16Path": [ctypes.c_int64, ctypes.c_int64],
        },
    )


# Registered at import (`jbackends` imports this module), so that a deserialized CPU export carrying
# the kernels runs in a fresh process that imported jbackends (ctypes loading is cheap; a refusal
# warns at the kernels' first use, not at import).
ffi.register_at_import(_library)


def available() -> bool:
    """Whether the compiled kernels were built and load."""
    return _library() is not None


def isa() -> str:
    """The instruction set the dyn-quant kernel uses here ("avx512vnni", ...)."""
    lib = _library()
    return lib.JbInt4Isa().decode() if lib is not None else "unavailable"


def set_isa(name: str) -> bool:
    """Selects the code path: "avx512vnni", "avx512bw", "avx2" or "scalar".

    Switches the weight-only kernel too (one AVX-512 path for both AVX-512 names).

    Returns False (and changes nothing) when this CPU cannot run it. For tests
    and benchmarks; the default is the best path the CPU supports.
    """
    lib = _library()
    return lib is not None and lib.JbInt4SetIsa(name.encode()) == 0


set_xla_pool = xla_pool_setter(_library, "JbInt4SetXlaPool")


def set_bf16_kernels(mode: str) -> None:
    """Which kernels bfloat16 activations take (see `weight_only_bf16_path`): ``"auto"`` (the
    default) the AVX512-BF16 kernels where the CPU has AVX512-BF16, except on an Intel CPU, where
    ``x`` is widened to float32 for the float32 kernels (measured 1.2-1.6x faster there at M = 1, 16
    and 64, a tie at 4-15); ``"always"`` the AVX512-BF16 kernels wherever the CPU has them (tests,
    benchmarks). A process-wide switch: set it before tracing, since the dispatcher's row limit is
    decided when a function is traced and the kernel's route when it runs.

    Raises:
      ValueError: ``mode`` is neither ``"auto"`` nor ``"always"``.
      RuntimeError: the compiled kernels are not available here."""
    if mode not in ("auto", "always"):
        raise ValueError(f"mode must be 'auto' or 'always', got {mode!r}")
    lib = _library()
    if lib is None:
        raise RuntimeError("C++ int4 kernels: " + (unavailable_reason() or "not available"))
    lib.JbInt4SetBf16Kernels(mode.encode())


#: Weight-only rows above which these kernels lose to XLA's GEMM on the dequantized weight: the AVX2 and
#: scalar kernels (K=4096, N=4096 and 11008, groupsize 128).
WEIGHT_ONLY_MAX_ROWS = 16
#: The same for the AVX-512 kernels: weights dequantized in registers below 16 rows (12 on Intel), the
#: blocked float GEMM form (16 rows per vector, dequantized weight tiles) from there. Measured
#: crossover (K=4096, N=4096, groupsize 128, CPU time per call): 86 ms against XLA's 110 at 512 rows,
#: 229 against 196 at 1024.
WEIGHT_ONLY_MAX_ROWS_AVX512 = 512


def weight_only_max_rows() -> int:
    """The weight-only row limit of the code path in use here (see `WEIGHT_ONLY_MAX_ROWS`)."""
    return WEIGHT_ONLY_MAX_ROWS_AVX512 if isa().startswith("avx512") else WEIGHT_ONLY_MAX_ROWS


def weight_only_bf16_path(rows: int, in_features: int) -> str:
    """The kernel `weight_only_matmul` runs here for bfloat16 ``x`` of ``rows`` rows and
    ``in_features``:

    * ``"bf16 row"``: up to 15 rows, ``in_features`` a multiple of 128: the AVX512-BF16 row kernel
      (weights turned into bf16 integers in registers, exact bf16 x int4 products by ``vdpbf16ps``,
      float32 sums, scales applied per group in float32);
    * ``"bf16 blocked"``: from 16 rows: the AVX512-BF16 blocked GEMM (16 rows per vector, one dot
      multiplies a broadcast pair of weights by 16 rows);
    * ``"float32"``: ``x`` widened to float32 in the kernel (exactly) for the float32 kernels: a CPU
      without AVX512-BF16, a non AVX-512 code path selected with `set_isa`, or an Intel CPU, where
      ``vdpbf16ps`` is slow: the float32 kernels measured 1.2-1.6x faster at M = 1, 16 and 64, a tie
      at 4-15 (see `set_bf16_kernels`); above `weight_only_max_rows()` such calls follow the float32
      rule (XLA's GEMM); the same results within float32 rounding.

    Every path rounds the float32 sums to bfloat16 in the kernel, as ``.astype`` rounds."""
    lib = _library()
    if lib is None:
        return "unavailable"
    return ("float32", "bf16 row", "bf16 blocked")[lib.JbInt4WeightOnlyBf16Path(rows, in_features)]


def unavailable_reason() -> str | None:
    """Why the compiled kernels cannot be used here, or ``None`` when they can."""
    if available():
        return None
    return ffi.unavailable_reason(
        _MODULE, "the C++ extension", "is not built (pip install -e . with a C++ compiler)"
    )


def unsupported(call: base.Int4Call, platform: str = "cpu") -> list[str]:
    """Reasons these kernels cannot (or should not) run ``call`` when lowered for ``platform``
    (empty when they can)."""
    why = []
    if platform != "cpu":
        why.append(f"CPU only (lowering for {platform})")
    if (reason := unavailable_reason()) is not None:
        why.append(reason)
    if call.packed.in_features % 32:
        why.append(f"in_features={call.packed.in_features} is not a multiple of 32")
    bf16_blocked = (
        call.x_dtype == jnp.bfloat16
        and weight_only_bf16_path(call.rows, call.packed.in_features) == "bf16 blocked"
    )
    if call.op == "weight_only" and not bf16_blocked and call.rows > (limit := weight_only_max_rows()):
        why.append(
            f"M={call.rows} > {limit} ({isa()} kernels): XLA's GEMM on the dequantized weight is faster "
            "(measured crossover)"
        )
    return why


@functools.cache
def _op(target: str, groupsize: int, has_bias: bool):
    out_dtype = jnp.bfloat16 if target in (_WO_BF16_TARGET, _DYN_BF16_TARGET) else jnp.float32

    def call(x, w, s, b):
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (w.shape[0],), out_dtype)
        with jax.named_scope(EXPORT_HINT):  # jax.export's refusal names the call's scope: the way out
            y = jax.ffi.ffi_call(target, out)(x, w, s, b, groupsize=groupsize, has_bias=has_bias)
        return partition.vary_like(y, x, w, s, b)

    @jax.custom_batching.custom_vmap
    def op(x, w, s, b):
        return call(x, w, s, b)

    @op.def_vmap
    def _rule(axis_size, in_batched, x, w, s, b):
        xb, wb, sb, bb = in_batched
        if not (wb or sb or bb):
            # Batch of inputs, one weight: the batch is just more rows.
            return op(x, w, s, b), True
        bcast = lambda v, batched: v if batched else jnp.broadcast_to(v, (axis_size,) + v.shape)
        args = (bcast(x, xb), bcast(w, wb), bcast(s, sb), bcast(b, bb))
        return lax.map(lambda a: op(*a), args), True

    return op


def _call(target: str, x: jax.Array, packed: PackedInt4Weight) -> jax.Array:
    # The kernel's own limits (the weight-only row rule is a dispatch preference, not a limit).
    if why := unsupported(base.Int4Call.of("dyn_quant", x, packed), "cpu"):
        raise NotImplementedError("C++ int4 kernel: " + "; ".join(why))
    if x.dtype == jnp.bfloat16:
        target = _WO_BF16_TARGET if target == _WO_TARGET else _DYN_BF16_TARGET
    elif x.dtype != jnp.float32:
        raise TypeError(f"x must be float32 or bfloat16 for the C++ kernels, got {x.dtype}")
    bias = packed.bias
    has_bias = bias is not None
    if not has_bias:
        bias = jnp.zeros((packed.out_features,), jnp.float32)
    return _op(target, packed.groupsize, has_bias)(x, packed.weight, packed.scales, bias)


def dyn_quant_matmul(x: jax.Array, packed: PackedInt4Weight) -> jax.Array:
    """torch-exact dyn-quant matmul of float32 or bfloat16 ``x[..., K]`` (see base.py); bfloat16
    ``x`` is widened to float32 and the float32 result truncated to bfloat16 (torch's rule), both in
    the kernel."""
    return _call(_DYN_TARGET, x, packed)


def weight_only_matmul(x: jax.Array, packed: PackedInt4Weight) -> jax.Array:
    """``x @ dequantize(w).T + bias`` for float32 or bfloat16 ``x[..., K]``, fp32 accumulation; the
    result has ``x``'s dtype (bfloat16: the float32 sums rounded to nearest even in the kernel, as
    ``.astype(jnp.bfloat16)`` rounds; see `weight_only_bf16_path`)."""
    return _call(_WO_TARGET, x, packed)
