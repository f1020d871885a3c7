"""Attention: the canonical arguments, the reference implementation, shared mask/dropout math.

Every attention backend (XLA flash, XLA memory-efficient, cuDNN bridge, Pallas GPU kernels) takes one
:class:`AttentionArgs` and returns ``(out, lse)``; the :func:`reference` here is the single source of
truth they are all tested against. This module holds no flags: dispatch lives in ``jbackends``.

Layout is BTNH like ``jax.nn.dot_product_attention``:

* ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]`` with ``N % K == 0``. Query head ``n``
  reads key/value head ``n // (N // K)`` (GQA / MQA, the same grouping as torch's ``enable_gqa`` and
  jax.nn); fast paths index the group, they never materialise a repeat.
* ``bias``: additive float, rank 4, broadcastable to ``[B, N, T, S]`` (never broadcast by fast paths).
* ``mask``: bool, rank 4, broadcastable to ``[B, N, T, S]``, ``True`` = attend.
* ``causal``: key ``j`` allowed iff ``j <= i + diag_offset``. ``diag_offset=0`` is torch's top-left
  ``is_causal``; ``diag_offset=S - T`` is the lower-right alignment (``causal_lower_right``).
* ``window=(left, right)``: key ``j`` allowed iff ``i + diag_offset - left <= j <= i + diag_offset + right``.
* ``q_seq_lengths`` / ``kv_seq_lengths``: int32 ``[B]``; query rows / keys at index ``>= length`` are masked.
* ``q_segment_ids [B, T]`` / ``kv_segment_ids [B, S]``: int32; attend iff equal (packed sequences).
* ``logits_soft_cap``: ``logits -> cap * tanh(logits / cap)`` after scaling, before bias and masks.
* ``dropout_rate`` in ``[0, 1)`` with ``dropout_rng``: the keep decision is the stateless
  :func:`dropout_keep_mask` of (key, batch, head, query index, key index), so every backend drops the
  same probabilities; kept probabilities are scaled by ``1 / (1 - rate)``. The LSE is the one of the
  un-dropped softmax (as in FlashAttention).

Fully masked rows (every key masked for that query) produce output 0, ``lse = -inf`` and zero
gradients in every backend. torch's CPU math path does the same for boolean masks.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base
  >>> q = k = v = jnp.ones((1, 4, 2, 8), jnp.float32)
  >>> args = base.make_args(q, k, v, is_causal=True)
  >>> out, lse = base.reference(args)
  >>> out.shape, lse.shape
  ((1, 4, 2, 8), (1, 2, 4))
"""

from __future__ import annotations

from pallas_kernels.attention.args import (
    SUPPORTED_DTYPES,
    AttentionArgs,
    Statics,
    check_prng_key,
    float64_reasons,
    make_args,
)
from pallas_kernels.attention.masking import (
    dropout_keep_from_row_hash,
    dropout_keep_from_seed,
    dropout_keep_from_words,
    dropout_keep_mask,
    dropout_row_hash,
    dropout_row_hash_from_words,
    dropout_seed,
    dropout_threshold,
    dropout_words,
    dropout_words_of,
    index_mask,
    key_range,
    query_range,
    manual_axis_type,
    out_struct,
    softcap,
)
from pallas_kernels.attention.reference import (
    attention,
    differentiable_backward,
    full_mask,
    reference,
    reference_vjp,
    rows_can_lack_keys,
    rows_without_keys,
    structure_empties_rows,
    unsupported,
)

__all__ = [
    "AttentionArgs",
    "Statics",
    "make_args",
    "reference",
    "index_mask",
    "key_range",
    "query_range",
    "softcap",
    "dropout_seed",
    "dropout_keep_mask",
    "dropout_keep_from_seed",
    "dropout_row_hash",
    "dropout_keep_from_row_hash",
    "dropout_words",
    "dropout_words_of",
    "dropout_row_hash_from_words",
    "dropout_keep_from_words",
    "full_mask",
    "rows_can_lack_keys",
    "rows_without_keys",
    "structure_empties_rows",
    "check_prng_key",
    "reference_vjp",
    "differentiable_backward",
    "dropout_threshold",
    "SUPPORTED_DTYPES",
    "float64_reasons",
    "unsupported",
    "attention",
    "manual_axis_type",
    "out_struct",
]
