"""Int4 matmul references: torch's ``_dyn_quant_matmul_4bit`` and the weight-only matmul in ``jnp``.

Float32 / int32 exact (the dyn-quant numerics are in `dyn_quant`): the contract the XLA, C++ and Pallas
engines are tested against bit for bit (dyn-quant) or within float tolerance (weight-only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .dyn_quant import accumulate_groups, group_dots, quantize_activations, truncate_to_bfloat16
from .packing import PackedInt4Weight, check_input, check_packed, dequantize, unpack_nibbles

__all__ = ["dyn_quant_matmul", "weight_only_matmul"]


def _flatten(x: jax.Array) -> tuple[jax.Array, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


def dyn_quant_matmul(x: jax.Array, packed: PackedInt4Weight) -> jax.Array:
    """Reference ``_dyn_quant_matmul_4bit``: ``x[..., K] -> [..., N]``.

    float32 in -> float32 out; bfloat16 in -> bfloat16 out (truncated).

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.int4_matmul.packing import quantize_4bit
      >>> q, s = quantize_4bit(jnp.ones((4, 64)), 32)
      >>> p = PackedInt4Weight(q, s, None, 32, 64, 4)
      >>> dyn_quant_matmul(jnp.ones((2, 64)), p).shape
      (2, 4)
    """
    check_packed(packed)
    x = check_input(x, packed)
    x2, lead = _flatten(x)
    qa, zp, recip = quantize_activations(x2, packed.channelwise)
    q = unpack_nibbles(packed.weight)
    idots = group_dots(qa, zp, q, packed.groupsize)
    out = accumulate_groups(idots, packed.scales, recip, zp, packed.bias, packed.channelwise)
    out = out.reshape(*lead, packed.out_features)
    return truncate_to_bfloat16(out) if x.dtype == jnp.bfloat16 else out


def weight_only_matmul(x: jax.Array, packed: PackedInt4Weight) -> jax.Array:
    """Reference W4A16/W4A32: ``x @ dequantize(w).T + bias`` at highest precision."""
    check_packed(packed)
    x = check_input(x, packed, allowed=(jnp.float32, jnp.bfloat16, jnp.float16), name="x")
    w = dequantize(packed.weight, packed.scales, packed.groupsize)
    out = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)
    if packed.bias is not None:
        out = out + packed.bias.reshape((1,) * (out.ndim - 1) + (-1,))
    return out.astype(x.dtype)
