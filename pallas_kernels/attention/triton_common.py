"""What every Pallas Triton attention kernel here shares: constants, the static description of a call
(:class:`Spec`: the shared :class:`base.Statics` plus ``allow_tf32``), kernel-body helpers on tiles
(loads and stores with ragged edges, masks from indices, scores, dropout bits, block ranges) and the
constraints every kernel has (:func:`common_unsupported`). The multi-platform lowering of a Triton
``pallas_call`` is `pallas_kernels.gpu.triton_call`.

Used by :mod:`triton_flash`, :mod:`triton_flash_vjp`, :mod:`triton_decode`,
:mod:`triton_mem_efficient` and :mod:`triton_tuning` (the tile configs); imports none of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu
from pallas_kernels.attention import base

Array = Any


#: Lowering platforms the Triton kernels run on.
GPU_PLATFORMS = gpu.GPU_PLATFORMS
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_FLT_MAX = float(jnp.finfo(jnp.float32).max)
_MAX_HEAD_DIM = 256
_KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@functools.lru_cache(maxsize=None)
def local_compute_capability() -> Optional[int]:
    """Compute capability of the GPU being lowered for (e.g. 90): see :func:`pallas_kernels.gpu.compute_capability`."""
    return gpu.compute_capability()


def pad_dim(h: int) -> int:
    return max(16, pl.next_power_of_2(h))


def block(requested: int, length: int) -> int:
    """The block size actually used: ``requested``, shrunk for short sequences (>= 16 for ``dot``)."""
    return min(requested, max(16, pl.next_power_of_2(length)))


# ----------------------------------------------------------------------------------------------
# Static description of a call, shared by the forward, backward and decode kernels.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec(base.Statics):
    """What a Triton kernel body needs: the call's :class:`base.Statics` plus ``allow_tf32``."""

    allow_tf32: bool = False

    @classmethod
    def of(cls, args: base.AttentionArgs, *, allow_tf32: bool = False) -> "Spec":
        """The spec of ``args`` (TF32 applies to float32 inputs only)."""
        return cls(**args.statics().fields(), allow_tf32=bool(allow_tf32 and args.dtype == jnp.float32))

    @property
    def Hp(self) -> int:
        return pad_dim(self.H)

    @property
    def Hvp(self) -> int:
        return pad_dim(self.Hv)

    @property
    def precision(self):
        """The kernels' dot precision: TF32 where allowed, else HIGHEST (Pallas Triton lowers None, i.e.
        DEFAULT, to TF32 for float32 operands: not what ``allow_tf32=False`` promises). Half-precision
        operands multiply as they are either way."""
        return lax.Precision.HIGH if self.allow_tf32 else lax.Precision.HIGHEST

    @property
    def dropout_threshold(self) -> int:
        return base.dropout_threshold(self.dropout_rate)


def dropout_seed_words(args: base.AttentionArgs):
    """``uint32[4]`` :func:`base.dropout_words` for the in-kernel keep-mask (None without dropout)."""
    if not args.has_dropout:
        return None
    return base.dropout_words_of(args)


def call_operands(args: base.AttentionArgs) -> tuple:
    """The operands the flash forward and backward kernels take first, in their order (absent ones
    ``None``): dropout seed words, query / key lengths, query / key segment ids, q, k, v, bias, mask."""
    return (
        dropout_seed_words(args),
        args.q_seq_lengths,
        args.kv_seq_lengths,
        args.q_segment_ids,
        args.kv_segment_ids,
        args.q,
        args.k,
        args.v,
        args.bias,
        args.mask,
    )


# ----------------------------------------------------------------------------------------------
# Kernel-body helpers (plain jnp on tiles; shared with triton_flash_vjp / triton_mem_efficient / triton_decode).
# ----------------------------------------------------------------------------------------------


def load_scalar(ref):
    """A scalar from a 0-d ref (``None`` when the ref is absent)."""
    return None if ref is None else ref[...]


def _at(ref, head, *idx):
    return ref.at[idx] if head is None else ref.at[(head, *idx)]


def load_rows(ref, start, size: int, limit: int, *, other, head=None):
    """``ref[start:start+size]`` of a 1-D ref (``ref[head, ...]`` of a 2-D one), masked past ``limit``."""
    idx = start + jnp.arange(size, dtype=jnp.int32)
    return plgpu.load(_at(ref, head, pl.ds(start, size)), mask=idx < limit, other=other)


def _tile_index(ref, start, size, head):
    """``ref[start:start+size, :]`` of ``[L, dim]``, or ``ref[start:start+size, head, :]`` of ``[L, G, dim]``."""
    if head is None:
        return ref.at[pl.ds(start, size), :]
    return ref.at[pl.ds(start, size), head, :]


def _tile_mask(start, size: int, limit: int, dim: int, dim_p: int, ragged: bool):
    """The ``[size, dim_p]`` in-bounds mask of a tile at rows ``start`` (rows < ``limit`` when ``ragged``,
    columns < ``dim``); None when every element is in bounds."""
    mask = None
    if ragged:
        mask = (start + jnp.arange(size, dtype=jnp.int32) < limit)[:, None]
    if dim != dim_p:
        cm = (jnp.arange(dim_p, dtype=jnp.int32) < dim)[None, :]
        mask = cm if mask is None else mask & cm
    if mask is not None and mask.shape != (size, dim_p):
        mask = jnp.broadcast_to(mask, (size, dim_p))
    return mask


def load_tile(ref, start, size: int, limit: int, dim: int, dim_p: int, *, ragged: bool, head=None):
    """A ``[size, dim_p]`` tile of a ``[L, dim]`` ref at rows ``start``: zero past ``limit`` / ``dim``."""
    mask = _tile_mask(start, size, limit, dim, dim_p, ragged)
    ref = _tile_index(ref, start, size, head)
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0)


def store_tile(ref, value, start, size: int, limit: int, dim: int, *, ragged: bool, head=None):
    """Stores ``value [size, dim_p]`` to a ``[L, dim]`` ref at rows ``start``, masked like :func:`load_tile`."""
    mask = _tile_mask(start, size, limit, dim, value.shape[1], ragged)
    ref = _tile_index(ref, start, size, head)
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def load_bias_like(
    ref, shape4, spec: Spec, q_start, block_q: int, k_start, block_k: int, *, other, head=None
):
    """A bias / mask tile for rows ``[q_start, +block_q)`` x keys ``[k_start, +block_k)``.

    ``ref`` is the ``[T_b, S_b]`` view (``T_b``/``S_b`` either full or 1: broadcast dims are read once
    and broadcast on chip). Returns ``[block_q or 1, block_k or 1]``.
    """
    _, _, tb, sb = shape4
    rq = block_q if tb != 1 else 1
    rk = block_k if sb != 1 else 1
    r0 = q_start if tb != 1 else 0
    c0 = k_start if sb != 1 else 0
    rows = r0 + jnp.arange(rq, dtype=jnp.int32)
    cols = c0 + jnp.arange(rk, dtype=jnp.int32)
    mask = (rows < tb)[:, None] & (cols < sb)[None, :]
    return plgpu.load(_at(ref, head, pl.ds(r0, rq), pl.ds(c0, rk)), mask=mask, other=other)


def logits_mask(
    spec: Spec,
    rows,
    cols,
    *,
    q_len=None,
    kv_len=None,
    q_seg=None,
    kv_seg=None,
    mask_tile=None,
    force_bounds: bool = False,
    key_bounds: bool = True,
):
    """The "attend" mask of a ``[bq, bk]`` tile (None when nothing masks).

    ``rows [bq, 1]`` / ``cols [1, bk]`` are global indices. Keys ``>= S`` are always masked when the
    tile can reach past ``S``; queries ``>= T`` too when ``force_bounds`` (backward pass).
    """
    m = base.index_mask(
        rows,
        cols,
        causal=spec.causal,
        diag_offset=spec.diag_offset,
        window=spec.window,
        q_len=q_len,
        kv_len=kv_len,
        q_seg=q_seg,
        kv_seg=kv_seg,
    )

    def _and(a, b):
        return b if a is None else a & b

    if key_bounds:
        m = _and(m, cols < spec.S)
    if force_bounds:
        m = _and(m, rows < spec.T)
    if mask_tile is not None:
        m = _and(m, mask_tile)
    return m


def scores(spec: Spec, q, k, rows, cols, *, bias_tile=None, mask=None):
    """Scaled, soft-capped, biased and masked logits ``[bq, bk]`` (float32) and ``tanh`` (softcap).

    Returns ``(s, t)`` with ``t = tanh(x / cap)`` (None without softcap) for the backward chain rule.
    """
    del rows, cols
    s = plgpu.dot(q, k, trans_b=True, precision=spec.precision) * spec.scale
    t = None
    if spec.softcap is not None:
        t = jnp.tanh(s * (1.0 / spec.softcap))
        s = spec.softcap * t
    if bias_tile is not None:
        s = s + bias_tile.astype(jnp.float32)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s, t


def base2(x):
    """``x * log2(e)``, kept finite where ``x`` is: a ``finfo.min`` bias (the usual additive padding
    mask) would otherwise become ``-inf``, and a row of it would look fully masked where jax.nn gives
    the mean of V. ``-inf`` stays ``-inf`` and NaN stays NaN."""
    return jnp.maximum(jnp.minimum(x, -_FLT_MAX), x * LOG2E)


def dropout_keep(spec: Spec, seed_ref, b, n, rows, cols):
    """Keep bits of a ``[bq, bk]`` tile: :func:`base.dropout_keep_from_words` (``seed_ref`` holds the
    four words: seed, batch and head offsets) on the call's indices."""
    return base.dropout_keep_from_words(seed_ref, b, n, rows, cols, spec.dropout_threshold)


def key_block_range(spec: Spec, q_start, q_stop, block_k: int, *, q_len=None, kv_len=None):
    """Key blocks ``[lo, hi)`` that query rows ``[q_start, q_stop)`` may attend to (block skipping)."""
    lo, hi = base.key_range(
        q_start, q_stop, spec.S, causal=spec.causal, diag_offset=spec.diag_offset, window=spec.window
    )
    if kv_len is not None:
        hi = jnp.minimum(hi, kv_len)
    if q_len is not None:
        hi = jnp.where(q_start >= q_len, 0, hi)
    return block_range(lo, hi, block_k)


def query_block_range(spec: Spec, k_start, k_stop, block_q: int, *, q_len=None, kv_len=None):
    """Query blocks ``[lo, hi)`` whose rows may attend to keys ``[k_start, k_stop)``."""
    lo, hi = base.query_range(
        k_start, k_stop, spec.T, causal=spec.causal, diag_offset=spec.diag_offset, window=spec.window
    )
    if q_len is not None:
        hi = jnp.minimum(hi, q_len)
    if kv_len is not None:
        hi = jnp.where(k_start >= kv_len, 0, hi)
    return block_range(lo, hi, block_q)


def block_range(lo, hi, block: int):
    """Blocks ``[lo // block, cdiv(hi, block))`` covering ``[lo, hi)``; empty when ``hi <= lo``."""
    first = lo // block
    return first, jnp.where(hi > lo, (hi + block - 1) // block, first)


def common_unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Constraints shared by every Pallas Triton kernel here (forward and backward alike)."""
    reasons = []
    if platform not in GPU_PLATFORMS:
        reasons.append(
            f"Pallas Triton kernels need a CUDA GPU; {platform=} (use interpret=True only for testing)"
        )
    if jnp.dtype(args.dtype) not in _KERNEL_DTYPES:
        reasons.append(f"dtype {args.dtype} is not supported (float16, bfloat16, float32)")
    if args.head_dim > _MAX_HEAD_DIM:
        reasons.append(f"head_dim={args.head_dim} > {_MAX_HEAD_DIM}")
    if args.v_head_dim > _MAX_HEAD_DIM:
        reasons.append(f"value head_dim={args.v_head_dim} > {_MAX_HEAD_DIM}")
    if args.batch > 65535 or args.num_heads > 65535:
        reasons.append(f"batch={args.batch} / heads={args.num_heads} exceed the CUDA grid limit 65535")
    if 0 in (args.batch, args.num_heads, args.q_len, args.kv_len, args.head_dim, args.v_head_dim):
        reasons.append(
            f"an empty dimension (batch={args.batch}, heads={args.num_heads}, "
            f"q_len={args.q_len}, kv_len={args.kv_len}, head_dim={args.head_dim}, "
            f"v_head_dim={args.v_head_dim}): the XLA path handles it"
        )
    return reasons


def check_config(config, cls):
    """A ``TypeError`` naming the expected class unless ``config`` is one (or None)."""
    if config is not None and not isinstance(config, cls):
        raise TypeError(
            f"`config` must be a {cls.__module__}.{cls.__qualname__} or None; got {type(config).__name__}"
        )
