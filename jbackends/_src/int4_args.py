"""Argument checking for `jbackends.quantized`: every bad argument is a TypeError / ValueError naming it.

The shape and dtype rules shared with the kernels (`check_packed`, `check_input`, `check_groupsize`)
live in `pallas_kernels.int4_matmul.base`; this module adds the ones of the public signatures.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jbackends._src import int4_registry as _registry
from pallas_kernels.int4_matmul import base as _base
from pallas_kernels.int4_matmul.base import PackedInt4Weight

__all__ = [
    "EXPLAIN_DTYPES",
    "EXPLAIN_OPS",
    "EXPLAIN_PLATFORMS",
    "IMPLEMENTATIONS",
    "check_compute_dtype",
    "check_explain",
    "check_implementation",
    "check_int",
    "check_sizes",
    "pack_checked",
]

#: Implementations a call can be pinned to with ``implementation=``.
IMPLEMENTATIONS = tuple(_registry.BY_NAME)  # ("pallas", "pallas_interpret", "cpp", "xla", "reference")

#: `quantized.explain(op=...)` -> the kind of call (`Int4Call.op`) it explains.
EXPLAIN_OPS = {"int4_matmul": "weight_only", "dyn_quant_matmul_4bit": "dyn_quant"}
#: The input dtypes each kind of call takes (`int4_matmul`'s ``x``, `dyn_quant_matmul_4bit`'s ``input``).
EXPLAIN_DTYPES = {
    "weight_only": (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)),
    "dyn_quant": (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)),
}

#: The values `quantized.explain(platform=...)` takes (besides None: the default backend's).
EXPLAIN_PLATFORMS = _registry.PLATFORM_NAMES


def check_int(name: str, v: Any) -> int:
    """``v`` as a positive int, else a TypeError / ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {name}={v}")
    return int(v)


def pack_checked(
    weights: Any, scales_zeros: Any, bias: Any, groupsize: int, in_features: int, out_features: int
) -> PackedInt4Weight:
    """The arguments of `quantized.dyn_quant_pack_4bit_weight`, checked, as a `PackedInt4Weight`."""
    K = check_int("in_features", in_features)
    N = check_int("out_features", out_features)
    g = _base.check_groupsize(groupsize, K)
    w = jnp.asarray(weights)
    if w.dtype != jnp.uint8:
        raise TypeError(f"weights must be uint8 (two 4-bit values per byte, q + 8), got {w.dtype}")
    if w.size != N * K // 2:
        raise ValueError(
            f"weights must hold out_features * in_features / 2 = {N * K // 2} bytes "
            f"([{N}, {K // 2}]), got shape {w.shape}"
        )
    if w.ndim < 1 or w.shape[0] != N:
        raise ValueError(f"weights.shape[0] must be out_features={N}, got shape {w.shape}")
    s = jnp.asarray(scales_zeros)
    if s.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"scales_zeros must be float32 or bfloat16, got {s.dtype}")
    if s.shape not in ((N, K // g), (N * (K // g),)):
        raise ValueError(
            f"scales_zeros must have shape (out_features, in_features // groupsize) = "
            f"{(N, K // g)}, got {s.shape}"
        )
    b = None
    if bias is not None:
        b = jnp.asarray(bias)
        if not jnp.issubdtype(b.dtype, jnp.floating):
            raise TypeError(f"bias must be floating point, got {b.dtype}")
        if b.shape != (N,):
            raise ValueError(f"bias must have shape (out_features,) = {(N,)}, got {b.shape}")
        b = b.astype(jnp.float32)
    return PackedInt4Weight(w.reshape(N, K // 2), s.reshape(N, K // g).astype(jnp.float32), b, g, K, N)


def check_sizes(packed: Any, groupsize: Any, in_features: Any, out_features: Any) -> PackedInt4Weight:
    """``packed``, checked, if torch's size arguments match it (`dyn_quant_matmul_4bit`)."""
    _base.check_packed(packed)
    given = dict(groupsize=groupsize, in_features=in_features, out_features=out_features)
    for name, v in given.items():
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):  # torch: int args
            raise TypeError(f"`{name}` must be an int; got {type(v).__name__} {v!r}")
        if getattr(packed, name) != v:
            raise ValueError(
                f"{name}={v!r} does not match the packed weight's {name}={getattr(packed, name)}"
            )
    return packed


def check_implementation(implementation: Any) -> str | None:
    """None or one of `IMPLEMENTATIONS`, else a ValueError listing them."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def check_compute_dtype(compute_dtype: Any) -> Any:
    """`int4_matmul`'s ``compute_dtype``: None, float32, bfloat16 or float16; returned as a ``jnp.dtype``
    (every spelling of one dtype the same static option of the compiled op), or None."""
    if compute_dtype is None:
        return None
    dtype = None
    if isinstance(compute_dtype, (np.ndarray, jax.Array)):  # JAX deprecates reading one as a dtype
        if compute_dtype.ndim == 0:
            dtype = jnp.dtype(compute_dtype.dtype)
    else:
        try:
            dtype = jnp.dtype(compute_dtype)
        except TypeError:
            pass
    if dtype not in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        raise TypeError(f"compute_dtype must be None, float32, bfloat16 or float16, got {compute_dtype!r}")
    return dtype


def check_explain(x: Any, packed: Any, op: Any, platform: Any) -> str:
    """The arguments of `quantized.explain`, checked; returns the kind of call (``EXPLAIN_OPS[op]``)."""
    if op not in EXPLAIN_OPS:
        raise ValueError(f"`op` must be one of {list(EXPLAIN_OPS)}; got {op!r}")
    if platform is not None and not isinstance(platform, str):
        raise TypeError(f"`platform` must be a str or None; got {type(platform).__name__}")
    if platform is not None and platform.lower() not in EXPLAIN_PLATFORMS:
        raise ValueError(
            f"`platform` must be one of {list(EXPLAIN_PLATFORMS)} (or None: the default "
            f"backend's); got {platform!r}"
        )
    _base.check_packed(packed)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`x` must be an array or a jax.ShapeDtypeStruct; got {type(x).__name__}")
    if not x.shape or x.shape[-1] != packed.in_features:
        raise ValueError(
            f"`x` must have in_features={packed.in_features} as its last dim; got shape {tuple(x.shape)}"
        )
    # The dtypes the call itself takes (it raises the same TypeError): nothing runs another one.
    allowed = EXPLAIN_DTYPES[EXPLAIN_OPS[op]]
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(
            f"`x` must have dtype in ({names}) for {op}, as the call does; got {jnp.dtype(x.dtype)}"
        )
    return EXPLAIN_OPS[op]
