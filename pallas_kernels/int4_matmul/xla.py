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
  (de-interleaved) int32 activations and reduced per group in int32 in one
  XLA reduce fusion, so the dequantized weight is never materialized; read
  the optimized HLO with `lowered_hlo`.
* larger M (prefill): nibbles are expanded to a float32 ``[G, N, g]`` operand
  and one batched dot per group runs on XLA's GEMM (materializes 4 bytes per
  weight, amortized over M rows).

Weight-only mode (W4A16/W4A32) uses the same two shapes with the scales
folded in; its tolerance is a float one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import base
from .base import PackedInt4Weight

__all__ = ["dyn_quant_matmul", "weight_only_matmul", "SMALL_M", "EXACT_BLOCK"]

SMALL_M = 8
"""Rows up to which the fused multiply-reduce form is used."""

EXACT_BLOCK = 4096
"""Longest run of k summed in float32 (exact below 2**24 / 2040 = 8224)."""


def _split_nibbles(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 ``[N, K/2]`` -> float32 (even-k, odd-k) weights in -8..7."""
    lo = (w & 0x0F).astype(jnp.int32) - 8
    hi = (w >> 4).astype(jnp.int32) - 8
    return lo.astype(jnp.float32), hi.astype(jnp.float32)


def _sub_block(groupsize: int) -> int:
    """The k length of one exact float32 partial sum (divides groupsize)."""
    if groupsize <= EXACT_BLOCK:
        return groupsize
    for b in range(EXACT_BLOCK, 1, -2):
        if groupsize % b == 0:
            return b
    return 2


def _group_dots_small(a: jax.Array, w: jax.Array, groupsize: int) -> jax.Array:
    """Fused form: ``a`` int32 ``[M, K]`` (qa - zp) -> ``[M, N, G]`` int32.

    Integer multiply-reduce over the nibble planes: XLA fuses the unpack into
    the reduction (the float form gets split into a materialized f32 weight
    plus a YNNPACK reduction, 3x slower).
    """
    M, K = a.shape
    N = w.shape[0]
    G = K // groupsize
    ae = a[:, 0::2].reshape(M, 1, G, groupsize // 2)
    ao = a[:, 1::2].reshape(M, 1, G, groupsize // 2)
    lo = ((w & 0x0F).astype(jnp.int32) - 8).reshape(1, N, G, groupsize // 2)
    hi = ((w >> 4).astype(jnp.int32) - 8).reshape(1, N, G, groupsize // 2)
    return jnp.sum(ae * lo + ao * hi, axis=-1, dtype=jnp.int32)


def _group_dots_large(a: jax.Array, w: jax.Array, groupsize: int) -> jax.Array:
    """GEMM form: one batched dot per exact block, -> ``[M, N, G]`` int32."""
    M, K = a.shape
    N = w.shape[0]
    b = _sub_block(groupsize)
    nb = K // b
    q = base.unpack_nibbles(w).astype(jnp.float32).reshape(N, nb, b)
    s = lax.dot_general(a.reshape(M, nb, b), q, (((2,), (2,)), ((1,), (1,))),
                        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)  # [nb, M, N]
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
    if x2.shape[0] <= SMALL_M:
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
    if M <= SMALL_M:
        lo, hi = _split_nibbles(packed.weight)
        xe = xf[:, 0::2].reshape(M, 1, G, g // 2)
        xo = xf[:, 1::2].reshape(M, 1, G, g // 2)
        s = jnp.sum(xe * lo.reshape(1, N, G, g // 2) + xo * hi.reshape(1, N, G, g // 2), axis=-1)
        out = jnp.sum(s * packed.scales[None], axis=-1)
    else:
        cd = jnp.dtype(compute_dtype or jnp.float32)
        w = base.dequantize(packed.weight, packed.scales, g).astype(cd)
        prec = lax.Precision.HIGHEST if cd == jnp.float32 else lax.Precision.DEFAULT
        out = lax.dot_general(xf.astype(cd), w, (((1,), (1,)), ((), ())), precision=prec,
                              preferred_element_type=jnp.float32)
    if packed.bias is not None:
        out = out + packed.bias[None]
    return out.reshape(*lead, N).astype(x.dtype)


def lowered_hlo(x: jax.Array, packed: PackedInt4Weight, mode: str = "dyn_quant") -> str:
    """The optimized CPU HLO of one call (to check what XLA fused)."""
    f = dyn_quant_matmul if mode == "dyn_quant" else weight_only_matmul
    return jax.jit(f).lower(x, packed).compile().as_text()
