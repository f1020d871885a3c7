"""Decode attention on GPU: split-K flash-decoding (Pallas Triton) for short queries over long KV.

For ``T <= 16`` query rows (autoregressive decoding, speculative verification) the flash kernel's
grid ``(T / block_q, N, B)`` has far too few programs to fill a GPU, and each wastes most of a
``block_q`` tile. Flash-decoding (Dao et al., 2023, "Flash-Decoding for long-context inference")
instead splits the keys into ``num_splits`` chunks processed in parallel, and packs the ``T x G``
query rows of one GQA group into one tile (every query head of the group reads the same K/V tile
once). Each program writes a partial ``(out_s, lse_s)``; a combine step (a small XLA fusion)
rescales them: ``lse = logsumexp_s(lse_s)``, ``out = sum_s exp(lse_s - lse) * out_s``.

Supports what :mod:`triton_flash` does except bias / mask tiles: causal (any ``diag_offset``, e.g.
lower-right for decoding), window, softcap, lengths, segment ids, GQA / MQA, dropout (same
keep-mask), any ``S``, head dims up to 256. The backward pass is the fused :mod:`triton_flash_vjp` kernel.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, triton_decode
  >>> q = jax.random.normal(jax.random.key(0), (2, 1, 4, 32))
  >>> kv = jax.random.normal(jax.random.key(1), (2, 100, 1, 32))
  >>> args = base.make_args(q, kv, kv, kv_seq_lengths=jnp.array([100, 37]))
  >>> out, lse = triton_decode.attention(args, config=triton_decode.Config(block_k=16, num_splits=3), interpret=True)
  >>> bool(jnp.allclose(out, base.reference(args)[0], atol=1e-4))
  True
"""

from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu, triton_backend
from pallas_kernels.attention import base, triton_common as common, triton_flash_vjp
from pallas_kernels.attention.triton_tuning import DecodeConfig as Config
from pallas_kernels.attention.triton_tuning import decode_heuristics as heuristics

__all__ = ["Config", "heuristics", "unsupported", "attention", "forward", "MAX_QUERY_LEN"]

#: Longest query this path takes (beyond it, the flash kernel fills the GPU on its own).
MAX_QUERY_LEN = 16
_LOG2E = common.LOG2E
_LN2 = common.LN2


def _decode_kernel(
    seed_ref,
    qlen_ref,
    kvlen_ref,
    qseg_ref,
    kvseg_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    spec: common.Spec,
    M: int,
    Mp: int,
    block_k: int,
    chunk: int,
):
    sp, kh, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G = spec.G
    r = jnp.arange(Mp, dtype=jnp.int32)
    rows = (r // G)[:, None]  # query index t of packed row r = t * G + g
    heads = (kh * G + r % G)[:, None]
    q = common.load_tile(q_ref, 0, Mp, M, spec.H, spec.Hp, ragged=Mp != M)
    q_len = common.load_scalar(qlen_ref)
    kv_len = common.load_scalar(kvlen_ref)
    q_seg = None
    if qseg_ref is not None:
        q_seg = common.load_rows(qseg_ref, 0, Mp, M, other=-1)[:, None]
    ragged_k = spec.S % block_k != 0

    def body(kb, carry):
        acc, m_prev, l_prev = carry
        k_start = kb * block_k
        cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
        k = common.load_tile(k_ref, k_start, block_k, spec.S, spec.H, spec.Hp, ragged=ragged_k)
        kv_seg = None
        if kvseg_ref is not None:
            kv_seg = common.load_rows(kvseg_ref, k_start, block_k, spec.S, other=-2)[None, :]
        mask = common.logits_mask(
            spec, rows, cols, q_len=q_len, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg, force_bounds=Mp != M
        )
        s, _ = common.scores(spec, q, k, rows, cols, mask=mask)
        s = s * _LOG2E
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        if spec.dropout_rate > 0:
            keep = common.dropout_keep(spec, seed_ref, b, heads, rows, cols)
            p = jnp.where(keep, p, 0.0)
        v = common.load_tile(v_ref, k_start, block_k, spec.S, spec.Hv, spec.Hvp, ragged=ragged_k)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=spec.precision)
        return acc, m_new, l_new

    # Keys this split owns, intersected with what any of the T query rows can see.
    lo, hi = base.key_range(
        0, spec.T, spec.S, causal=spec.causal, diag_offset=spec.diag_offset, window=spec.window
    )
    lo = jnp.maximum(jnp.int32(lo), sp * chunk)
    hi = jnp.minimum(jnp.int32(hi), sp * chunk + chunk)
    if kv_len is not None:
        hi = jnp.minimum(hi, kv_len)
    if q_len is not None:
        hi = jnp.where(q_len == 0, 0, hi)
    acc = jnp.zeros((Mp, spec.Hvp), jnp.float32)
    m_i = jnp.full((Mp,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((Mp,), jnp.float32)
    # Splits own whole key blocks (chunk is a multiple of block_k), so no block is visited twice.
    acc, m_i, l_i = lax.fori_loop(*common.block_range(lo, hi, block_k), body, (acc, m_i, l_i))
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    inv = (spec.keep_scale if spec.dropout_rate > 0 else 1.0) / l_safe
    m_safe = jnp.where(empty, 0.0, m_i)
    lse = jnp.where(empty, -jnp.inf, (m_safe + jnp.log2(l_safe)) * _LN2)
    common.store_tile(o_ref, acc * inv[:, None], 0, Mp, M, spec.Hv, ragged=Mp != M)
    if Mp != M:
        plgpu.store(lse_ref, lse, mask=r < M)
    else:
        lse_ref[...] = lse


def forward(
    args: base.AttentionArgs,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
):
    """Split-K forward: ``(out [B, T, N, Hv], lse [B, N, T] float32)``."""
    spec = common.Spec.of(args, allow_tf32=allow_tf32)
    B, T, S, N, K, G = spec.B, spec.T, spec.S, spec.N, spec.K, spec.G
    auto = Config.heuristics(args)
    cfg = config or auto
    block_k = common.block(cfg.block_k, S)
    splits = cfg.num_splits or auto.num_splits
    chunk = pl.cdiv(pl.cdiv(S, splits), block_k) * block_k  # whole key blocks per split
    splits = pl.cdiv(S, chunk)
    M = T * G
    Mp = max(16, pl.next_power_of_2(M))
    # Pack the G query heads of each kv head with the T queries: row r = t * G + g (tiny: T <= 16).
    qg = args.q.reshape(B, T, K, G, spec.H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, spec.H)
    qseg = None
    if args.q_segment_ids is not None:
        qseg = jnp.repeat(args.q_segment_ids, G, axis=1)  # [B, M], row r -> query r // G
    seed = common.dropout_seed_words(args)

    def scalar_spec():
        return pl.BlockSpec((None,), lambda s, h, b: (b,))

    operands = (seed, args.q_seq_lengths, args.kv_seq_lengths, qseg, args.kv_segment_ids, qg, args.k, args.v)
    in_specs = (
        None if seed is None else pl.BlockSpec((4,), lambda s, h, b: (0,)),
        None if args.q_seq_lengths is None else scalar_spec(),
        None if args.kv_seq_lengths is None else scalar_spec(),
        None if qseg is None else pl.BlockSpec((None, Mp), lambda s, h, b: (b, 0)),
        None if args.kv_segment_ids is None else pl.BlockSpec((None, S), lambda s, h, b: (b, 0)),
        pl.BlockSpec((None, None, Mp, spec.Hp), lambda s, h, b: (b, h, 0, 0)),
        pl.BlockSpec((None, S, None, spec.Hp), lambda s, h, b: (b, 0, h, 0)),
        pl.BlockSpec((None, S, None, spec.Hvp), lambda s, h, b: (b, 0, h, 0)),
    )
    # Under shard_map the outputs vary over the same mesh axes as the queries.
    out_shape = (
        base.out_struct((B, K, splits, M, spec.Hv), jnp.float32, args.q),
        base.out_struct((B, K, splits, M), jnp.float32, args.q),
    )
    out_specs = (
        pl.BlockSpec((None, None, None, Mp, spec.Hvp), lambda s, h, b: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, Mp), lambda s, h, b: (b, h, s, 0)),
    )
    kernel = functools.partial(_decode_kernel, spec=spec, M=M, Mp=Mp, block_k=block_k, chunk=chunk)
    make_call = lambda interp: pl.pallas_call(  # noqa: E731
        kernel,
        grid=(splits, K, B),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_backend.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interp,
        name="jb_decode_fwd",
    )
    o_part, lse_part = gpu.triton_call(make_call, operands, interpret=interpret)
    # Combine step: rescale each split's normalised partial by its share of the total softmax mass.
    lse_max = jnp.max(lse_part, axis=2, keepdims=True)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    w = jnp.exp(lse_part - lse_max)  # [B, K, splits, M]; 0 for empty splits
    total = jnp.sum(w, axis=2, keepdims=True)
    lse = jnp.where(total[:, :, 0] > 0, jnp.log(total[:, :, 0]) + lse_max[:, :, 0], -jnp.inf)
    w = w / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum(
        "bksm,bksmh->bkmh", w, o_part, precision=lax.Precision.HIGHEST
    )  # [B, K, M, Hv], float32 (TF32 would round the partials)
    out = out.reshape(B, K, T, G, spec.Hv).transpose(0, 2, 1, 3, 4).reshape(B, T, N, spec.Hv)
    lse = lse.reshape(B, K, T, G).transpose(0, 1, 3, 2).reshape(B, N, T)
    return out.astype(args.dtype), lse


def unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Why the decode kernel cannot run ``args`` on ``platform`` (empty list if it can).

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.attention import base, triton_decode
      >>> x = jnp.ones((1, 64, 2, 16), jnp.bfloat16)
      >>> triton_decode.unsupported(base.make_args(x, x, x), "cuda")
      ['query length T=64 > 16 (decode is for short queries; use flash)']
    """
    reasons = common.common_unsupported(args, platform)
    if args.q_len > MAX_QUERY_LEN:
        reasons.append(
            f"query length T={args.q_len} > {MAX_QUERY_LEN} (decode is for short queries; use flash)"
        )
    if args.bias is not None:
        reasons.append("an additive `bias` is not supported by decode (use the memory-efficient backend)")
    if args.mask is not None:
        reasons.append(
            "a boolean `mask` is not supported by decode (use kv_seq_lengths / segment ids, "
            "or the memory-efficient backend)"
        )
    return reasons


def attention(
    args: base.AttentionArgs,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
    bwd_config: Optional[triton_flash_vjp.Config] = None,
    **opts,
):
    """Split-K decode attention (Pallas Triton); differentiable via the fused flash backward.

    Args:
      args: canonical arguments with ``T <= 16`` and no bias / mask (see :func:`unsupported`).
      config: :class:`Config` (default :func:`heuristics` from the shape).
      interpret: run the kernel in the Pallas interpreter (CPU testing).
      allow_tf32: float32 inputs use TF32 tensor-core dots.
      bwd_config: backward :class:`triton_flash_vjp.Config`.
      **opts: ignored dispatch options.

    Returns:
      ``(out [B, T, N, Hv], lse [B, N, T] float32)``.
    """
    del opts
    common.check_config(config, Config)
    reasons = unsupported(args, "cuda")
    if reasons:
        raise ValueError("decode (Pallas) cannot run this call: " + "; ".join(reasons))
    fwd = functools.partial(forward, config=config, interpret=interpret, allow_tf32=allow_tf32)
    return triton_flash_vjp.differentiable(
        args, fwd=fwd, bwd_config=bwd_config, interpret=interpret, allow_tf32=allow_tf32
    )
