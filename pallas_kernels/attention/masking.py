"""Mask and dropout math shared by every attention backend: soft cap, the index mask (causal, window),
the key range a query block can see, and the stateless dropout keep bits (the same in every backend).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.partition import manual_axis_type, varying_axes

Array = Any

__all__ = [
    "softcap",
    "index_mask",
    "key_range",
    "query_range",
    "manual_axis_type",
    "out_struct",
    "dropout_seed",
    "dropout_threshold",
    "dropout_keep_from_seed",
    "dropout_row_hash",
    "dropout_keep_from_row_hash",
    "dropout_keep_mask",
    "dropout_words",
    "dropout_words_of",
    "dropout_row_hash_from_words",
    "dropout_keep_from_words",
]

# ----------------------------------------------------------------------------------------------
# Shared math usable by every backend (plain jnp; also valid inside Pallas kernel bodies).
# ----------------------------------------------------------------------------------------------


def softcap(logits, cap: Optional[float]):
    """``cap * tanh(logits / cap)`` (identity when ``cap`` is None)."""
    if cap is None:
        return logits
    return cap * jnp.tanh(logits / cap)


def index_mask(
    i,
    j,
    *,
    causal: bool = False,
    diag_offset: int = 0,
    window: Optional[Tuple[int, int]] = None,
    q_len=None,
    kv_len=None,
    q_seg=None,
    kv_seg=None,
):
    """Bool "attend" mask from broadcastable query indices ``i`` and key indices ``j``.

    ``i`` / ``j`` are int32 arrays (e.g. ``i[:, None]`` and ``j[None, :]``); ``q_len`` / ``kv_len``
    are scalars (or arrays broadcastable against ``i`` / ``j``), ``q_seg`` / ``kv_seg`` the segment ids
    at ``i`` / ``j``. Returns ``None`` when nothing masks.
    """
    m = None

    def _and(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if causal:
        m = _and(m, j <= i + diag_offset)
    if window is not None:
        left, right = window
        m = _and(m, j >= i + (diag_offset - left))
        m = _and(m, j <= i + (diag_offset + right))
    if q_len is not None:
        m = _and(m, i < q_len)
    if kv_len is not None:
        m = _and(m, j < kv_len)
    if q_seg is not None:
        m = _and(m, q_seg == kv_seg)
    return m


def key_range(
    q_start,
    q_stop,
    kv_len: int,
    *,
    causal: bool,
    diag_offset: int = 0,
    window: Optional[Tuple[int, int]] = None,
):
    """Half-open key range ``[lo, hi)`` that query rows ``[q_start, q_stop)`` can attend to.

    Uses only the static structure (causal / window); works on Python ints (returns ints), numpy arrays
    (trace-time checks: returns numpy) or traced int32 scalars. The range may be empty (``lo == hi``).
    """
    if isinstance(q_start, int) and isinstance(q_stop, int):
        mn, mx = min, max
    elif isinstance(q_start, np.ndarray):
        mn, mx = np.minimum, np.maximum
    else:
        mn, mx = jnp.minimum, jnp.maximum
    lo, hi = 0, kv_len
    if causal:
        hi = mn(hi, q_stop + diag_offset)
    if window is not None:
        left, right = window
        lo = mx(lo, q_start + diag_offset - left)
        hi = mn(hi, q_stop + diag_offset + right)
    lo = mn(mx(lo, 0), kv_len)
    hi = mx(hi, lo)
    return lo, hi


def query_range(
    k_start,
    k_stop,
    q_len: int,
    *,
    causal: bool,
    diag_offset: int = 0,
    window: Optional[Tuple[int, int]] = None,
):
    """Query rows ``[lo, hi)`` that can attend to some key of ``[k_start, k_stop)`` (traced int32).

    The mirror of :func:`key_range`: static structure only (causal / window); ``lo`` lies in
    ``[0, q_len]``, and the range is empty when ``hi <= lo``.
    """
    lo, hi = jnp.int32(0), jnp.int32(q_len)
    if causal:
        lo = jnp.maximum(lo, k_start - diag_offset)
    if window is not None:
        left, right = window
        lo = jnp.maximum(lo, k_start - diag_offset - right)
        hi = jnp.minimum(hi, k_stop - diag_offset + left)
    return jnp.clip(lo, 0, q_len), hi


def _u32(x):
    if isinstance(x, int):  # e.g. a threshold >= 2**31, which does not fit the default int32
        return jnp.uint32(np.uint32(x))
    return jnp.asarray(x).astype(jnp.uint32)


def _rotl(x, r: int):
    return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def _mix(h, x):
    # One MurmurHash3 (32-bit) block round.
    x = x * jnp.uint32(0xCC9E2D51)
    x = _rotl(x, 15)
    x = x * jnp.uint32(0x1B873593)
    h = h ^ x
    h = _rotl(h, 13)
    return h * jnp.uint32(5) + jnp.uint32(0xE6546B64)


def _fmix(h):
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> jnp.uint32(13))
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> jnp.uint32(16))


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel output's ``ShapeDtypeStruct`` that varies over the same mesh axes as ``like``.

    Pallas outputs declared without it would be typed as replicated under ``shard_map``.
    """
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=manual_axis_type(like))


def dropout_seed(rng, like=None) -> Array:
    """The two uint32 words of a jax PRNG key (typed or raw) that seed :func:`dropout_keep_mask`.

    Under ``shard_map``, pass the (sharded) operands as ``like`` (an array or a tuple of them: query,
    key, value): the index of every mesh axis any of them varies over is mixed into the seed, so each
    shard draws its own mask (shards see local batch / head / sequence indices, which repeat across
    shards). Such masks are deterministic per key and mesh position but differ from the unsharded
    call's; under plain ``jit`` with sharded inputs nothing changes. Under
    ``shard_map(check_vma=False)`` JAX does not track which axes an array varies over, so nothing is
    mixed in and shards repeat each other's masks: fold ``lax.axis_index`` into the key yourself there.
    """
    seed = _dropout_seed(rng)
    arrays = like if isinstance(like, (tuple, list)) else (like,)
    for name in varying_axes(*(x for x in arrays if x is not None)):
        seed = jnp.stack([_mix(seed[0], _u32(jax.lax.axis_index(name))), seed[1]])
    return seed


def _dropout_seed(rng) -> Array:
    if rng is None:
        raise ValueError("`dropout_rng` is None")
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(rng)
    else:
        data = jnp.asarray(rng)
    data = data.reshape(-1).astype(jnp.uint32)
    if data.shape[0] == 1:
        return jnp.concatenate([data, data])
    if data.shape[0] > 2:
        folded = data[0::2][: data.shape[0] // 2] ^ data[1::2][: data.shape[0] // 2]
        return jnp.stack([folded[0], jnp.bitwise_xor.reduce(folded)])
    return data


def dropout_words(rng, like=None, offsets=None) -> Array:
    """``uint32[4]``: what a kernel's dropout reads, the two seed words then the batch and query-head
    offsets added to its local indices (:func:`dropout_keep_from_words`).

    Without ``offsets`` the seed is :func:`dropout_seed` ``(rng, like)`` and the offsets are 0. With
    ``offsets`` (an integer ``[2]``: the global batch and head index of a shard's first row and head,
    see ``AttentionArgs.dropout_offsets``) the shard hashes global indices, so the sharded call drops
    exactly what the unsharded one does, and nothing is mixed into the seed.
    """
    if offsets is None:
        return jnp.concatenate([dropout_seed(rng, like), jnp.zeros((2,), jnp.uint32)])
    return jnp.concatenate([_dropout_seed(rng), jnp.reshape(_u32(offsets), (2,))])


def dropout_words_of(args) -> Array:
    """:func:`dropout_words` of an ``AttentionArgs`` with dropout: its key, q / k / v and offsets."""
    return dropout_words(args.dropout_rng, (args.q, args.k, args.v), args.dropout_offsets)


def dropout_row_hash_from_words(words, b, n, i):
    """:func:`dropout_row_hash` of local indices ``b, n, i`` given :func:`dropout_words` (an array or
    a kernel's ref): the batch and head offsets are added first."""
    return dropout_row_hash(words[0], words[1], _u32(b) + _u32(words[2]), _u32(n) + _u32(words[3]), i)


def dropout_keep_from_words(words, b, n, i, j, threshold):
    """:func:`dropout_keep_from_seed` of local indices given :func:`dropout_words`."""
    return dropout_keep_from_row_hash(dropout_row_hash_from_words(words, b, n, i), j, threshold)


def dropout_threshold(rate: float) -> int:
    """uint32 threshold: a probability is kept iff its hash ``>=`` this value."""
    return min(int(round(float(rate) * 2.0**32)), 2**32 - 1)


def dropout_keep_from_seed(seed0, seed1, b, n, i, j, threshold):
    """Kernel-friendly form of :func:`dropout_keep_mask`: uint32 seed words and a uint32 threshold.

    Only uint32 multiply / xor / shift, so it lowers inside Pallas (Triton / Mosaic GPU) kernel bodies.
    """
    return dropout_keep_from_row_hash(dropout_row_hash(seed0, seed1, b, n, i), j, threshold)


def dropout_row_hash(seed0, seed1, b, n, i):
    """The hash state of :func:`dropout_keep_from_seed` after the seed, batch, head and query index
    (uint32, broadcast over them): what a kernel that holds one value per query row finishes with
    :func:`dropout_keep_from_row_hash`."""
    h = _mix(_u32(seed0), _u32(seed1))
    h = _mix(h, _u32(b))
    h = _mix(h, _u32(n))
    return _mix(h, _u32(i))


def dropout_keep_from_row_hash(h, j, threshold):
    """The keep bits of key index ``j`` given the row hashes ``h`` (:func:`dropout_row_hash`)."""
    return _fmix(_mix(_u32(h), _u32(j))) >= _u32(threshold)


def dropout_keep_mask(rng, b, n, i, j, rate: float, like=None):
    """Stateless dropout keep-mask: True where the probability at (b, n, i, j) is kept.

    ``rng`` is a jax PRNG key (typed or raw) or its :func:`dropout_seed` words; ``b, n, i, j`` are
    broadcastable integer arrays of *global* batch / query-head / query / key indices. Pure uint32
    hashing (MurmurHash3 rounds), so a Pallas kernel computes the same bits with
    :func:`dropout_keep_from_seed`. ``P(keep) = 1 - rate``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pallas_kernels.attention import base
      >>> keep = base.dropout_keep_mask(jax.random.key(0), 0, 0, jnp.arange(64)[:, None],
      ...                               jnp.arange(64)[None, :], 0.25)
      >>> 0.7 < float(keep.mean()) < 0.8
      True
    """
    seed = dropout_seed(rng, like)  # ``like``: see dropout_seed (shard_map)
    return dropout_keep_from_seed(seed[0], seed[1], b, n, i, j, dropout_threshold(rate))
