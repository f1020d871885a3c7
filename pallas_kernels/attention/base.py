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

import dataclasses
import functools
import math
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = Any

__all__ = [
    "AttentionArgs",
    "make_args",
    "reference",
    "index_mask",
    "key_range",
    "softcap",
    "dropout_seed",
    "dropout_keep_mask",
    "dropout_keep_from_seed",
    "full_mask",
    "rows_without_keys",
    "check_prng_key",
    "reference_vjp",
    "differentiable_backward",
    "dropout_threshold",
    "SUPPORTED_DTYPES",
    "unsupported",
    "attention",
]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                    jnp.dtype(jnp.float64))

_ARRAY_FIELDS = ("q", "k", "v", "bias", "mask", "q_seq_lengths", "kv_seq_lengths",
                 "q_segment_ids", "kv_segment_ids", "dropout_rng")
_STATIC_FIELDS = ("scale", "causal", "diag_offset", "window", "logits_soft_cap", "dropout_rate")


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionArgs:
  """Canonical attention arguments (BTNH layout). Build with :func:`make_args`, which validates.

  It is a pytree: arrays are leaves; ``scale``, ``causal``, ``diag_offset``, ``window``,
  ``logits_soft_cap`` and ``dropout_rate`` are static metadata.
  """
  q: Array
  k: Array
  v: Array
  bias: Optional[Array] = None
  mask: Optional[Array] = None
  scale: float = 1.0
  causal: bool = False
  diag_offset: int = 0
  window: Optional[Tuple[int, int]] = None
  q_seq_lengths: Optional[Array] = None
  kv_seq_lengths: Optional[Array] = None
  q_segment_ids: Optional[Array] = None
  kv_segment_ids: Optional[Array] = None
  logits_soft_cap: Optional[float] = None
  dropout_rate: float = 0.0
  dropout_rng: Optional[Array] = None

  # Shapes, named like the contract.
  @property
  def batch(self) -> int:
    return self.q.shape[0]

  @property
  def q_len(self) -> int:
    return self.q.shape[1]

  @property
  def kv_len(self) -> int:
    return self.k.shape[1]

  @property
  def num_heads(self) -> int:
    return self.q.shape[2]

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[2]

  @property
  def groups(self) -> int:
    return self.q.shape[2] // self.k.shape[2]

  @property
  def head_dim(self) -> int:
    return self.q.shape[3]

  @property
  def v_head_dim(self) -> int:
    return self.v.shape[3]

  @property
  def dtype(self):
    return self.q.dtype

  @property
  def has_index_masks(self) -> bool:
    """Whether any mask generated from indices (causal, window, lengths, segments) is present."""
    return (self.causal or self.window is not None or self.q_seq_lengths is not None
            or self.kv_seq_lengths is not None or self.q_segment_ids is not None)

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  def replace(self, **changes) -> "AttentionArgs":
    return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    AttentionArgs, data_fields=list(_ARRAY_FIELDS), meta_fields=list(_STATIC_FIELDS))


# ----------------------------------------------------------------------------------------------
# Canonicalisation / validation.
# ----------------------------------------------------------------------------------------------

def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_broadcastable(name: str, x, target: tuple) -> None:
  if x.ndim != 4:
    raise ValueError(f"`{name}` must be rank 4 broadcastable to [B, N, T, S]={target}; "
                     f"got {name}.shape={tuple(x.shape)}")
  for d, (a, b) in enumerate(zip(x.shape, target)):
    if a != 1 and a != b:
      raise ValueError(f"`{name}` with shape {tuple(x.shape)} is not broadcastable to "
                       f"[B, N, T, S]={target} (dimension {d}: {a} vs {b})")


def _check_lengths(name: str, x, batch: int, limit: int):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"`{name}` must be an integer array of shape [B]={batch}; got dtype {x.dtype}")
  if x.shape != (batch,):
    raise ValueError(f"`{name}` must have shape [B]=({batch},); got {name}.shape={tuple(x.shape)}")
  if _is_concrete(x):
    xs = np.asarray(x)
    if xs.size and (xs.min() < 0 or xs.max() > limit):
      raise ValueError(f"`{name}` values must lie in [0, {limit}]; got {xs.tolist()}")
  return x.astype(jnp.int32)


def _check_segments(name: str, x, shape: tuple):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"`{name}` must be an integer array of shape {shape}; got dtype {x.dtype}")
  if tuple(x.shape) != shape:
    raise ValueError(f"`{name}` must have shape {shape}; got {name}.shape={tuple(x.shape)}")
  return x.astype(jnp.int32)


def check_prng_key(rng, name: str = "dropout_rng") -> None:
  """Raises ``TypeError`` unless ``rng`` is one jax PRNG key.

  Accepted: a typed key (``jax.random.key(0)``, shape ``()``) and a legacy raw key
  (``jax.random.PRNGKey(0)``: ``uint32`` of the default implementation's key shape, ``(2,)`` for
  threefry), the two forms ``jax.random`` and flax take. A Python int, a string, float or int32
  arrays, or several keys at once are refused (they would silently become a seed).
  """
  dt = getattr(rng, "dtype", None)
  if dt is not None and jnp.issubdtype(dt, jax.dtypes.prng_key):
    if np.shape(rng) != ():
      raise TypeError(f"`{name}` must be one PRNG key (shape ()); got a key array of shape "
                      f"{tuple(np.shape(rng))}")
    return
  raw_shapes = {(2,), (4,)}  # threefry; rbg / unsafe_rbg
  if dt is not None and jnp.dtype(dt) == jnp.uint32 and tuple(np.shape(rng)) in raw_shapes:
    return
  what = (f"{jnp.dtype(dt).name}{list(np.shape(rng))}" if dt is not None
          else f"{type(rng).__name__} {rng!r}")
  raise TypeError(f"`{name}` must be a PRNG key: jax.random.key(seed) (or a legacy "
                  f"jax.random.PRNGKey(seed), uint32[2]); got {what}")


def make_args(
    q, k, v, *,
    bias=None,
    mask=None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    diag_offset: int = 0,
    window: Optional[Tuple[int, int]] = None,
    q_seq_lengths=None,
    kv_seq_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logits_soft_cap: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
) -> AttentionArgs:
  """Validates BTNH attention inputs and returns the canonical :class:`AttentionArgs`.

  Raises ``ValueError`` / ``TypeError`` naming the offending argument. Length values can only be
  range-checked when they are concrete (outside ``jit``).

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.attention import base
    >>> a = base.make_args(jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 2, 16)), jnp.ones((2, 8, 2, 16)))
    >>> a.groups, a.scale
    (2, 0.25)
  """
  for name, x in (("query", q), ("key", k), ("value", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"`{name}` must be an array; got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(f"`{name}` must be rank 4 [B, T, N, H]; got {name}.shape={tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
      raise TypeError(f"`{name}` dtype must be one of "
                      f"{[str(d) for d in SUPPORTED_DTYPES]}; got {name}.dtype={x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"query, key and value must share a dtype; got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  B, T, N, H = q.shape
  Bk, S, K, Hk = k.shape
  Bv, Sv, Kv, Hv = v.shape
  if not (B == Bk == Bv):
    raise ValueError(f"batch sizes differ: query {B}, key {Bk}, value {Bv}")
  if S != Sv:
    raise ValueError(f"key and value sequence lengths differ: key {S}, value {Sv}")
  if K != Kv:
    raise ValueError(f"key and value head counts differ: key {K}, value {Kv}")
  if H != Hk:
    raise ValueError(f"query and key head dims differ: query {H}, key {Hk}")
  if K == 0 or N % K != 0:
    raise ValueError(f"query heads must be a positive multiple of key/value heads (GQA); got "
                     f"{N=} query heads, {K=} key/value heads")
  target = (B, N, T, S)
  if bias is not None:
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"`bias` must be a floating array; got bias.dtype={bias.dtype}")
    _check_broadcastable("bias", bias, target)
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"`mask` must be a bool array (True = attend); got mask.dtype={mask.dtype}")
    _check_broadcastable("mask", mask, target)
  if scale is None:
    # Head dim 0: every logit is an empty sum (0) whatever the scale, so any finite scale gives
    # torch's answer (uniform weights); 1 / sqrt(0) would make it 0 * inf = NaN.
    scale = 1.0 / math.sqrt(H) if H > 0 else 1.0
  if isinstance(scale, jax.core.Tracer):
    raise TypeError("`scale` must be a Python float, not a traced value")
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer,
                                                                   np.floating)):
    if not (hasattr(scale, "shape") and np.shape(scale) == ()):
      raise TypeError(f"`scale` must be a float; got {type(scale).__name__} {scale!r}")
  scale = float(scale)
  if not math.isfinite(scale):  # torch takes any float, 0 and negative ones included
    raise ValueError(f"`scale` must be a finite float; got {scale=}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"`is_causal` must be a bool; got {type(is_causal).__name__} {is_causal!r}")
  diag_offset = int(diag_offset)
  if window is not None:
    if (not isinstance(window, (tuple, list)) or len(window) != 2
        or any(not isinstance(w, (int, np.integer)) or w < 0 for w in window)):
      raise ValueError(f"`window` must be a (left, right) pair of ints >= 0; got {window=}")
    window = (int(window[0]), int(window[1]))
  if q_seq_lengths is not None:
    q_seq_lengths = _check_lengths("q_seq_lengths", q_seq_lengths, B, T)
  if kv_seq_lengths is not None:
    kv_seq_lengths = _check_lengths("kv_seq_lengths", kv_seq_lengths, B, S)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    if q_segment_ids is None:
      q_segment_ids = kv_segment_ids if T == S else None
    else:
      kv_segment_ids = q_segment_ids if T == S else None
    if q_segment_ids is None or kv_segment_ids is None:
      raise ValueError("segment ids: give both `q_segment_ids` and `kv_segment_ids` when T != S")
  if q_segment_ids is not None:
    q_segment_ids = _check_segments("q_segment_ids", q_segment_ids, (B, T))
    kv_segment_ids = _check_segments("kv_segment_ids", kv_segment_ids, (B, S))
  if logits_soft_cap is not None:
    logits_soft_cap = float(logits_soft_cap)
    if not logits_soft_cap > 0:
      raise ValueError(f"`logits_soft_cap` must be > 0; got {logits_soft_cap=}")
  dropout_rate = float(dropout_rate)
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"`dropout_rate` must be in [0, 1); got {dropout_rate=}")
  if dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError(f"`dropout_rng` (a jax PRNG key) is required when {dropout_rate=} > 0")
  if dropout_rng is not None:
    check_prng_key(dropout_rng)
  if dropout_rate == 0.0:
    dropout_rng = None
  return AttentionArgs(
      q=q, k=k, v=v, bias=bias, mask=mask, scale=scale, causal=bool(is_causal),
      diag_offset=diag_offset, window=window, q_seq_lengths=q_seq_lengths,
      kv_seq_lengths=kv_seq_lengths, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
      logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_rng=dropout_rng)


# ----------------------------------------------------------------------------------------------
# Shared math usable by every backend (plain jnp; also valid inside Pallas kernel bodies).
# ----------------------------------------------------------------------------------------------

def softcap(logits, cap: Optional[float]):
  """``cap * tanh(logits / cap)`` (identity when ``cap`` is None)."""
  if cap is None:
    return logits
  return cap * jnp.tanh(logits / cap)


def index_mask(i, j, *, causal: bool = False, diag_offset: int = 0,
               window: Optional[Tuple[int, int]] = None, q_len=None, kv_len=None,
               q_seg=None, kv_seg=None):
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


def key_range(q_start, q_stop, kv_len: int, *, causal: bool, diag_offset: int = 0,
              window: Optional[Tuple[int, int]] = None):
  """Half-open key range ``[lo, hi)`` that query rows ``[q_start, q_stop)`` can attend to.

  Uses only the static structure (causal / window); works on Python ints (returns ints) or traced
  int32 scalars. The range may be empty (``lo == hi``).
  """
  static = isinstance(q_start, int) and isinstance(q_stop, int)
  mn, mx = (min, max) if static else (jnp.minimum, jnp.maximum)
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


def manual_axis_type(x):
  """The ``shard_map`` axis typing of ``x`` (which mesh axes it varies over); None outside JAX types."""
  return getattr(jax.typeof(x), "manual_axis_type", None)


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
  varying = set()
  for x in arrays:
    if x is not None:
      varying |= set(getattr(manual_axis_type(x), "varying", ()) or ())
  for name in sorted(varying):
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


def dropout_threshold(rate: float) -> int:
  """uint32 threshold: a probability is kept iff its hash ``>=`` this value."""
  return min(int(round(float(rate) * 2.0 ** 32)), 2 ** 32 - 1)


def dropout_keep_from_seed(seed0, seed1, b, n, i, j, threshold):
  """Kernel-friendly form of :func:`dropout_keep_mask`: uint32 seed words and a uint32 threshold.

  Only uint32 multiply / xor / shift, so it lowers inside Pallas (Triton / Mosaic GPU) kernel bodies.
  """
  h = _mix(_u32(seed0), _u32(seed1))
  h = _mix(h, _u32(b))
  h = _mix(h, _u32(n))
  h = _mix(h, _u32(i))
  h = _mix(h, _u32(j))
  return _fmix(h) >= _u32(threshold)


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


# ----------------------------------------------------------------------------------------------
# Reference (math) implementation.
# ----------------------------------------------------------------------------------------------

def full_mask(args: AttentionArgs):
  """The complete bool ``[B, N, T, S]``-broadcastable mask of ``args`` (None if nothing masks).

  For the reference only: it materialises ``T x S`` when an index mask is present.
  """
  B, T, S = args.batch, args.q_len, args.kv_len
  i = jnp.arange(T, dtype=jnp.int32)[:, None]
  j = jnp.arange(S, dtype=jnp.int32)[None, :]
  m = index_mask(i, j, causal=args.causal, diag_offset=args.diag_offset, window=args.window)
  m = None if m is None else m[None, None]
  if args.q_seq_lengths is not None:
    mq = (i[None] < args.q_seq_lengths[:, None, None])[:, None]
    m = mq if m is None else m & mq
  if args.kv_seq_lengths is not None:
    mk = (j[None] < args.kv_seq_lengths[:, None, None])[:, None]
    m = mk if m is None else m & mk
  if args.q_segment_ids is not None:
    ms = (args.q_segment_ids[:, :, None] == args.kv_segment_ids[:, None, :])[:, None]
    m = ms if m is None else m & ms
  if args.mask is not None:
    m = args.mask if m is None else m & args.mask
  del B
  return m


def rows_without_keys(args: AttentionArgs):
  """Bool ``[B, 1 | N, T]``: True where a query row has no key left (the kernels' output 0 / LSE
  ``-inf`` rows), from the masks alone (a ``-inf`` bias is not looked at). None if no row can be.

  Closed form (``O(B * T)``) for causal / window / lengths; the boolean mask and segment ids are
  reduced over the keys.
  """
  T, S = args.q_len, args.kv_len
  if not (args.has_index_masks or args.mask is not None) and S > 0:
    return None
  if args.mask is not None or args.q_segment_ids is not None:
    m = full_mask(args)
    return ~jnp.any(jnp.broadcast_to(m, m.shape[:2] + (T, S)), axis=-1)
  i = jnp.arange(T, dtype=jnp.int32)
  lo, hi = key_range(i, i + 1, S, causal=args.causal, diag_offset=args.diag_offset,
                     window=args.window)
  hi = jnp.broadcast_to(hi, (T,))[None]
  lo = jnp.broadcast_to(lo, (T,))[None]
  if args.kv_seq_lengths is not None:
    hi = jnp.minimum(hi, args.kv_seq_lengths[:, None])
  empty = lo >= hi
  if args.q_seq_lengths is not None:
    empty = empty | (i[None] >= args.q_seq_lengths[:, None])
  return jnp.broadcast_to(empty, (args.batch, T))[:, None]


def reference(args: AttentionArgs, *, low_precision: bool = False):
  """The math implementation: plain jnp, float32 accumulation (unless ``low_precision``).

  Args:
    args: canonical arguments (see :func:`make_args`).
    low_precision: for fp16/bf16 inputs, compute logits, softmax and the PV product in the input
      dtype (torch's ``allow_fp16_bf16_reduction_math_sdp``). Ignored for float32/64.

  Returns:
    ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32)``, the natural-log LSE of the
    (scaled, soft-capped, biased, masked) logits; ``-inf`` for fully masked rows, whose output is 0.

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.attention import base
    >>> x = jnp.zeros((1, 3, 1, 4))
    >>> out, lse = base.reference(base.make_args(x, x, x))
    >>> float(lse[0, 0, 0])  # log(3)
    1.0986...
  """
  q, k, v = args.q, args.k, args.v
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  if S == 0:  # no key: an empty sum (torch's and jax.nn's 0), LSE -inf
    return (jnp.zeros((B, T, N, v.shape[-1]), q.dtype), jnp.full((B, N, T), -jnp.inf, jnp.float32))
  low = low_precision and q.dtype in (jnp.bfloat16, jnp.float16)
  cdt = q.dtype if low else jnp.promote_types(q.dtype, jnp.float32)
  prec = jax.lax.Precision.HIGHEST
  qg = q.reshape(B, T, K, G, H).astype(cdt)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(cdt), precision=prec,
                      preferred_element_type=cdt)
  logits = logits.reshape(B, N, T, S) * jnp.asarray(args.scale, cdt)
  logits = softcap(logits, args.logits_soft_cap)
  if args.bias is not None:
    logits = logits + args.bias.astype(cdt)
  m = full_mask(args)
  if m is not None:
    # A finite stand-in, not -inf, for masked logits (zeroed after the exp): no intermediate
    # holds an inf unless a row has no key at all, so jax.debug_infs stays quiet.
    logits = jnp.where(m, logits, jnp.finfo(cdt).min)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
  p = jnp.exp(logits - row_max)
  if m is not None:
    p = jnp.where(m, p, 0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  lse = (jnp.log(denom.astype(jnp.float32)) + row_max.astype(jnp.float32))[..., 0]
  p = p / jnp.where(denom == 0, 1, denom)
  if args.has_dropout:
    keep = dropout_keep_mask(
        args.dropout_rng,
        jnp.arange(B, dtype=jnp.int32)[:, None, None, None],
        jnp.arange(N, dtype=jnp.int32)[None, :, None, None],
        jnp.arange(T, dtype=jnp.int32)[None, None, :, None],
        jnp.arange(S, dtype=jnp.int32)[None, None, None, :], args.dropout_rate,
        like=(args.q, args.k, args.v))
    p = jnp.where(keep, p * (1.0 / (1.0 - args.dropout_rate)), 0).astype(p.dtype)
  pg = p.reshape(B, K, G, T, S)
  out = jnp.einsum("bkgts,bskh->btkgh", pg, v.astype(cdt), precision=prec,
                   preferred_element_type=cdt)
  out = out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)
  return out, lse


def reference_vjp(args: AttentionArgs, g_out, g_lse=None):
  """``(dq, dk, dv, dbias)`` of :func:`reference` at ``args`` for cotangents ``(g_out, g_lse)``.

  Plain jnp, so it is differentiable again: the fast backends' backward passes use it as their own
  derivative, which makes second-order reverse mode (grad of grad, Hessian-vector products by
  reverse over reverse) work on them. It materialises the ``[B, N, T, S]`` weights, like MATH.
  """
  def f(q, k, v, bias):
    out, lse = reference(args.replace(q=q, k=k, v=v, bias=bias))
    return out, lse

  (out, lse), vjp = jax.vjp(f, args.q, args.k, args.v, args.bias)
  g_lse = jnp.zeros_like(lse) if g_lse is None else g_lse.astype(lse.dtype)
  return vjp((g_out.astype(out.dtype), g_lse))


def differentiable_backward(fast_backward, args_of):
  """Wraps a backward pass so that it has a derivative (second-order reverse mode).

  ``fast_backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse) -> (dq, dk, dv, dbias)`` is a
  kernel's backward (FFI calls, loops with dynamic bounds: not differentiable itself);
  ``args_of(st, q, k, v, bias, aux) -> AttentionArgs`` rebuilds the call. The wrapper runs the fast
  backward and differentiates as :func:`reference_vjp` (the same function, in plain jnp): the
  derivative w.r.t. ``out`` and ``lse`` is zero because the reference recomputes them from q, k, v.
  """
  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def op(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
    return fast_backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse)

  def op_fwd(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
    return op(st, q, k, v, bias, aux, out, lse, g_out, g_lse), (q, k, v, bias, aux, out, lse,
                                                                 g_out, g_lse)

  def op_bwd(st, res, ct):
    q, k, v, bias, aux, out, lse, g_out, g_lse = res
    args = args_of(st, q, k, v, bias, aux)

    def grads(q, k, v, bias, g_out, g_lse):
      dq, dk, dv, db = reference_vjp(args.replace(q=q, k=k, v=v, bias=bias), g_out, g_lse)
      return dq, dk, dv, (db if bias is not None else None)

    _, vjp = jax.vjp(grads, q, k, v, bias, g_out, g_lse)
    ct = tuple(ct)
    if bias is None:
      ct = ct[:3] + (None,)
    cq, ck, cv, cb, cgo, cgl = vjp(ct)
    zero = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
    return (cq, ck, cv, cb, jax.tree.map(lambda x: None, aux), zero(out), zero(lse), cgo, cgl)

  op.defvjp(op_fwd, op_bwd)
  return op


def unsupported(args: AttentionArgs, platform: str) -> list:
  """The math backend runs everything, everywhere."""
  del args, platform
  return []


def attention(args: AttentionArgs, *, config=None, low_precision: bool = False, **opts):
  """Math backend entry point (same signature as the other backends): :func:`reference`."""
  del config, opts
  return reference(args, low_precision=low_precision)
