"""The blockwise XLA flash engine: FlashAttention-2 forward and backward as ``lax.scan`` /
``lax.fori_loop`` over blocks (the algorithm is described in :mod:`xla_flash`), shared by
:mod:`xla_flash` and :mod:`xla_mem_efficient` (which adds bias / mask tiles). The block layouts,
ranges and per-block logits live in :mod:`xla_blocks`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import partition
from pallas_kernels.attention import base, sharded, xla_blocks as blk

__all__ = ["blockwise_attention", "prepare", "forward", "backward"]


def blockwise_attention(args: base.AttentionArgs, config):
    """Runs the blockwise engine on ``args`` (bias / mask allowed) with the tiles of ``config`` (an
    :class:`xla_flash.Config`)."""
    q = args.q
    B, T, N, _ = q.shape
    if 0 in (B, T, args.k.shape[1], N):
        return jnp.zeros((B, T, N, args.v.shape[3]), q.dtype), jnp.full((B, N, T), -jnp.inf, jnp.float32)

    def fwd(a):
        st, aux = prepare(a, config)
        return forward(st, a.q, a.k, a.v, a.bias, aux)

    def bwd(a, out, lse, g_out, g_lse):
        st, aux = prepare(a, config)
        return backward(st, a.q, a.k, a.v, a.bias, aux, out, lse, g_out, g_lse)

    return sharded.attention_vjp(args, fwd, bwd, name="blockwise flash (XLA)")


def prepare(args: base.AttentionArgs, config):
    """The engine's static record and its data operands, from ``args`` (global or one shard's)."""
    q, k = args.q, args.k
    B, T, N, H = q.shape
    S = k.shape[1]
    bq, bk = min(config.block_q, T), min(config.block_k, S)
    bq_b, bk_b = config.bwd
    bq_b, bk_b = min(bq_b, T), min(bk_b, S)
    st = blk.Blocked(
        **args.statics().fields(),
        bq=max(bq, 1),
        bk=max(bk, 1),
        bq_b=max(bq_b, 1),
        bk_b=max(bk_b, 1),
        cdt=config.compute_dtype,
    )
    aux = dict(
        mask=args.mask,
        q_len=args.q_seq_lengths,
        kv_len=args.kv_seq_lengths,
        q_seg=args.q_segment_ids,
        kv_seg=args.kv_segment_ids,
        seed=None if args.dropout_rng is None else base.dropout_words_of(args),
    )
    return st, aux


# ---- forward -----------------------------------------------------------------------------------


def forward(st, q, k, v, bias, aux):
    """Forward of the engine: ``(out, lse)``; FlashAttention-2 algorithm 1 (see :mod:`xla_flash`)."""
    cdt = jnp.dtype(st.cdt)
    bq, bk = st.bq, st.bk
    qb_all = blk.q_blocks((q.astype(cdt) * jnp.asarray(blk.q_scale(st), cdt)), st, bq)
    m, l, acc = _softmax_rows(
        st,
        qb_all,
        blk.kv_blocks(k.astype(cdt), bk),
        blk.kv_blocks(v.astype(cdt), bk),
        blk.data_blocks(st, bias, aux, bq, bk),
        aux,
        bq,
        bk,
        partition.varying_axes(q, k, v, bias, aux),
    )
    if st.dropout_rate > 0:
        acc = acc * (1.0 / (1.0 - st.dropout_rate))
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(jnp.where(l == 0, 1.0, l))) * blk.LN2)
    out = blk.q_unblock(out, st, bq).astype(st.dtype)
    return out, blk.row_unblock(lse, st, bq)


def _softmax_rows(st, qb_all, kb_all, vb_all, d, aux, bq, bk, axes):
    """The online softmax of every query block over the key blocks it sees: ``(m, l, acc)`` blocked
    ([B, K, nq, G * bq] and [B, K, nq, G * bq, Hv]): the base-2 row max, the row sum of 2^(s - m),
    and P V (dropout applied, unscaled). Without ``vb_all`` (None) only m and l are computed, and
    acc is None."""
    cdt = jnp.dtype(st.cdt)
    # One (batch, kv head, query block) per scan step: the matmuls are plain 2-D GEMMs
    # ([G * bq, H] x [H, bk]), which XLA CPU runs markedly faster than the same work batched.
    B, K, nq, R = st.B, st.K, qb_all.shape[2], st.G * bq
    values = vb_all is not None

    def q_block(_, xs):
        t, qb = xs
        b, kh, i = t // (K * nq), (t // nq) % K, t % nq
        qb = qb[None, None]

        def step(structural):
            def body(j, carry):
                m_prev, l_prev, acc = carry if values else (*carry, None)
                s, _ = blk.block_logits(
                    st,
                    qb,
                    kb_all[b, kh, j][None, None],
                    b,
                    kh,
                    i,
                    j,
                    bq,
                    bk,
                    structural,
                    blk.tile_data(d, b, i, j),
                )
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp2(s - m_use[..., None])
                alpha = jnp.exp2(m_prev - m_use)
                l_new = alpha * l_prev + jnp.sum(p, axis=-1)
                if not values:
                    return m_new, l_new
                if st.dropout_rate > 0:
                    p = jnp.where(blk.dropout_keep(st, aux["seed"], b, kh, i, j, bq, bk), p, 0.0)
                pv = jnp.einsum(
                    "bkrc,bkcv->bkrv",
                    p.astype(cdt),
                    vb_all[b, kh, j][None, None],
                    precision=blk.HIGHEST,
                    preferred_element_type=jnp.float32,
                )
                return m_new, l_new, acc * alpha[..., None] + pv

            return body

        jlo, ulo, uhi, jhi = blk.fwd_ranges(st, i, bq, bk)
        carry = (jnp.full((1, 1, R), -jnp.inf, jnp.float32), jnp.zeros((1, 1, R), jnp.float32))
        if values:
            carry += (jnp.zeros((1, 1, R, st.Hv), jnp.float32),)
        carry = blk.banded_loop(
            jlo, ulo, uhi, jhi, step, partition.vary(carry, axes), st.structural or st.S % bk > 0
        )
        return None, tuple(x[0, 0] for x in carry)

    n = B * K * nq
    _, rows = lax.scan(q_block, None, (jnp.arange(n, dtype=jnp.int32), qb_all.reshape(n, R, st.H)))
    m, l, *acc = (x.reshape(B, K, nq, *x.shape[1:]) for x in rows)
    return m, l, (acc[0] if values else None)


# ---- backward ----------------------------------------------------------------------------------

#: The backward's P = 2^(s - lse2) needs lse2 = m + log2(l) to hold log2(l), and a float holds it only
#: to half an ulp of lse2: P's relative error grows with |lse2| (~1e-5 at 256), and a row of large
#: logits loses l altogether (a padding bias of -1e9: lse2 ~ -1.44e9, whose ulp is 128, so P was 1
#: where it is 1/S and that row's gradients S times too large). Rows with |lse2| >= this (a tolerance
#: choice) have (m, log2(l)) recomputed (:func:`_exact_stats`); the C++ kernel does the same
#: (ExactRowStats).
EXACT_STATS_FROM = 256.0


def _exact_stats(st, lse_all, live, qb_all, kb_all, d, aux, bq, bk, axes):
    """``(ref, lo)``, blocked rows with P = 2^((s - ref) - lo): ``(lse2, 0)``, except rows whose
    |lse2| >= :data:`EXACT_STATS_FROM` and whose cotangent is not 0 (``live``; a loss that ignores
    padded rows never uses their P), which get their exact ``(m, log2(l))``. The recompute (one more
    pass of q k^T, over every row) runs only when such a row exists (``lax.cond``; under ``vmap`` both
    run). The exact pair replaces lse2 only where ``m + log2(l)`` agrees with it to 2^-20 of it: a
    ring's backward passes each key shard the global lse, which the shard's own statistics are not."""
    big = live & jnp.isfinite(lse_all) & (jnp.abs(lse_all) >= EXACT_STATS_FROM)

    def exact():
        m, l, _ = _softmax_rows(st, qb_all, kb_all, None, d, aux, bq, bk, axes)
        use = big & (l > 0) & jnp.isfinite(l)
        lo = jnp.log2(jnp.where(use, l, 1.0))
        use &= jnp.abs(m + lo - lse_all) <= jnp.abs(lse_all) * 2.0**-20
        return partition.vary((jnp.where(use, m, lse_all), jnp.where(use, lo, 0.0)), axes)

    def keep():
        return partition.vary((lse_all, jnp.zeros_like(lse_all)), axes)

    return lax.cond(jnp.any(big), exact, keep)


def backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
    """Backward of the engine: ``(dq, dk, dv, dbias)``; FlashAttention-2 algorithm 2."""
    cdt = jnp.dtype(st.cdt)
    bq, bk = st.bq_b, st.bk_b
    G = st.G
    qb_all = blk.q_blocks((q.astype(cdt) * jnp.asarray(blk.q_scale(st), cdt)), st, bq)
    kb_all = blk.kv_blocks(k.astype(cdt), bk)
    vb_all = blk.kv_blocks(v.astype(cdt), bk)
    do_all = blk.q_blocks(g_out.astype(cdt), st, bq)
    delta = jnp.einsum(
        "btnv,btnv->bnt", g_out.astype(jnp.float32), out.astype(jnp.float32), precision=blk.HIGHEST
    )
    if g_lse is not None:
        delta = delta - g_lse.astype(jnp.float32)
    delta_all = blk.row_blocks(delta, st, bq, 0.0)
    # Rows with lse = -inf (fully masked) and padded rows get +inf so P = exp(s - lse) = 0.
    lse_all = blk.row_blocks(jnp.where(lse == -jnp.inf, jnp.inf, lse * blk.LOG2E), st, bq, jnp.inf)
    d = blk.data_blocks(st, bias, aux, bq, bk)
    B, K, nk = st.B, st.K, kb_all.shape[2]
    axes = partition.varying_axes(q, k, v, bias, aux, out, lse, g_out, g_lse)
    live = jnp.any(g_out != 0, axis=-1).transpose(0, 2, 1) | (delta != 0)  # rows whose P is used
    live = blk.row_blocks(live, st, bq, False)
    lse_all, lo_all = _exact_stats(st, lse_all, live, qb_all, kb_all, d, aux, bq, bk, axes)
    dq0 = partition.vary(jnp.zeros(qb_all.shape, jnp.float32), axes)
    db0 = None if d["bias"] is None else partition.vary(jnp.zeros(d["bias"].shape, jnp.float32), axes)

    def k_block(carry, xs):
        dq_all, db_all = carry
        u, kb, vb = xs
        b, kh, j = u // (K * nk), (u // nk) % K, u % nk
        kb, vb = kb[None, None], vb[None, None]

        def step(structural):
            def body(i, c):
                dk, dv, dq_all, db_all = c
                qb, dob = qb_all[b, kh, i][None, None], do_all[b, kh, i][None, None]
                td = blk.tile_data(d, b, i, j)
                s, t = blk.block_logits(st, qb, kb, b, kh, i, j, bq, bk, structural, td)
                p = jnp.exp2(
                    (s - lse_all[b, kh, i][None, None, :, None]) - lo_all[b, kh, i][None, None, :, None]
                )
                dp = jnp.einsum(
                    "bkrv,bkcv->bkrc", dob, vb, precision=blk.HIGHEST, preferred_element_type=jnp.float32
                )
                if st.dropout_rate > 0:
                    keep = blk.dropout_keep(st, aux["seed"], b, kh, i, j, bq, bk)
                    inv = 1.0 / (1.0 - st.dropout_rate)
                    pd = jnp.where(keep, p * inv, 0.0)
                    dp = jnp.where(keep, dp * inv, 0.0)
                else:
                    pd = p
                # dV^T and dK^T are accumulated transposed: XLA CPU runs X^T P ~4x faster than P^T X.
                dv = dv + jnp.einsum(
                    "bkrv,bkrc->bkvc",
                    dob,
                    pd.astype(cdt),
                    precision=blk.HIGHEST,
                    preferred_element_type=jnp.float32,
                )
                ds = p * (dp - delta_all[b, kh, i][None, None, :, None])
                if db_all is not None:
                    bs = d["bias"].shape
                    tile = blk.reduce_to(
                        ds.reshape(1, 1, G, bq, bk),
                        (1, 1, bs[2], 1 if bs[3] == 1 else bq, 1 if bs[4] == 1 else bk),
                    )
                    db_all = blk.dense_untile_add(db_all, tile, b, kh, i, j, bq, bk)
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds.astype(cdt)
                dk = dk + jnp.einsum(
                    "bkrh,bkrc->bkhc", qb, ds, precision=blk.HIGHEST, preferred_element_type=jnp.float32
                )
                dq_i = jnp.einsum(
                    "bkrc,bkch->bkrh", ds, kb, precision=blk.HIGHEST, preferred_element_type=jnp.float32
                )
                dq_all = dq_all.at[b, kh, i].add(dq_i[0, 0])
                return dk, dv, dq_all, db_all

            return body

        ilo, ulo, uhi, ihi = blk.bwd_ranges(st, j, bq, bk)
        c = (
            *partition.vary(
                (jnp.zeros((1, 1, st.H, bk), jnp.float32), jnp.zeros((1, 1, st.Hv, bk), jnp.float32)), axes
            ),
            dq_all,
            db_all,
        )
        c = blk.banded_loop(ilo, ulo, uhi, ihi, step, c, st.structural or st.S % bk > 0)
        dk, dv, dq_all, db_all = c
        dk, dv = dk[0, 0].T, dv[0, 0].T
        if st.softcap is None:  # qb carries a log2(e) factor that the logits gradient must not.
            dk = dk * blk.LN2
        return (dq_all, db_all), (dk, dv)

    n = B * K * nk
    (dq_all, db_all), (dk_all, dv_all) = lax.scan(
        k_block,
        (dq0, db0),
        (jnp.arange(n, dtype=jnp.int32), kb_all.reshape(n, bk, st.H), vb_all.reshape(n, bk, st.Hv)),
    )
    dq = (blk.q_unblock(dq_all, st, bq) * st.scale).astype(q.dtype)
    dk = blk.kv_unblock(dk_all.reshape(B, K, nk, bk, st.H), st.S).astype(k.dtype)
    dv = blk.kv_unblock(dv_all.reshape(B, K, nk, bk, st.Hv), st.S).astype(v.dtype)
    dbias = None
    if bias is not None:
        Bb, Nb, Tb, Sb = bias.shape
        dbias = db_all[:, :, :, :Tb, :Sb].reshape(Bb, Nb, Tb, Sb).astype(bias.dtype)
    return dq, dk, dv, dbias
