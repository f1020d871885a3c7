"""Block helpers of the blockwise XLA flash engine (:mod:`xla_blockwise`): the engine's static record
(:class:`Blocked`), the blocked layouts of q / k / v / rows and of broadcastable bias / mask tensors,
the block ranges that causal / window structure lets a block see, the per-block logits (soft cap,
bias, masks from indices) and dropout bits.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention import base

HIGHEST = lax.Precision.HIGHEST
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class Blocked(base.Statics):
    """The engine's static record: the call's :class:`base.Statics` plus the tiles of the forward
    (``bq`` x ``bk``) and backward (``bq_b`` x ``bk_b``), shrunk to the sequences, and the compute
    dtype name ``cdt``."""

    bq: int = 1
    bk: int = 1
    bq_b: int = 1
    bk_b: int = 1
    cdt: str = "float32"


# ---- layouts ---------------------------------------------------------------------------------


def cdiv(a, b):
    return -(-a // b)


def pad_axis(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)


def q_blocks(x, st, bq):
    """[B, T, N, D] -> [B, K, nq, G * bq, D] (the G heads of a group stacked on the rows)."""
    B, T, N, D = x.shape
    nq = cdiv(T, bq)
    x = pad_axis(x, 1, nq * bq)
    x = x.reshape(B, nq, bq, st.K, st.G, D).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(B, st.K, nq, st.G * bq, D)


def q_unblock(xb, st, bq):
    B, K, nq, _, D = xb.shape
    x = xb.reshape(B, K, nq, st.G, bq, D).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(B, nq * bq, st.N, D)[:, : st.T]


def row_blocks(x, st, bq, value):
    """[B, N, T] -> [B, K, nq, G * bq]."""
    B, N, T = x.shape
    nq = cdiv(T, bq)
    x = pad_axis(x, 2, nq * bq, value)
    x = x.reshape(B, st.K, st.G, nq, bq).transpose(0, 1, 3, 2, 4)
    return x.reshape(B, st.K, nq, st.G * bq)


def row_unblock(xb, st, bq):
    B, K, nq, _ = xb.shape
    x = xb.reshape(B, K, nq, st.G, bq).transpose(0, 1, 3, 2, 4)
    return x.reshape(B, st.N, nq * bq)[:, :, : st.T]


def kv_blocks(x, bk):
    """[B, S, K, D] -> [B, K, nk, bk, D]."""
    B, S, K, D = x.shape
    nk = cdiv(S, bk)
    x = pad_axis(x, 1, nk * bk)
    return x.reshape(B, nk, bk, K, D).transpose(0, 3, 1, 2, 4)


def kv_unblock(xb, S):
    B, K, nk, bk, D = xb.shape
    return xb.transpose(0, 2, 3, 1, 4).reshape(B, nk * bk, K, D)[:, :S]


def dense_prep(x, st, Tp, Sp, value):
    """[Bb, Nb, Tb, Sb] (broadcastable) -> [Bb, Kb, Gb, Tb', Sb'] padded to (Tp, Sp) where not 1."""
    Bb, Nb, Tb, Sb = x.shape
    x = x.reshape(Bb, st.K, st.G, Tb, Sb) if Nb == st.N and Nb > 1 else x.reshape(Bb, 1, 1, Tb, Sb)
    if Tb > 1:
        x = pad_axis(x, 3, Tp, value)
    if Sb > 1:
        x = pad_axis(x, 4, Sp, value)
    return x


def base2_bias(bias):
    """``bias * log2(e)`` in float32, finite where ``bias`` is: a bias below ``-finfo.max / log2(e)``
    (``finfo(float32).min``, the usual additive padding mask) would otherwise become ``-inf``, and a
    row of it would look fully masked (NaN, or 0) where jax.nn / torch give the mean of V."""
    b = bias.astype(jnp.float32)
    big = float(jnp.finfo(jnp.float32).max)
    return jnp.where(jnp.isfinite(b), jnp.clip(b * LOG2E, -big, big), b * LOG2E)


def _tile_starts(shape, b, kh, i, j, bq, bk):
    # int32 throughout (below): under jax_enable_x64 a Python 0 would become int64 next to the int32
    # indices (dynamic_slice wants one index type).
    starts = [0] * 5
    sizes = [1, 1, shape[2], 1, 1]
    if shape[0] > 1:
        starts[0] = b
    if shape[1] > 1:
        starts[1] = kh
    if shape[3] > 1:
        starts[3], sizes[3] = i * bq, bq
    if shape[4] > 1:
        starts[4], sizes[4] = j * bk, bk
    return [jnp.asarray(x, jnp.int32) for x in starts], sizes


def dense_tile(xp, b, kh, i, j, bq, bk):
    """The [1, 1, Gb, bq|1, bk|1] tile of a prepared bias / mask for head (b, kh), block (i, j)."""
    starts, sizes = _tile_starts(xp.shape, b, kh, i, j, bq, bk)
    return lax.dynamic_slice(xp, starts, sizes)


def dense_untile_add(acc, tile, b, kh, i, j, bq, bk):
    starts, _ = _tile_starts(acc.shape, b, kh, i, j, bq, bk)
    cur = lax.dynamic_slice(acc, starts, tile.shape)
    return lax.dynamic_update_slice(acc, cur + tile, starts)


def reduce_to(x5, shape5):
    """Sums a [B, K, G, bq, bk] tile over the axes where ``shape5`` is 1."""
    axes = tuple(d for d, (a, b) in enumerate(zip(x5.shape, shape5)) if b == 1 and a != 1)
    return jnp.sum(x5, axis=axes, keepdims=True) if axes else x5


# ---- block ranges (structure only: causal / window / key padding) ------------------------------


def fwd_ranges(st, i, bq, bk):
    """Key blocks ``[jlo, jhi)`` seen by query block ``i``, and the all-visible sub-range [ulo, uhi)."""
    nk = cdiv(st.S, bk)
    off = st.diag_offset
    qs = i * bq
    qe = jnp.minimum(qs + bq, st.T)
    lo, hi = base.key_range(qs, qe, st.S, causal=st.causal, diag_offset=off, window=st.window)
    jlo = lo // bk
    jhi = jnp.maximum((hi + bk - 1) // bk, jlo)
    jhi = jnp.where(hi > lo, jhi, jlo)
    uhi = jnp.asarray(nk if st.S % bk == 0 else nk - 1, jnp.int32)
    ulo = jnp.asarray(0, jnp.int32)
    if st.causal:
        uhi = jnp.minimum(uhi, (qs + off + 1) // bk)
    if st.window is not None:
        left, right = st.window
        ulo = jnp.maximum(ulo, -((-(qe - 1 + off - left)) // bk))
        uhi = jnp.minimum(uhi, (qs + off + right + 1) // bk)
    ulo = jnp.clip(ulo, jlo, jhi)
    uhi = jnp.clip(uhi, ulo, jhi)
    return jlo, ulo, uhi, jhi


def bwd_ranges(st, j, bq, bk):
    """Query blocks ``[ilo, ihi)`` that see key block ``j``, and the all-visible sub-range."""
    nq = cdiv(st.T, bq)
    off = st.diag_offset
    ks = j * bk
    ke = jnp.minimum(ks + bk, st.S)
    lo, hi = base.query_range(ks, ke, st.T, causal=st.causal, diag_offset=off, window=st.window)
    hi = jnp.clip(hi, lo, st.T)
    ilo = lo // bq
    ihi = jnp.where(hi > lo, (hi + bq - 1) // bq, ilo)
    padded_key_block = (ke - ks) < bk
    ulo = jnp.asarray(0, jnp.int32)
    uhi = jnp.asarray(nq, jnp.int32)
    if st.causal:
        ulo = jnp.maximum(ulo, -((-(ke - 1 - off)) // bq))
    if st.window is not None:
        left, right = st.window
        uhi = jnp.minimum(uhi, (ks - off + left - bq + 1) // bq + 1)
        ulo = jnp.maximum(ulo, -((-(ke - 1 - off - right)) // bq))
    ulo = jnp.where(padded_key_block, ihi, ulo)
    ulo = jnp.clip(ulo, ilo, ihi)
    uhi = jnp.clip(uhi, ulo, ihi)
    return ilo, ulo, uhi, ihi


def banded_loop(lo, ulo, uhi, hi, step, carry, masked_edges: bool):
    """Runs ``step(masked)`` over blocks ``[lo, hi)``; blocks in ``[ulo, uhi)`` need no structural mask."""
    if not masked_edges:
        return lax.fori_loop(lo, hi, step(False), carry)
    carry = lax.fori_loop(lo, ulo, step(True), carry)
    carry = lax.fori_loop(ulo, uhi, step(False), carry)
    return lax.fori_loop(uhi, hi, step(True), carry)


# ---- per-block logits ------------------------------------------------------------------------


def block_logits(st, qb, kb, b, kh, i, j, bq, bk, structural, data):
    """Scores of one tile of head group (b, kh) in base-2 units (``log2(e) * logits``), [1, 1, G*bq, bk].

    Soft cap, bias and masks applied. ``qb`` is pre-scaled by :func:`q_scale`. Returns ``(s, t)``
    where ``t`` is ``tanh`` of the soft cap (None without one). Base 2 because ``exp2`` is markedly
    cheaper than ``exp`` on XLA CPU and the softmax is invariant to it (FlashAttention does the same).
    """
    B, K, R, _ = qb.shape
    G = st.G
    s = jnp.einsum("bkrh,bkch->bkrc", qb, kb, precision=HIGHEST, preferred_element_type=jnp.float32)
    t = None
    if st.softcap is not None:
        t = jnp.tanh(s * (1.0 / st.softcap))
        s = (st.softcap * LOG2E) * t
    s5 = s.reshape(B, K, G, bq, bk)
    if data.get("bias") is not None:
        s5 = s5 + base2_bias(dense_tile(data["bias"], b, kh, i, j, bq, bk))
    rows = (i * bq + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
    cols = (j * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
    m = None
    if structural:
        m = base.index_mask(rows, cols, causal=st.causal, diag_offset=st.diag_offset, window=st.window)
        if st.S % bk:
            m = cols < st.S if m is None else m & (cols < st.S)
    extra = base.index_mask(
        rows,
        cols,
        q_len=None if data.get("q_len") is None else data["q_len"].reshape(-1, 1, 1, 1, 1),
        kv_len=None if data.get("kv_len") is None else data["kv_len"].reshape(-1, 1, 1, 1, 1),
        q_seg=None if data.get("q_seg") is None else data["q_seg"].reshape(-1, 1, 1, bq, 1),
        kv_seg=None if data.get("kv_seg") is None else data["kv_seg"].reshape(-1, 1, 1, 1, bk),
    )
    if extra is not None:
        m = extra if m is None else m & extra
    if data.get("mask") is not None:
        mt = dense_tile(data["mask"], b, kh, i, j, bq, bk)
        m = mt if m is None else m & mt
    if m is not None:
        s5 = jnp.where(m, s5, -jnp.inf)
    return s5.reshape(B, K, R, bk), t


def q_scale(st):
    """Factor folded into q: ``scale * log2(e)`` (base-2 logits), or ``scale`` under a soft cap."""
    return st.scale if st.softcap is not None else st.scale * LOG2E


def dropout_keep(st, seed, b, kh, i, j, bq, bk):
    G = st.G
    n = (kh * G + jnp.arange(G, dtype=jnp.int32)).reshape(1, 1, G, 1, 1)
    rows = (i * bq + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
    cols = (j * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
    keep = base.dropout_keep_from_words(
        seed,
        jnp.reshape(b, (1, 1, 1, 1, 1)),
        n,
        rows,
        cols,
        base.dropout_threshold(st.dropout_rate),
    )
    return keep.reshape(1, 1, G * bq, bk)


def data_blocks(st, bias, aux, bq, bk):
    """Per-call data masks in block-friendly layouts (lengths stay [B], segment ids blocked)."""
    Tp, Sp = cdiv(st.T, bq) * bq, cdiv(st.S, bk) * bk
    d = dict(q_len=aux["q_len"], kv_len=aux["kv_len"])
    d["bias"] = None if bias is None else dense_prep(bias, st, Tp, Sp, 0)
    d["mask"] = None if aux["mask"] is None else dense_prep(aux["mask"], st, Tp, Sp, False)
    if aux["q_seg"] is not None:
        d["q_seg_all"] = pad_axis(aux["q_seg"], 1, Tp, -1).reshape(st.B, -1, bq).transpose(1, 0, 2)
        d["kv_seg_all"] = pad_axis(aux["kv_seg"], 1, Sp, -2).reshape(st.B, -1, bk).transpose(1, 0, 2)
    return d


def tile_data(d, b, i, j):
    out = dict(
        bias=d["bias"],
        mask=d["mask"],
        q_len=None if d["q_len"] is None else d["q_len"][b],
        kv_len=None if d["kv_len"] is None else d["kv_len"][b],
    )
    if "q_seg_all" in d:
        out["q_seg"] = d["q_seg_all"][i, b]
        out["kv_seg"] = d["kv_seg_all"][j, b]
    return out
