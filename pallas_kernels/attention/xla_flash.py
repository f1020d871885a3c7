"""FlashAttention-2 in plain XLA: blockwise online softmax, O(L x block) memory forward and backward.

This is the implementation of ``SDPBackend.FLASH_ATTENTION`` that runs on every platform; the
dispatcher prefers the C++ kernel of :mod:`cpp_flash` over it when lowering for CPU where that kernel
can run the call (flag ``flash_cpu_kernel``). The algorithm is FlashAttention-2 (Dao, 2023, arXiv:2307.08691):

* Forward (Algorithm 1): an outer ``lax.scan`` over query blocks; for each, a ``lax.fori_loop`` over
  only the key blocks the block can see (causal / window structure, so fully masked blocks are never
  computed). We keep an *unscaled* accumulator ``acc``, the running row max ``m`` and row sum ``l``
  (section 3.1.1: rescale by ``exp(m_old - m_new)`` per step, divide by ``l`` once at the end).
  Every head of a GQA group shares the key/value block: the ``G`` query heads of one key/value head
  are stacked into the rows of one matmul (``[B, K, G * block_q, H] @ [B, K, block_k, H]^T``), so
  there is no materialised repeat and the inner matmuls stay large.
* Backward (Algorithm 2): an outer ``lax.scan`` over key blocks, an inner loop over the query blocks
  that see it; ``P`` is recomputed from the saved LSE, ``dK``/``dV`` accumulate in the loop carry and
  ``dQ`` in a ``[T, H]``-sized buffer updated in place. ``D_i = rowsum(dO_i * O_i)`` (minus the LSE
  cotangent, so ``lse`` is differentiable too).
* Masks (causal, window, lengths, segment ids, padding) are generated per block from indices.
  Interior blocks whose causal/window mask is all-true run a body without the mask select.
* ``logits_soft_cap`` is applied per block (its derivative ``1 - tanh^2`` in the backward); dropout
  uses the stateless :func:`base.dropout_keep_mask` of global indices, so it matches every backend.

Peak memory is ``O((T + S) * H + block_q * block_k * N)`` for both passes, against ``O(T * S * N)``
for the math path.

This module holds the implementation's :class:`Config` (tiles, with the ``heuristics`` /
``search_space`` tuning protocol), :func:`unsupported` and :func:`attention`; the engine itself (forward
and backward passes) is :mod:`xla_blockwise`, its block layouts, ranges and per-block logits
:mod:`xla_blocks`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, xla_flash
  >>> q = jax.random.normal(jax.random.key(0), (1, 300, 4, 32))
  >>> args = base.make_args(q, q, q, is_causal=True)
  >>> cfg = xla_flash.Config(block_q=128, block_k=128)
  >>> out, lse = xla_flash.attention(args, config=cfg)
  >>> ref, _ = base.reference(args)
  >>> bool(jnp.allclose(out, ref, atol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

from pallas_kernels.attention import base
from pallas_kernels.attention.xla_blockwise import blockwise_attention

__all__ = ["Config", "attention", "unsupported"]


def _fit(n: int, b: int) -> int:
    """Tile ``b``, shrunk to the (8-rounded) length ``n``."""
    return max(1, min(b, -(-n // 8) * 8))


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of the XLA flash implementation.

    Attributes:
      block_q: query rows per block (per head; the ``G`` heads of a GQA group are stacked on top).
      block_k: keys per block.
      block_q_bwd: query block of the backward (default: ``block_q``).
      block_k_bwd: key block of the backward (default: ``block_k``).
      compute_dtype: dtype of the matmuls and the softmax (``"float32"``; inputs are upcast once).
    """

    block_q: int = 512
    block_k: int = 512
    block_q_bwd: Optional[int] = None
    block_k_bwd: Optional[int] = None
    compute_dtype: str = "float32"

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            val = getattr(self, name)
            if val is None and name.endswith("_bwd"):
                continue
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"Config.{name} must be an int >= 1; got {name}={val!r}")

    @property
    def bwd(self) -> Tuple[int, int]:
        return (self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k)

    @classmethod
    def heuristics(cls, args: base.AttentionArgs, device: Optional[Mapping[str, Any]] = None) -> "Config":
        """Tiles measured best on a 2-core x86 CPU (f32, head dim 64, L = 4k):

        * forward: 1024 x 1024 without structure (fewest loop steps, GEMMs still cache friendly);
          512 x 512 under causal / window masks (finer block skipping wins);
        * backward: 256 query rows x 1024 keys (the five GEMMs per step stay in cache);
        * the ``G`` heads of a GQA group share one tile, so ``block_q`` is divided by ``G``;
        * every tile shrinks to the (8-rounded) sequence length for short sequences.

        ``device`` (the tuning protocol's device record) does not change them today.
        """
        del device
        structural = args.causal or args.window is not None
        bq, bk = (512, 512) if structural else (1024, 1024)
        g = args.groups
        return cls(
            block_q=_fit(args.q_len, max(64, bq // g)),
            block_k=_fit(args.kv_len, bk),
            block_q_bwd=_fit(args.q_len, max(32, 256 // g)),
            block_k_bwd=_fit(args.kv_len, 1024),
        )

    @classmethod
    def search_space(cls, args: base.AttentionArgs) -> list:
        """Forward tiles 256 / 512 / 1024 (query rows divided by the GQA group) x 256 / 512 / 1024 keys,
        backward tiles 128 / 256 x 512 / 1024, each shrunk to the sequences (duplicates dropped)."""
        g = args.groups
        T, S = args.q_len, args.kv_len
        out = [
            cls(
                block_q=_fit(T, max(64, bq // g)),
                block_k=_fit(S, bk),
                block_q_bwd=_fit(T, max(32, bqb // g)),
                block_k_bwd=_fit(S, bkb),
            )
            for bq in (256, 512, 1024)
            for bk in (256, 512, 1024)
            for bqb in (128, 256)
            for bkb in (512, 1024)
        ]
        return list(dict.fromkeys(out))


def unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Reasons this implementation cannot run ``args`` (empty if it can). Runs on any platform."""
    del platform
    reasons = base.float64_reasons(args, "the blockwise XLA flash code")
    if args.bias is not None:
        reasons.append("FLASH takes no additive bias / float attn_mask (EFFICIENT_ATTENTION or MATH do)")
    if args.mask is not None:
        reasons.append(
            "FLASH takes no arbitrary boolean attn_mask yet, also on CPU (torch's CPU flash "
            "does): enable EFFICIENT_ATTENTION or MATH too (e.g. sdpa_kernel([FLASH_ATTENTION,"
            " EFFICIENT_ATTENTION])), or express the mask as is_causal / a CausalBias / "
            "window / lengths / segment ids"
        )
    return reasons


def attention(args: base.AttentionArgs, *, config: Optional[Config] = None, **opts):
    """Blockwise flash attention in XLA: ``(out [B, T, N, Hv] q.dtype, lse [B, N, T] float32)``.

    Runs on every platform; differentiable (``jax.vjp``) w.r.t. q, k, v; the backward recomputes per
    block. ``config`` defaults to :meth:`Config.heuristics`; ``opts`` are ignored dispatch options.
    """
    del opts
    reasons = unsupported(args, "any")
    if reasons:
        raise NotImplementedError("; ".join(reasons))
    return blockwise_attention(args, config or Config.heuristics(args))
