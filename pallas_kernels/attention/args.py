"""Attention's canonical arguments: :class:`AttentionArgs` and :func:`make_args`, which checks every
argument (shapes, dtypes, broadcasting, lengths, segment ids, the dropout key) with an error naming it.

The layout and the meaning of each field are described in :mod:`base`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = Any

__all__ = ["AttentionArgs", "Statics", "make_args", "check_prng_key", "SUPPORTED_DTYPES", "float64_reasons"]

SUPPORTED_DTYPES = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.float64),
)


def float64_reasons(args: "AttentionArgs", what: str) -> list:
    """``[reason]`` where ``args`` holds float64 q, k, v for a kernel that computes in float32, ``what``
    (so the dispatcher runs MATH, which keeps float64; a forced backend says why). A float64 bias with
    float32 inputs (``jnp.where(mask, 0.0, -1e9)`` under x64) is not a reason: the output is float32."""
    if jnp.dtype(args.q.dtype) == jnp.dtype(jnp.float64):
        return [f"{what} computes in float32; float64 inputs run on MATH (full precision)"]
    return []


_ARRAY_FIELDS = (
    "q",
    "k",
    "v",
    "bias",
    "mask",
    "q_seq_lengths",
    "kv_seq_lengths",
    "q_segment_ids",
    "kv_segment_ids",
    "dropout_rng",
    "dropout_offsets",
)
_STATIC_FIELDS = ("scale", "causal", "diag_offset", "window", "logits_soft_cap", "dropout_rate")


@dataclasses.dataclass(frozen=True)
class Statics:
    """Everything static about one attention call (hashable): :meth:`AttentionArgs.statics`.

    The one record every kernel reads its shapes and options from. A kernel that needs more static
    values (tile sizes, ``allow_tf32``) subclasses it or keeps them next to it in its own config.

    Attributes:
      B, T, S, N, K, H, Hv: batch, query / key lengths, query / key-value heads, head dims of q / k
        and of v.
      scale, causal, diag_offset, window, softcap, dropout_rate: the options of :class:`AttentionArgs`
        (``softcap`` is its ``logits_soft_cap``).
      has_q_len, has_kv_len, has_segments: which index-mask arrays are present.
      bias_shape, bias_dtype, mask_shape: shapes (and the bias dtype) of the dense inputs; None when
        absent.
      dtype: the dtype name of q, k and v (e.g. ``"bfloat16"``).
    """

    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    scale: float
    causal: bool
    diag_offset: int
    window: Optional[Tuple[int, int]]
    softcap: Optional[float]
    dropout_rate: float
    has_q_len: bool
    has_kv_len: bool
    has_segments: bool
    bias_shape: Optional[Tuple[int, ...]]
    bias_dtype: Optional[str]
    mask_shape: Optional[Tuple[int, ...]]
    dtype: str

    @property
    def G(self) -> int:
        """Query heads per key / value head."""
        return self.N // self.K

    @property
    def structural(self) -> bool:
        """Whether a causal or window mask shapes which blocks are seen."""
        return self.causal or self.window is not None

    @property
    def keep_scale(self) -> float:
        """The factor kept probabilities are scaled by under dropout."""
        return 1.0 / (1.0 - self.dropout_rate)

    def fields(self) -> dict:
        """The record's fields by name: ``Extended(**statics.fields(), extra=...)`` builds a kernel's
        subclass that adds its own static values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Statics)}


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionArgs:
    """Canonical attention arguments (BTNH layout). Build with :func:`make_args`, which validates.

    It is a pytree: arrays are leaves; ``scale``, ``causal``, ``diag_offset``, ``window``,
    ``logits_soft_cap`` and ``dropout_rate`` are static metadata.

    ``dropout_offsets`` is not a user argument (:func:`make_args` leaves it None): the sharded path
    (:mod:`pallas_kernels.attention.sharded`) sets it on each shard's arguments to the global
    ``(batch, query head)`` index of the shard's first batch row and head, an integer ``[2]``, so the
    dropout keep-mask hashes global indices and a sharded call drops what the unsharded one does.
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
    dropout_offsets: Optional[Array] = None

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
        return (
            self.causal
            or self.window is not None
            or self.q_seq_lengths is not None
            or self.kv_seq_lengths is not None
            or self.q_segment_ids is not None
        )

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    def replace(self, **changes) -> "AttentionArgs":
        return dataclasses.replace(self, **changes)

    def statics(self) -> Statics:
        """The static description of this call (shapes, options, which arrays are present).

        Example:
          >>> import jax.numpy as jnp
          >>> from pallas_kernels.attention import base
          >>> x = jnp.ones((2, 8, 4, 16))
          >>> st = base.make_args(x, x[:, :, :2], x[:, :, :2], is_causal=True).statics()
          >>> (st.B, st.T, st.N, st.K, st.G, st.causal, st.dtype)
          (2, 8, 4, 2, 2, True, 'float32')
        """
        bias, mask = self.bias, self.mask
        return Statics(
            B=self.batch,
            T=self.q_len,
            S=self.kv_len,
            N=self.num_heads,
            K=self.num_kv_heads,
            H=self.head_dim,
            Hv=self.v_head_dim,
            scale=self.scale,
            causal=self.causal,
            diag_offset=self.diag_offset,
            window=self.window,
            softcap=self.logits_soft_cap,
            dropout_rate=self.dropout_rate,
            has_q_len=self.q_seq_lengths is not None,
            has_kv_len=self.kv_seq_lengths is not None,
            has_segments=self.q_segment_ids is not None,
            bias_shape=None if bias is None else tuple(bias.shape),
            bias_dtype=None if bias is None else jnp.dtype(bias.dtype).name,
            mask_shape=None if mask is None else tuple(mask.shape),
            dtype=jnp.dtype(self.dtype).name,
        )


jax.tree_util.register_dataclass(
    AttentionArgs, data_fields=list(_ARRAY_FIELDS), meta_fields=list(_STATIC_FIELDS)
)


# ----------------------------------------------------------------------------------------------
# Canonicalisation / validation.
# ----------------------------------------------------------------------------------------------


def _check_broadcastable(name: str, x, target: tuple) -> None:
    if x.ndim != 4:
        raise ValueError(
            f"`{name}` must be rank 4 broadcastable to [B, N, T, S]={target}; "
            f"got {name}.shape={tuple(x.shape)}"
        )
    for d, (a, b) in enumerate(zip(x.shape, target)):
        if a != 1 and a != b:
            raise ValueError(
                f"`{name}` with shape {tuple(x.shape)} is not broadcastable to "
                f"[B, N, T, S]={target} (dimension {d}: {a} vs {b})"
            )


def _check_lengths(name: str, x, batch: int, limit: int):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must be an integer array of shape [B]={batch}; got dtype {x.dtype}")
    if x.shape != (batch,):
        raise ValueError(f"`{name}` must have shape [B]=({batch},); got {name}.shape={tuple(x.shape)}")
    # jax.nn's meaning of a length outside [0, limit] (an ``arange < length`` mask): negative masks
    # every position, past the end masks none. Clamped here, eager and traced alike, so no kernel
    # sees one. A wider integer is clamped before the cast to int32 (without x64, `jnp.asarray` has
    # already wrapped a NumPy int64 past int32, as it does for jax.nn).
    if jnp.iinfo(x.dtype).max > np.iinfo(np.int32).max or jnp.iinfo(x.dtype).min < np.iinfo(np.int32).min:
        x = jnp.clip(x, 0, limit)
    return jnp.clip(x.astype(jnp.int32), 0, limit)


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
            raise TypeError(
                f"`{name}` must be one PRNG key (shape ()); got a key array of shape {tuple(np.shape(rng))}"
            )
        return
    raw_shapes = {(2,), (4,)}  # threefry; rbg / unsafe_rbg
    if dt is not None and jnp.dtype(dt) == jnp.uint32 and tuple(np.shape(rng)) in raw_shapes:
        return
    what = f"{jnp.dtype(dt).name}{list(np.shape(rng))}" if dt is not None else f"{type(rng).__name__} {rng!r}"
    raise TypeError(
        f"`{name}` must be a PRNG key: jax.random.key(seed) (or a legacy "
        f"jax.random.PRNGKey(seed), uint32[2]); got {what}"
    )


def make_args(
    q,
    k,
    v,
    *,
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
    names: Optional[dict] = None,
) -> AttentionArgs:
    """Validates BTNH attention inputs and returns the canonical :class:`AttentionArgs`.

    Raises ``ValueError`` / ``TypeError`` naming the offending argument (``names`` maps this
    function's argument names to a caller's, for its users' errors: ``{"q_seq_lengths":
    "query_seq_lengths"}``). Length values can only be
    range-checked when they are concrete (outside ``jit``). A traced ``scale`` (a learned temperature,
    ``1 / jnp.sqrt(...)`` under ``jit``) is folded into the queries (``q * scale``, in q's dtype; the
    kernels then take scale 1): the same logits, differentiable in ``scale``.

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
            raise TypeError(
                f"`{name}` dtype must be one of "
                f"{[str(d) for d in SUPPORTED_DTYPES]}; got {name}.dtype={x.dtype}"
            )
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
        raise ValueError(
            f"query heads must be a positive multiple of key/value heads (GQA); got "
            f"{N=} query heads, {K=} key/value heads"
        )
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
        if np.shape(scale) != () or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise TypeError(
                f"a traced `scale` must be a float scalar; got {scale.dtype}{list(np.shape(scale))}"
            )
        q = (q * scale).astype(q.dtype)
        scale = 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        if not (hasattr(scale, "shape") and np.shape(scale) == ()):
            raise TypeError(f"`scale` must be a float; got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):  # torch takes any float, 0 and negative ones included
        raise ValueError(f"`scale` must be a finite float; got {scale=}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"`is_causal` must be a bool; got {type(is_causal).__name__} {is_causal!r}")
    # Only key - query distances in [-(T - 1), S - 1] occur, so a diagonal or a window edge past them
    # means what it means at their end: both are clamped to [-T, S] (the window re-expressed around
    # the clamped diagonal), so that the kernels' int32 index arithmetic cannot wrap (a diag_offset of
    # 2**40, a window side of 2**31 - 1).
    # Symbolic sizes (a shape-polymorphic export) cannot be compared: the values stay as given there.
    symbolic = any(jax.export.is_symbolic_dim(d) for d in (T, S, diag_offset))
    given_offset = diag_offset if symbolic else int(diag_offset)
    clamp = (lambda x: x) if symbolic else (lambda x: min(max(x, -T), S))  # noqa: E731
    diag_offset = clamp(given_offset)
    if window is not None:
        if (
            not isinstance(window, (tuple, list))
            or len(window) != 2
            or any(not isinstance(w, (int, np.integer)) or w < 0 for w in window)
        ):
            raise ValueError(f"`window` must be a (left, right) pair of ints >= 0; got {window=}")
        lo = clamp(given_offset - int(window[0]))
        hi = clamp(given_offset + int(window[1]))
        window = (diag_offset - lo, hi - diag_offset)
    name = lambda arg: (names or {}).get(arg, arg)  # noqa: E731
    if q_seq_lengths is not None:
        q_seq_lengths = _check_lengths(name("q_seq_lengths"), q_seq_lengths, B, T)
    if kv_seq_lengths is not None:
        kv_seq_lengths = _check_lengths(name("kv_seq_lengths"), kv_seq_lengths, B, S)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        if q_segment_ids is None:
            q_segment_ids = kv_segment_ids if T == S else None
        else:
            kv_segment_ids = q_segment_ids if T == S else None
        if q_segment_ids is None or kv_segment_ids is None:
            raise ValueError("segment ids: give both `q_segment_ids` and `kv_segment_ids` when T != S")
    if q_segment_ids is not None:
        q_segment_ids = _check_segments(name("q_segment_ids"), q_segment_ids, (B, T))
        kv_segment_ids = _check_segments(name("kv_segment_ids"), kv_segment_ids, (B, S))
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
        q=q,
        k=k,
        v=v,
        bias=bias,
        mask=mask,
        scale=scale,
        causal=bool(is_causal),
        diag_offset=diag_offset,
        window=window,
        q_seq_lengths=q_seq_lengths,
        kv_seq_lengths=kv_seq_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
