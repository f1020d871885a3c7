"""Pure-XLA int4 matmul: the portable path (any backend, no extension).

Dyn-quant mode is bit-exact with `base.dyn_quant_matmul`: the per-group
integer sums are computed in float32, which is exact because every partial
sum is an integer below 2**24 (``|qa - zp| <= 255``, ``|q| <= 8``, so a group
of ``<= 8192`` k stays under ``255 * 8 * 8192 < 2**24`` in any summation
order); longer channel-wise rows are split into 4096-k blocks whose exact
float sums are added in int32. The float tail (`base.accumulate_groups`)
keeps torch's order and avoids FMA contraction.

Two formulations, chosen by the number of rows M:

* ``M <= SMALL_M`` (decode): the nibbles are unpacked, multiplied by the
  (de-interleaved) int32 activations and reduced per sub-block of <= 128 k in
  int32 in one XLA loop fusion, so neither the dequantized weight nor the
  products are materialized (temporary memory ~0 at M=1; see
  `_sub_block_dots` and the test on `memory_analysis`); read the optimized
  HLO with `lowered_hlo`.
* larger M (prefill): nibbles are expanded to a float32 ``[G, N, g]`` operand
  and one batched dot per group runs on XLA's GEMM (materializes 4 bytes per
  weight, amortized over M rows).

Weight-only mode (W4A16/W4A32) uses the same two shapes with the scales
folded in; its tolerance is a float one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import base
from .base import PackedInt4Weight

__all__ = ["unsupported", "dyn_quant_matmul", "weight_only_matmul", "SMALL_M", "EXACT_BLOCK"]

SMALL_M = 8


def _small(M) -> bool:
    """The decode path's row count; a symbolic ``M`` (a shape-polymorphic export) takes the general one."""
    return not jax.export.is_symbolic_dim(M) and M <= SMALL_M


"""Rows up to which the fused multiply-reduce form is used."""

EXACT_BLOCK = 4096
"""Longest run of k summed in float32 (exact below 2**24 / 2040 = 8224)."""


def unsupported(call: Any, platform: str) -> list[str]:
    """XLA runs every call on every platform: always empty (the engines share this signature)."""
    del call, platform
    return []


def _sub_block(groupsize: int) -> int:
    """The k length of one exact float32 partial sum (divides groupsize)."""
    if groupsize <= EXACT_BLOCK:
        return groupsize
    for b in range(EXACT_BLOCK, 1, -2):
        if groupsize % b == 0:
            return b
    return 2


SUB_BLOCK = 128
"""k length of one fused multiply-reduce in the small-M form (a divisor of groupsize, at most this)."""

_LANES = 32
"""Innermost reduction width of the small-M form (per nibble plane)."""


def _small_m_layout(K: int, groupsize: int) -> tuple[int, int]:
    """(sub-block, lanes) of the small-M form: ``sub`` divides groupsize, ``lanes`` divides sub / 2."""
    sub = min(SUB_BLOCK, groupsize)
    while groupsize % sub:
        sub //= 2
    lanes = min(_LANES, sub // 2)
    while (sub // 2) % lanes:
        lanes -= 1
    return sub, lanes


def _nibble_planes(w: jax.Array, shape: tuple, dtype) -> tuple[jax.Array, jax.Array]:
    lo = ((w & 0x0F).astype(jnp.int32) - 8).astype(dtype).reshape(shape)
    hi = ((w >> 4).astype(jnp.int32) - 8).astype(dtype).reshape(shape)
    return lo, hi


def _sub_block_dots(a: jax.Array, w: jax.Array, groupsize: int, dtype) -> jax.Array:
    """``a [M, K]`` times the nibble planes of ``w``, reduced per sub-block: ``[M, N, K / sub]``.

    The reduction is split as ``[..., sub / 2 / lanes, lanes]`` and summed innermost first. That shape
    keeps the nibble unpack, the multiply and both reductions in one XLA loop fusion; a single
    reduction over ``groupsize / 2`` (>= 64) makes XLA CPU write the ``[M, N, K / 2]`` products to a
    temporary first (33 MiB at M=1, 4096x4096, and 4-8x slower).
    """
    M, K = a.shape
    N = w.shape[0]
    sub, lanes = _small_m_layout(K, groupsize)
    shape = (K // sub, sub // 2 // lanes, lanes)
    ae = a[:, 0::2].reshape(M, 1, *shape)
    ao = a[:, 1::2].reshape(M, 1, *shape)
    lo, hi = _nibble_planes(w, (1, N, *shape), dtype)
    prod = ae * lo + ao * hi
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.sum(jnp.sum(prod, axis=-1, dtype=dtype), axis=-1)
    # Float sums: XLA CPU hands a float reduce to a library reduction that wants its operand in memory
    # (the products: 4 bytes per weight). Pairwise adds of halves stay elementwise, so they fuse.
    for _ in range(2):  # the lanes axis, then the chunks axis
        while prod.shape[-1] > 1:
            n, half = prod.shape[-1], prod.shape[-1] // 2
            summed = prod[..., :half] + prod[..., half : 2 * half]
            prod = jnp.concatenate([summed, prod[..., 2 * half :]], axis=-1) if n % 2 else summed
        prod = prod[..., 0]
    return prod


def _group_dots_small(a: jax.Array, w: jax.Array, groupsize: int) -> jax.Array:
    """Fused form: ``a`` int32 ``[M, K]`` (qa - zp) -> ``[M, N, G]`` int32 (exact: integer sums).

    Integer multiply-reduce over the nibble planes, fused with the unpack (`_sub_block_dots`); the
    float form gets split into a materialized f32 weight plus a YNNPACK reduction, 3x slower.
    """
    M, K = a.shape
    sub, _ = _small_m_layout(K, groupsize)
    s = _sub_block_dots(a, w, groupsize, jnp.int32)
    return jnp.sum(s.reshape(M, w.shape[0], K // groupsize, groupsize // sub), axis=-1, dtype=jnp.int32)


def _group_dots_large(a: jax.Array, w: jax.Array, groupsize: int) -> jax.Array:
    """GEMM form: one batched dot per exact block, -> ``[M, N, G]`` int32."""
    M, K = a.shape
    N = w.shape[0]
    b = _sub_block(groupsize)
    nb = K // b
    q = base.unpack_nibbles(w).astype(jnp.float32).reshape(N, nb, b)
    s = lax.dot_general(
        a.reshape(M, nb, b),
        q,
        (((2,), (2,)), ((1,), (1,))),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # [nb, M, N]
    s = jnp.moveaxis(s, 0, -1).astype(jnp.int32)
    return jnp.sum(s.reshape(M, N, K // groupsize, groupsize // b), axis=-1)


def _flatten(x):
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def dyn_quant_matmul(x: jax.Array, packed: PackedInt4Weight) -> jax.Array:
    """torch-exact `base.dyn_quant_matmul` in XLA; ``x[..., K]`` float32/bfloat16."""
    base.check_packed(packed)
    x = base.check_input(x, packed)
    x2, lead = _flatten(x)
    qa, zp, recip = base.quantize_activations(x2, packed.channelwise)
    a = qa - zp[:, None]
    if _small(x2.shape[0]):
        idots = _group_dots_small(a, packed.weight, packed.groupsize)
    else:
        idots = _group_dots_large(a.astype(jnp.float32), packed.weight, packed.groupsize)
    out = base.accumulate_groups(idots, packed.scales, recip, zp, packed.bias, packed.channelwise)
    out = out.reshape(*lead, packed.out_features)
    return base.truncate_to_bfloat16(out) if x.dtype == jnp.bfloat16 else out


def weight_only_matmul(x: jax.Array, packed: PackedInt4Weight, *, compute_dtype=None) -> jax.Array:
    """``x @ dequantize(w).T + bias`` (float32 accumulation), output in x.dtype.

    ``compute_dtype`` is the operand dtype of the large-M GEMM (default
    float32; bfloat16 halves the dequantized operand's traffic).
    """
    base.check_packed(packed)
    x = base.check_input(x, packed, allowed=(jnp.float32, jnp.bfloat16, jnp.float16), name="x")
    x2, lead = _flatten(x)
    M, K = x2.shape
    N, g = packed.out_features, packed.groupsize
    G = K // g
    xf = x2.astype(jnp.float32)
    if _small(M):  # fused unpack-multiply-reduce, never a dequantized weight (see _sub_block_dots)
        sub, _ = _small_m_layout(K, g)
        s = _sub_block_dots(xf, packed.weight, g, jnp.float32).reshape(M, N, G, g // sub)
        out = jnp.sum(jnp.sum(s, axis=-1) * packed.scales[None], axis=-1)
    else:
        cd = jnp.dtype(compute_dtype or jnp.float32)
        w = base.dequantize(packed.weight, packed.scales, g).astype(cd)
        prec = lax.Precision.HIGHEST if cd == jnp.float32 else lax.Precision.DEFAULT
        out = lax.dot_general(
            xf.astype(cd), w, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
        )
    if packed.bias is not None:
        out = out + packed.bias[None]
    return out.reshape(*lead, N).astype(x.dtype)


def lowered_hlo(x: jax.Array, packed: PackedInt4Weight, mode: str = "dyn_quant") -> str:
    """The optimized CPU HLO of one call (to check what XLA fused)."""
    f = dyn_quant_matmul if mode == "dyn_quant" else weight_only_matmul
    return jax.jit(f).lower(x, packed).compile().as_text()
