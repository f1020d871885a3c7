"""Fused backward of the Pallas flash / memory-efficient kernels: dq, dk, dv (and dbias) in one launch.

FlashAttention-2 backward (Dao, 2023, algorithm 2): the forward saved only ``out`` and the
natural-log ``lse``; the probabilities are recomputed tile by tile as ``P = exp(S - lse)``, and with
``delta = rowsum(dO * O)`` (minus the cotangent of ``lse``, whose derivative is ``P`` itself)

    dP = dO V^T (masked by the dropout keep bits, times 1/(1-p)),   dS = P * (dP - delta),
    dV = P_dropped^T dO,   dK = scale * dX^T Q,   dQ = scale * dX K,   dbias = dS,

where ``dX = dS * (1 - tanh^2)`` under a logits soft cap (``dX = dS`` without one).

One ``pallas_call`` with grid ``(max(#q blocks, #k blocks), kv heads, batch)``; program ``p`` runs
two phases (like the Triton fused-attention tutorial and Pallas ``ops/gpu/attention.py``):

1. dK / dV of key block ``p`` for key/value head ``h``: loops over the ``G`` query heads of that
   group (GQA: the group sum happens on chip, no atomics, deterministic) and over the query blocks
   that can see the key block (causal / window / length skipping).
2. dQ of query block ``p`` for those ``G`` query heads, looping over the visible key blocks; also
   writes the bias gradient tiles (or their row / column sums when the bias broadcasts).

The same :func:`unsupported` constraints as the forward hold, so a backend chosen for the forward
never fails at grad time.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu, triton_backend
from pallas_kernels.attention import base, sharded, triton_common as common
from pallas_kernels.attention.triton_tuning import BackwardConfig as Config
from pallas_kernels.attention.triton_tuning import backward_heuristics as heuristics

Array = Any

__all__ = ["Config", "heuristics", "backward", "differentiable"]

_LOG2E = common.LOG2E


def _dbias_mode(bias_shape, T: int, S: int) -> Optional[str]:
    """How the bias gradient is produced: full tiles, column sums, or row sums."""
    if bias_shape is None:
        return None
    _, _, tb, sb = bias_shape
    if sb == 1:
        return "rows"  # [B, N, T, 1] row sums (summed over T afterwards when tb == 1)
    if tb == 1:
        return "cols"  # [B, N, #q blocks, S] column sums per query block
    return "full"  # [B, N, T, S]


def _bwd_kernel(
    seed_ref,
    qlen_ref,
    kvlen_ref,
    qseg_ref,
    kvseg_ref,
    q_ref,
    k_ref,
    v_ref,
    bias_ref,
    mask_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dbias_in_ref,
    dq_ref,
    dk_ref,
    dv_ref,
    dbias_ref,
    *,
    spec: common.Spec,
    block_q: int,
    block_k: int,
    nq: int,
    nk: int,
    dbias_mode: Optional[str],
):
    del dbias_in_ref  # aliased to dbias_ref (zero-initialised: skipped tiles stay 0)
    pid, kh, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G, T, S = spec.G, spec.T, spec.S
    ragged_q = T % block_q != 0
    ragged_k = S % block_k != 0
    q_len = common.load_scalar(qlen_ref)
    kv_len = common.load_scalar(kvlen_ref)
    bias_head = (lambda g: g) if spec.bias_shape is not None and spec.bias_shape[1] != 1 else (lambda g: None)
    mask_head = (lambda g: g) if spec.mask_shape is not None and spec.mask_shape[1] != 1 else (lambda g: None)

    def tile_grads(g, q_start, k_start, q, k, v, do, lse, delta, q_seg, kv_seg):
        """Recomputes one ``[block_q, block_k]`` tile; returns (P_dropped, dS, dX)."""
        rows = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]
        cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
        bias_tile = mask_tile = None
        if bias_ref is not None:
            bias_tile = common.load_bias_like(
                bias_ref,
                spec.bias_shape,
                spec,
                q_start,
                block_q,
                k_start,
                block_k,
                other=0,
                head=bias_head(g),
            )
        if mask_ref is not None:
            mask_tile = common.load_bias_like(
                mask_ref,
                spec.mask_shape,
                spec,
                q_start,
                block_q,
                k_start,
                block_k,
                other=False,
                head=mask_head(g),
            )
        mask = common.logits_mask(
            spec,
            rows,
            cols,
            q_len=q_len,
            kv_len=kv_len,
            q_seg=q_seg,
            kv_seg=kv_seg,
            mask_tile=mask_tile,
            force_bounds=ragged_q,
        )
        s, t = common.scores(spec, q, k, rows, cols, bias_tile=bias_tile, mask=mask)
        if bias_tile is None:
            p = jnp.exp2((s - lse[:, None]) * _LOG2E)
        else:  # in the forward's base 2, kept finite (common.base2: finfo.min padding biases)
            p = jnp.exp2(common.base2(s) - common.base2(lse)[:, None])
        dp = plgpu.dot(do, v, trans_b=True, precision=spec.precision)
        if spec.dropout_rate > 0:
            keep = common.dropout_keep(spec, seed_ref, b, kh * G + g, rows, cols)
            p_drop = jnp.where(keep, p * spec.keep_scale, 0.0)
            dp = jnp.where(keep, dp * spec.keep_scale, 0.0)
        else:
            p_drop = p
        ds = p * (dp - delta[:, None])
        dx = ds if t is None else ds * (1.0 - t * t)
        return p_drop, ds, dx

    def load_q_side(g, q_start):
        q = common.load_tile(q_ref, q_start, block_q, T, spec.H, spec.Hp, ragged=ragged_q, head=g)
        do = common.load_tile(do_ref, q_start, block_q, T, spec.Hv, spec.Hvp, ragged=ragged_q, head=g)
        lse = common.load_rows(lse_ref, q_start, block_q, T, other=0.0, head=g)
        delta = common.load_rows(delta_ref, q_start, block_q, T, other=0.0, head=g)
        q_seg = None
        if qseg_ref is not None:
            q_seg = common.load_rows(qseg_ref, q_start, block_q, T, other=-1)[:, None]
        return q, do, lse, delta, q_seg

    def load_k_side(k_start):
        k = common.load_tile(k_ref, k_start, block_k, S, spec.H, spec.Hp, ragged=ragged_k)
        v = common.load_tile(v_ref, k_start, block_k, S, spec.Hv, spec.Hvp, ragged=ragged_k)
        kv_seg = None
        if kvseg_ref is not None:
            kv_seg = common.load_rows(kvseg_ref, k_start, block_k, S, other=-2)[None, :]
        return k, v, kv_seg

    # Phase 1: dK, dV of key block `pid` (summed over the G query heads of this kv head).
    def dkdv_phase():
        k_start = pid * block_k
        k, v, kv_seg = load_k_side(k_start)
        qlo, qhi = common.query_block_range(
            spec, k_start, k_start + block_k, block_q, q_len=q_len, kv_len=kv_len
        )

        def per_head(g, carry):
            def per_qblock(qb, carry):
                dk, dv = carry
                q_start = qb * block_q
                q, do, lse, delta, q_seg = load_q_side(g, q_start)
                p_drop, _, dx = tile_grads(g, q_start, k_start, q, k, v, do, lse, delta, q_seg, kv_seg)
                dv = dv + plgpu.dot(p_drop.astype(do.dtype), do, trans_a=True, precision=spec.precision)
                dk = dk + plgpu.dot(dx.astype(q.dtype), q, trans_a=True, precision=spec.precision)
                return dk, dv

            return lax.fori_loop(qlo, qhi, per_qblock, carry)

        dk = jnp.zeros((block_k, spec.Hp), jnp.float32)
        dv = jnp.zeros((block_k, spec.Hvp), jnp.float32)
        dk, dv = lax.fori_loop(0, G, per_head, (dk, dv))
        common.store_tile(dk_ref, dk * spec.scale, 0, block_k, S - k_start, spec.H, ragged=ragged_k)
        common.store_tile(dv_ref, dv, 0, block_k, S - k_start, spec.Hv, ragged=ragged_k)

    # Phase 2: dQ of query block `pid` for each of the G query heads (and the bias gradient).
    def dq_phase():
        q_start = pid * block_q
        rows1 = q_start + jnp.arange(block_q, dtype=jnp.int32)
        klo, khi = common.key_block_range(
            spec, q_start, q_start + block_q, block_k, q_len=q_len, kv_len=kv_len
        )

        def per_head(g, carry):
            q, do, lse, delta, q_seg = load_q_side(g, q_start)

            def per_kblock(kb, carry):
                dq, rowsum = carry
                k_start = kb * block_k
                k, v, kv_seg = load_k_side(k_start)
                _, ds, dx = tile_grads(g, q_start, k_start, q, k, v, do, lse, delta, q_seg, kv_seg)
                dq = dq + plgpu.dot(dx.astype(k.dtype), k, precision=spec.precision)
                if dbias_mode == "full":
                    cols1 = k_start + jnp.arange(block_k, dtype=jnp.int32)
                    plgpu.store(
                        dbias_ref.at[g, pl.ds(0, block_q), pl.ds(k_start, block_k)],
                        ds.astype(dbias_ref.dtype),
                        mask=(rows1 < T)[:, None] & (cols1 < S)[None, :],
                    )
                elif dbias_mode == "cols":
                    cols1 = k_start + jnp.arange(block_k, dtype=jnp.int32)
                    plgpu.store(
                        dbias_ref.at[g, pl.ds(0, 1), pl.ds(k_start, block_k)],
                        jnp.sum(ds, axis=0, keepdims=True).astype(dbias_ref.dtype),
                        mask=(cols1 < S)[None, :],
                    )
                elif dbias_mode == "rows":
                    rowsum = rowsum + jnp.sum(ds, axis=1)
                return dq, rowsum

            dq = jnp.zeros((block_q, spec.Hp), jnp.float32)
            rowsum = jnp.zeros((block_q,), jnp.float32)
            dq, rowsum = lax.fori_loop(klo, khi, per_kblock, (dq, rowsum))
            common.store_tile(
                dq_ref, dq * spec.scale, 0, block_q, T - q_start, spec.H, ragged=ragged_q, head=g
            )
            if dbias_mode == "rows":
                plgpu.store(
                    dbias_ref.at[g, pl.ds(0, block_q), pl.ds(0, 1)],
                    rowsum[:, None].astype(dbias_ref.dtype),
                    mask=(rows1 < T)[:, None],
                )
            return carry

        lax.fori_loop(0, G, per_head, 0)

    if nk == max(nq, nk):
        dkdv_phase()
    else:
        pl.when(pid < nk)(dkdv_phase)
    if nq == max(nq, nk):
        dq_phase()
    else:
        pl.when(pid < nq)(dq_phase)


def backward(
    args: base.AttentionArgs,
    out,
    lse,
    dout,
    dlse=None,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
    need_dbias: bool = True,
    name: str = "jb_flash_bwd",
):
    """dq, dk, dv (and dbias when ``args.bias`` is given and ``need_dbias``) of the forward kernel.

    Args:
      args: the forward's arguments.
      out, lse: the forward's outputs.
      dout: cotangent of ``out``; ``dlse``: cotangent of ``lse`` (None = zero).
      config: backward :class:`Config`.
      interpret: run in the Pallas interpreter.
      allow_tf32: TF32 dots for float32 inputs.
      need_dbias: compute the bias gradient (skipped when the bias is not differentiated).

    Returns:
      ``(dq, dk, dv, dbias)`` with ``dbias`` None without bias or when not needed.
    """
    spec = common.Spec.of(args, allow_tf32=allow_tf32)
    cfg = config or Config.heuristics(args)
    block_q = common.block(cfg.block_q, spec.T)
    block_k = common.block(cfg.block_k, spec.S)
    nq, nk = pl.cdiv(spec.T, block_q), pl.cdiv(spec.S, block_k)
    P = max(nq, nk)
    G = spec.G
    B, T, S, N, K = spec.B, spec.T, spec.S, spec.N, spec.K

    # delta = rowsum(dO * O) - dlse, [B, N, T] float32 (a cheap memory-bound XLA fusion).
    delta = jnp.einsum(  # D = rowsum(dO * O) in float32 (an elementwise product: no TF32 rounding)
        "btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    if dlse is not None:
        delta = delta - dlse.astype(jnp.float32)
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # fully masked rows: every logit is -inf, P = 0

    dbias_mode = _dbias_mode(spec.bias_shape, T, S) if need_dbias else None
    dbias0 = None
    if dbias_mode is not None:
        bb, nb, tb, sb = spec.bias_shape
        exact = (bb, nb, tb, sb) == (B, N, T, S)
        ddt = args.bias.dtype if exact else jnp.float32
        shape = {"full": (B, N, T, S), "cols": (B, N, nq, S), "rows": (B, N, T, 1)}[dbias_mode]
        dbias0 = jnp.zeros(shape, ddt)

    def scalar_spec():
        return pl.BlockSpec((None,), lambda p, h, b: (b,))

    def grouped(shape4):
        bb, nb, tb, sb = shape4
        if nb != 1:
            return pl.BlockSpec((None, G, tb, sb), lambda p, h, b: (b if bb != 1 else 0, h, 0, 0))
        return pl.BlockSpec((None, None, tb, sb), lambda p, h, b: (b if bb != 1 else 0, 0, 0, 0))

    qb = lambda p: jnp.minimum(p, nq - 1)  # noqa: E731  (clamped: programs past the last block idle)
    kb = lambda p: jnp.minimum(p, nk - 1)  # noqa: E731
    operands = (
        *common.call_operands(args),
        dout,
        lse,
        delta,
        dbias0,
    )
    seed = operands[0]
    in_specs = (
        None if seed is None else pl.BlockSpec((4,), lambda p, h, b: (0,)),
        None if args.q_seq_lengths is None else scalar_spec(),
        None if args.kv_seq_lengths is None else scalar_spec(),
        None if args.q_segment_ids is None else pl.BlockSpec((None, T), lambda p, h, b: (b, 0)),
        None if args.kv_segment_ids is None else pl.BlockSpec((None, S), lambda p, h, b: (b, 0)),
        pl.BlockSpec((None, T, G, spec.Hp), lambda p, h, b: (b, 0, h, 0)),
        pl.BlockSpec((None, S, None, spec.Hp), lambda p, h, b: (b, 0, h, 0)),
        pl.BlockSpec((None, S, None, spec.Hvp), lambda p, h, b: (b, 0, h, 0)),
        None if args.bias is None else grouped(spec.bias_shape),
        None if args.mask is None else grouped(spec.mask_shape),
        pl.BlockSpec((None, T, G, spec.Hvp), lambda p, h, b: (b, 0, h, 0)),
        pl.BlockSpec((None, G, T), lambda p, h, b: (b, h, 0)),
        pl.BlockSpec((None, G, T), lambda p, h, b: (b, h, 0)),
        None
        if dbias0 is None
        else {
            "full": pl.BlockSpec((None, G, block_q, S), lambda p, h, b: (b, h, qb(p), 0)),
            "cols": pl.BlockSpec((None, G, 1, S), lambda p, h, b: (b, h, qb(p), 0)),
            "rows": pl.BlockSpec((None, G, block_q, 1), lambda p, h, b: (b, h, qb(p), 0)),
        }[dbias_mode],
    )
    # Under shard_map the outputs vary over the same mesh axes as the queries.
    out_shape = tuple(
        None if x is None else base.out_struct(x.shape, x.dtype, args.q)
        for x in (args.q, args.k, args.v, dbias0)
    )
    out_specs = (
        pl.BlockSpec((None, block_q, G, spec.Hp), lambda p, h, b: (b, qb(p), h, 0)),
        pl.BlockSpec((None, block_k, None, spec.Hp), lambda p, h, b: (b, kb(p), h, 0)),
        pl.BlockSpec((None, block_k, None, spec.Hvp), lambda p, h, b: (b, kb(p), h, 0)),
        in_specs[-1],
    )
    aliases = {}
    if dbias0 is not None:
        aliases = {sum(x is not None for x in operands) - 1: 3}
    kernel = functools.partial(
        _bwd_kernel, spec=spec, block_q=block_q, block_k=block_k, nq=nq, nk=nk, dbias_mode=dbias_mode
    )
    make_call = lambda interp: pl.pallas_call(  # noqa: E731
        kernel,
        grid=(P, K, B),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_backend.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interp,
        name=name,
    )
    dq, dk, dv, dbias = gpu.triton_call(make_call, operands, interpret=interpret)
    if dbias is not None:
        bb, nb, tb, sb = spec.bias_shape
        axes = tuple(ax for ax, keep in ((0, bb != 1), (1, nb != 1), (2, tb != 1)) if not keep)
        if axes:
            dbias = jnp.sum(dbias, axis=axes, keepdims=True)
        dbias = dbias.reshape(spec.bias_shape).astype(args.bias.dtype)
    return dq, dk, dv, dbias


def differentiable(
    args: base.AttentionArgs,
    *,
    fwd: Callable,
    bwd_config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
):
    """Wraps a forward kernel ``fwd(args) -> (out, lse)`` in a ``custom_vjp`` using :func:`backward`.

    Differentiable w.r.t. ``q``, ``k``, ``v`` and ``bias``; the bias gradient is computed only when
    the bias is actually differentiated (``symbolic_zeros``). Masks, lengths, segment ids and the
    dropout key get no gradient. Batch- and kv-head-sharded inputs stay sharded
    (:func:`sharded.attention_vjp`).
    """
    if bwd_config is not None and not isinstance(bwd_config, Config):
        raise TypeError(
            f"`bwd_config` must be a triton_flash_vjp.Config or None; got {type(bwd_config).__name__}"
        )

    def bwd(a, out, lse, dout, dlse, need_dbias=True):
        return backward(
            a,
            out,
            lse,
            dout,
            dlse,
            config=bwd_config,
            interpret=interpret,
            allow_tf32=allow_tf32,
            need_dbias=need_dbias,
        )

    return sharded.attention_vjp(args, fwd, bwd, name="Pallas flash", skips_dbias=True)
