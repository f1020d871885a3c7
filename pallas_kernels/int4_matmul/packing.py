"""Int4 matmul: the packed-weight format, its argument checks and the weight quantizer.

Weights ``[N = out_features, K = in_features]`` are quantized symmetrically to 4 bits per group of
``groupsize`` consecutive k (a multiple of 32 that divides K; ``groupsize == K`` is channel-wise):
``scale = max|w| / 7`` and ``q = round_half_up(w / scale)`` in -7..7 (kernels accept -8..7), stored as
the unsigned nibble ``q + 8``, two per byte, **the low nibble is the even k**: bytes ``[N, K/2]``;
scales ``[N, K/groupsize]`` (torch's ``_dyn_quant_pack_4bit_weight`` layout). The matmuls these
weights feed are in `reference` (the contract) and in the engines.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "PackedInt4Weight",
    "Int4Call",
    "check_groupsize",
    "check_packed",
    "check_input",
    "pack_nibbles",
    "unpack_nibbles",
    "quantize_4bit",
    "dequantize",
]

# --------------------------------------------------------------------- format


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedInt4Weight:
    """A 4-bit weight, truly packed: 0.5 byte per weight plus scales and bias.

    A pytree (``weight``, ``scales``, ``bias`` are leaves; the sizes are static
    metadata), so it passes through ``jit``/``vmap`` and flax/orbax checkpoints.

    Attributes:
      weight: uint8 ``[out_features, in_features // 2]``; the low nibble is
        the even k; each nibble stores ``q + 8``.
      scales: float32 ``[out_features, in_features // groupsize]``.
      bias: float32 ``[out_features]`` or None.
      groupsize: quantization group along K (``== in_features``: channel-wise).
      in_features: K.
      out_features: N.

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.ones((8, 64), jnp.float32)
      >>> q, s = quantize_4bit(w, 32)
      >>> p = PackedInt4Weight(q, s, None, 32, 64, 8)
      >>> p.weight.shape, p.scales.shape
      ((8, 32), (8, 2))
    """

    weight: jax.Array
    scales: jax.Array
    bias: jax.Array | None
    groupsize: int = dataclasses.field(metadata=dict(static=True))
    in_features: int = dataclasses.field(metadata=dict(static=True))
    out_features: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_groups(self) -> int:
        return self.in_features // self.groupsize

    @property
    def channelwise(self) -> bool:
        return self.groupsize == self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes of weight traffic: packed nibbles + scales + bias."""
        n = self.weight.size * self.weight.dtype.itemsize
        n += self.scales.size * self.scales.dtype.itemsize
        if self.bias is not None:
            n += self.bias.size * self.bias.dtype.itemsize
        return int(n)


def _serialize_sizes(sizes: tuple) -> bytes:
    return ",".join(str(int(n)) for n in sizes).encode()


def _deserialize_sizes(data: bytes) -> tuple:
    return tuple(int(n) for n in data.decode().split(","))


# A packed weight may be an argument or a result of a serialized `jax.export` (its sizes are the
# tree's static data: groupsize, in_features, out_features).
jax.export.register_pytree_node_serialization(
    PackedInt4Weight,
    serialized_name="jbackends.PackedInt4Weight",
    serialize_auxdata=_serialize_sizes,
    deserialize_auxdata=_deserialize_sizes,
)


# ----------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class Int4Call:
    """What the engines' ``unsupported(call, platform)`` look at: the operation (``"dyn_quant"``:
    int8 activations, W4A8; ``"weight_only"``: W4A16 / W4A32), the packed weight, the activation dtype
    and the number of activation rows (``M``, every leading dimension)."""

    op: str
    packed: PackedInt4Weight
    x_dtype: Any
    rows: int

    @classmethod
    def of(cls, op: str, x: Any, packed: PackedInt4Weight) -> "Int4Call":
        """The call of ``op`` on activations ``x`` (an array or a ``jax.ShapeDtypeStruct``)."""
        if op not in ("dyn_quant", "weight_only"):
            raise ValueError(f"`op` must be 'dyn_quant' or 'weight_only'; got {op!r}")
        rows = math.prod(tuple(x.shape)[:-1])  # symbolic under a shape-polymorphic export
        return cls(op, packed, jnp.dtype(x.dtype), rows if jax.export.is_symbolic_dim(rows) else int(rows))

    @property
    def symbolic(self) -> bool:
        """Whether ``rows`` is a symbolic dimension (a shape-polymorphic ``jax.export``)."""
        return jax.export.is_symbolic_dim(self.rows)


def check_groupsize(groupsize: Any, in_features: int) -> int:
    """Returns ``groupsize`` as an int, or raises a ValueError naming it."""
    if isinstance(groupsize, bool) or not isinstance(groupsize, (int, np.integer)):
        raise TypeError(f"groupsize must be an int, got {groupsize!r}")
    groupsize = int(groupsize)
    if in_features <= 0 or in_features % 2:
        raise ValueError(
            f"in_features must be positive and even (two 4-bit weights per byte), got {in_features=}"
        )
    if groupsize != in_features and (groupsize <= 0 or groupsize % 32):
        raise ValueError(
            f"groupsize must be a multiple of 32 or equal to in_features, got {groupsize=}, {in_features=}"
        )
    if in_features % groupsize:
        raise ValueError(f"groupsize must divide in_features, got {groupsize=}, {in_features=}")
    return groupsize


def check_packed(packed: Any) -> PackedInt4Weight:
    """Checks the shapes and dtypes of a `PackedInt4Weight`'s leaves."""
    if not isinstance(packed, PackedInt4Weight):
        raise TypeError(
            f"packed must be a PackedInt4Weight (from dyn_quant_pack_4bit_weight), got {type(packed).__name__}"
        )
    K, N, g = packed.in_features, packed.out_features, packed.groupsize
    check_groupsize(g, K)
    w, s, b = packed.weight, packed.scales, packed.bias
    if w.dtype != jnp.uint8:
        raise TypeError(f"packed.weight must be uint8 (two nibbles per byte), got {w.dtype}")
    if w.shape != (N, K // 2):
        raise ValueError(
            f"packed.weight must have shape (out_features, in_features // 2) = {(N, K // 2)}, got {w.shape}"
        )
    if s.dtype != jnp.float32:
        raise TypeError(f"packed.scales must be float32, got {s.dtype}")
    if s.shape != (N, K // g):
        raise ValueError(
            f"packed.scales must have shape (out_features, in_features // groupsize) = {(N, K // g)}, got {s.shape}"
        )
    if b is not None:
        if b.dtype != jnp.float32:
            raise TypeError(f"packed.bias must be float32, got {b.dtype}")
        if b.shape != (N,):
            raise ValueError(f"packed.bias must have shape (out_features,) = {(N,)}, got {b.shape}")
    return packed


def check_input(
    x: Any, packed: PackedInt4Weight, *, allowed=(jnp.float32, jnp.bfloat16), name: str = "input"
) -> jax.Array:
    """Checks ``x[..., K]`` against ``packed``; returns it as an array."""
    x = jnp.asarray(x)
    if x.dtype not in tuple(jnp.dtype(d) for d in allowed):
        names = ", ".join(jnp.dtype(d).name for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != packed.in_features:
        raise ValueError(
            f"{name}.shape[-1] must equal in_features={packed.in_features}, got {name}.shape={x.shape}"
        )
    return x


# ------------------------------------------------------------ weight packing


def _round_half_up(y: jax.Array) -> jax.Array:
    # floor(y + 0.5) rounds 0.49999997 up in float32; this does not.
    f = jnp.floor(y)
    return f + (y - f >= 0.5).astype(y.dtype)


def pack_nibbles(q: jax.Array) -> jax.Array:
    """int ``[N, K]`` in -8..7 -> uint8 ``[N, K/2]`` (low nibble = even k)."""
    u = (q.astype(jnp.int32) + 8).astype(jnp.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """uint8 ``[N, K/2]`` -> int32 ``[N, K]`` in -8..7."""
    lo = (packed & 0x0F).astype(jnp.int32) - 8
    hi = (packed >> 4).astype(jnp.int32) - 8
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_4bit(weight: jax.Array, groupsize: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric 4-bit quantization of ``weight[N, K]`` per group along K.

    ``scale = max|w_group| / 7`` (float32; 0 for an all-zero group, whose q is
    0), ``q = round_half_up(w / scale)`` clipped to -8..7.

    Args:
      weight: float ``[out_features, in_features]``.
      groupsize: a multiple of 32 dividing ``in_features``, or
        ``in_features`` for channel-wise scales.

    Returns:
      ``(packed uint8 [N, K/2], scales float32 [N, K/groupsize])``.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = quantize_4bit(jnp.arange(64.0).reshape(1, 64) - 32, 32)
      >>> q.dtype, q.shape, s.shape
      (dtype('uint8'), (1, 32), (1, 2))
    """
    weight = jnp.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {weight.shape}")
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    N, K = weight.shape
    groupsize = check_groupsize(groupsize, K)
    w = weight.astype(jnp.float32).reshape(N, K // groupsize, groupsize)
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = amax / _opaque(jnp.full(amax.shape, 7, jnp.float32), amax)
    safe = jnp.where(scale == 0, jnp.float32(1), scale)
    q = jnp.clip(_round_half_up(w / _opaque(jnp.broadcast_to(safe[..., None], w.shape), w)), -8, 7)
    q = q.astype(jnp.int32)
    return pack_nibbles(q.reshape(N, K)), scale


def dequantize(weight: jax.Array, scales: jax.Array, groupsize: int) -> jax.Array:
    """uint8 ``[N, K/2]`` + scales ``[N, K/g]`` -> float32 ``[N, K]``."""
    q = unpack_nibbles(weight).astype(jnp.float32)
    N, K = q.shape
    return (q.reshape(N, K // groupsize, groupsize) * scales.astype(jnp.float32)[..., None]).reshape(N, K)


def _opaque(v: jax.Array, like: jax.Array) -> jax.Array:
    """``v`` unchanged, but not recognisable as a broadcast or a constant.

    XLA rewrites ``a / broadcast(b)`` as ``a * broadcast(1 / b)``, which is
    not correctly rounded; torch divides. The value goes through an integer
    ``or`` with a runtime term that is 0 unless ``like`` holds the one NaN
    bit pattern 0x7FFFFFFF.
    """
    guard = lax.bitcast_convert_type(like.astype(jnp.float32), jnp.int32) == 0x7FFFFFFF
    bits = lax.bitcast_convert_type(v, jnp.int32) | guard.astype(jnp.int32)
    return lax.bitcast_convert_type(bits, jnp.float32)
