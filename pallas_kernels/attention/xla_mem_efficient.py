"""Memory-efficient attention in plain XLA: the flash tiling plus additive-bias / boolean-mask tiles.

The CPU path of ``SDPBackend.EFFICIENT_ATTENTION``. It is the blockwise engine of
:mod:`xla_blockwise` (FlashAttention-2 online softmax, recomputing ``custom_vjp`` backward) with two
more per-tile inputs, in the spirit of xFormers' memory-efficient kernel (Rabe & Staats, 2021,
arXiv:2112.05682, "Self-attention does not need O(n^2) memory"):

* ``bias`` (rank 4, broadcastable to ``[B, N, T, S]``) is *read* per ``[block_q, block_k]`` tile and
  never broadcast; size-1 dimensions stay size 1. Its gradient is accumulated tile by tile into an
  array of the bias' own shape (broadcast dimensions summed), so ``jax.vjp`` w.r.t. ``bias`` works.
* ``mask`` (bool, same broadcasting) is read per tile the same way.

Memory: the output, LSE and gradients plus one tile; the bias and its gradient are as large as the
bias the caller passed (``O(T * S)`` only when the caller's bias is).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, xla_mem_efficient
  >>> q = jax.random.normal(jax.random.key(0), (1, 40, 2, 16))
  >>> bias = jax.random.normal(jax.random.key(1), (1, 2, 40, 40))
  >>> args = base.make_args(q, q, q, bias=bias)
  >>> out, _ = xla_mem_efficient.attention(args)
  >>> bool(jnp.allclose(out, base.reference(args)[0], atol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.attention import base, xla_blockwise, xla_flash

__all__ = ["Config", "attention", "unsupported"]


@dataclasses.dataclass(frozen=True)
class Config(xla_flash.Config):
    """Tile sizes: the flash tiles, chosen the same way (:meth:`xla_flash.Config.heuristics`,
    :meth:`xla_flash.Config.search_space`)."""


def unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Reasons this implementation cannot run ``args`` (empty if it can). Runs on any platform."""
    del platform
    return base.float64_reasons(args, "the blockwise XLA memory-efficient code")


def attention(args: base.AttentionArgs, *, config: Optional[xla_flash.Config] = None, **opts):
    """``(out [B, T, N, Hv], lse [B, N, T] float32)``; differentiable w.r.t. q, k, v and bias."""
    del opts
    return xla_blockwise.blockwise_attention(args, config or Config.heuristics(args))
