"""Causal bias objects (``torch.nn.attention.bias``): causal masks the kernels never materialise."""

from __future__ import annotations

import dataclasses
import enum
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CausalVariant", "CausalBias", "causal_upper_left", "causal_lower_right"]


class CausalVariant(enum.IntEnum):
    """Which diagonal a causal mask is aligned to (``torch.nn.attention.bias.CausalVariant``)."""

    UPPER_LEFT = 1
    LOWER_RIGHT = 2


@dataclasses.dataclass(frozen=True)
class CausalBias:
    """A causal mask of shape ``(seq_len_q, seq_len_kv)`` that is never materialised by the kernels.

    Pass it as ``attn_mask`` to :func:`scaled_dot_product_attention` (or ``mask`` to
    :func:`dot_product_attention`). ``UPPER_LEFT`` is torch's ``is_causal=True``; ``LOWER_RIGHT``
    aligns the last query with the last key (decoding with a KV cache).
    """

    variant: CausalVariant
    seq_len_q: int
    seq_len_kv: int

    def __post_init__(self):
        for name in ("seq_len_q", "seq_len_kv"):
            val = getattr(self, name)
            if jax.export.is_symbolic_dim(val):  # a shape-polymorphic export's size
                continue
            if not isinstance(val, (int, np.integer)) or val < 0:
                raise ValueError(f"CausalBias.{name} must be an int >= 0; got {val!r}")

    @property
    def diag_offset(self) -> int:
        return self.seq_len_kv - self.seq_len_q if self.variant == CausalVariant.LOWER_RIGHT else 0

    def materialize(self, device=None):
        """The boolean ``(seq_len_q, seq_len_kv)`` mask (True = attend)."""
        i = jnp.arange(self.seq_len_q)[:, None]
        j = jnp.arange(self.seq_len_kv)[None, :]
        m = j <= i + self.diag_offset
        return m if device is None else jax.device_put(m, device)


def _sizes(size) -> Tuple[int, int]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if len(size) != 2:
        raise ValueError(f"expected (seq_len_q, seq_len_kv); got {size!r}")
    # a symbolic size (a shape-polymorphic export's) stays symbolic
    return tuple(d if jax.export.is_symbolic_dim(d) else int(d) for d in size)


def causal_upper_left(*size) -> CausalBias:
    """Causal mask aligned to the top-left corner (torch's ``is_causal=True``).

    Example:
      >>> from jbackends.attention import causal_upper_left
      >>> causal_upper_left(2, 3).materialize().astype(int).tolist()
      [[1, 0, 0], [1, 1, 0]]
    """
    return CausalBias(CausalVariant.UPPER_LEFT, *_sizes(size))


def causal_lower_right(*size) -> CausalBias:
    """Causal mask aligned to the bottom-right corner (the last query sees every key).

    Example:
      >>> from jbackends.attention import causal_lower_right
      >>> causal_lower_right(2, 3).materialize().astype(int).tolist()
      [[1, 1, 0], [1, 1, 1]]
    """
    return CausalBias(CausalVariant.LOWER_RIGHT, *_sizes(size))
