"""Flash attention on GPU: a Pallas (Triton backend) forward kernel, differentiable.

FlashAttention-2 (Dao, 2023, https://arxiv.org/abs/2307.08691): the grid runs over
``(query block, query head, batch)``; each program keeps one ``[block_q, H]`` query tile on chip and
scans the key/value blocks it can see with an online softmax (section 3.1.1: an unscaled accumulator
``acc``, the running row maximum ``m`` and the running denominator ``l``, rescaled by
``exp(m_old - m_new)`` at each step). The scan runs in base 2 (``exp2``) with ``log2(e)`` folded
into the logits; the LSE written out is the natural-log one the backward pass (:mod:`triton_flash_vjp`) and
the XLA paths use.

What the anchors lack and this kernel has:

* GQA / MQA by the key/value index map (query head ``n`` reads key head ``n // G``), never a repeat.
* Any ``T`` / ``S``: the ragged last block is masked on load and on store (no multiple-of-block rule).
* Head dims up to 256, padded on chip to a power of two (>= 16, the Triton ``dot`` minimum).
* Masks generated from indices per block: causal (any ``diag_offset``: top-left and lower-right),
  sliding window, query / key lengths, segment ids; key blocks outside the causal / window band or
  past the key length are never visited (block skipping).
* ``logits_soft_cap``; dropout from :func:`base.dropout_keep_from_seed`, the same keep bits as the
  XLA paths for the same key.
* Fully masked rows give output 0 and ``lse = -inf`` (``m`` is clamped to 0 when a row has seen only
  ``-inf``, so no ``inf - inf``).

Verification: CI has no GPU. The kernels run in the Pallas interpreter (``interpret=True``) against
:func:`base.reference`, and are exported for CUDA from CPU with ``jax.export`` (the Triton IR is
generated and passes the MLIR verifier); Triton's own compilation to PTX happens only on a GPU.

The kernel body also reads additive-bias and boolean-mask tiles; that part is used by
:mod:`triton_mem_efficient`. This module's :func:`attention` (the ``flash`` backend) refuses bias / mask
like torch's flash backend does.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, triton_flash
  >>> q = jax.random.normal(jax.random.key(0), (1, 20, 2, 32), jnp.float32)
  >>> args = base.make_args(q, q, q, is_causal=True)
  >>> out, lse = triton_flash.attention(args, interpret=True)  # interpret=True: runs on CPU
  >>> ref, _ = base.reference(args)
  >>> bool(jnp.allclose(out, ref, atol=1e-4))
  True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_backend
from pallas_kernels.attention import base, triton_flash_vjp
from pallas_kernels.attention.triton_tuning import Config, heuristics
from pallas_kernels.attention.triton_common import (
    GPU_PLATFORMS,
    LN2,
    LOG2E,
    Spec,
    base2,
    block,
    call_operands,
    check_config,
    common_unsupported,
    dropout_keep,
    key_block_range,
    load_bias_like,
    load_rows,
    load_scalar,
    load_tile,
    logits_mask,
    scores,
    store_tile,
)
from pallas_kernels.gpu import triton_call

__all__ = ["Config", "heuristics", "unsupported", "attention", "forward", "GPU_PLATFORMS"]


# ----------------------------------------------------------------------------------------------
# Forward kernel.
# ----------------------------------------------------------------------------------------------


def _fwd_kernel(
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
    o_ref,
    lse_ref,
    *,
    spec: Spec,
    block_q: int,
    block_k: int,
):
    iq, n, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_start = iq * block_q
    rows1 = q_start + jnp.arange(block_q, dtype=jnp.int32)
    rows = rows1[:, None]
    ragged_q = spec.T % block_q != 0
    ragged_k = spec.S % block_k != 0
    q = load_tile(q_ref, 0, block_q, spec.T - q_start, spec.H, spec.Hp, ragged=ragged_q)
    q_len = load_scalar(qlen_ref)
    kv_len = load_scalar(kvlen_ref)
    q_seg = None
    if qseg_ref is not None:
        q_seg = load_rows(qseg_ref, 0, block_q, spec.T - q_start, other=-1)[:, None]

    def body(kb, carry, *, interior: bool):
        # `interior`: a block wholly below the causal diagonal and inside [0, S): no causal / key-bound
        # mask to build (FlashAttention-2's split of the diagonal blocks from the rest).
        acc, m_prev, l_prev = carry
        k_start = kb * block_k
        cols = (k_start + jnp.arange(block_k, dtype=jnp.int32))[None, :]
        k = load_tile(k_ref, k_start, block_k, spec.S, spec.H, spec.Hp, ragged=ragged_k)
        kv_seg = None
        if kvseg_ref is not None:
            kv_seg = load_rows(kvseg_ref, k_start, block_k, spec.S, other=-2)[None, :]
        bias_tile = mask_tile = None
        if bias_ref is not None:
            bias_tile = load_bias_like(
                bias_ref, spec.bias_shape, spec, q_start, block_q, k_start, block_k, other=0
            )
        if mask_ref is not None:
            mask_tile = load_bias_like(
                mask_ref, spec.mask_shape, spec, q_start, block_q, k_start, block_k, other=False
            )
        mask = None
        mspec = dataclasses.replace(spec, causal=False) if interior else spec
        if (
            mspec.causal
            or spec.window is not None
            or (ragged_k and not interior)
            or q_len is not None
            or kv_len is not None
            or q_seg is not None
            or mask_tile is not None
        ):
            mask = logits_mask(
                mspec,
                rows,
                cols,
                q_len=q_len,
                kv_len=kv_len,
                q_seg=q_seg,
                kv_seg=kv_seg,
                mask_tile=mask_tile,
                key_bounds=not interior,
            )
        s, _ = scores(spec, q, k, rows, cols, bias_tile=bias_tile, mask=mask)
        s = s * LOG2E if bias_tile is None else base2(s)
        # Online softmax (FlashAttention-2, section 3.1.1), in base 2. `m_safe` stays finite for rows
        # that have only seen masked keys so far, so exp2(-inf - m_safe) = 0 instead of NaN.
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        if spec.dropout_rate > 0:
            keep = dropout_keep(spec, seed_ref, b, n, rows, cols)
            p = jnp.where(keep, p, 0.0)
        v = load_tile(v_ref, k_start, block_k, spec.S, spec.Hv, spec.Hvp, ragged=ragged_k)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=spec.precision)
        return acc, m_new, l_new

    lo, hi = key_block_range(spec, q_start, q_start + block_q, block_k, q_len=q_len, kv_len=kv_len)
    acc = jnp.zeros((block_q, spec.Hvp), jnp.float32)
    m_i = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((block_q,), jnp.float32)
    carry = (acc, m_i, l_i)
    if spec.window is None and (spec.causal or ragged_k):
        # Interior blocks [lo, mid): every key visible to every row of this query block.
        mid = hi
        if spec.causal:  # keys < q_start + diag_offset + 1 are visible to the first row already
            mid = jnp.minimum(mid, jnp.maximum(q_start + spec.diag_offset + 1, 0) // block_k)
        if ragged_k:
            mid = jnp.minimum(mid, spec.S // block_k)
        mid = jnp.clip(mid, lo, hi)
        carry = lax.fori_loop(lo, mid, functools.partial(body, interior=True), carry)
        lo = mid
    acc, m_i, l_i = lax.fori_loop(lo, hi, functools.partial(body, interior=False), carry)

    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    inv = (spec.keep_scale if spec.dropout_rate > 0 else 1.0) / l_safe
    out = acc * inv[:, None]
    m_safe = jnp.where(empty, 0.0, m_i)
    lse = jnp.where(empty, -jnp.inf, (m_safe + jnp.log2(l_safe)) * LN2)
    store_tile(o_ref, out, 0, block_q, spec.T - q_start, spec.Hv, ragged=ragged_q)
    if ragged_q:
        plgpu.store(lse_ref, lse, mask=rows1 < spec.T)
    else:
        lse_ref[...] = lse


def _bias_spec(shape4, index):
    """BlockSpec for a rank-4 bias / mask with broadcast dims; ``index(b, n) -> (bi, ni)``."""
    bb, nb, tb, sb = shape4
    return pl.BlockSpec((None, None, tb, sb), lambda *g: (*index(g, bb != 1, nb != 1), 0, 0))


def forward(
    args: base.AttentionArgs,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
    name: str = "jb_flash_fwd",
):
    """Runs the forward kernel on validated ``args`` (bias / mask tiles read when present).

    Returns ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32)``.
    """
    spec = Spec.of(args, allow_tf32=allow_tf32)
    cfg = config or Config.heuristics(args)
    block_q = block(cfg.block_q, spec.T)
    block_k = block(cfg.block_k, spec.S)
    G = spec.G
    nq = pl.cdiv(spec.T, block_q)
    grid = (nq, spec.N, spec.B)

    def scalar_spec():
        return pl.BlockSpec((None,), lambda i, n, b: (b,))

    def head_index(g, has_b, has_n):
        _, n, b = g
        return (b if has_b else 0, n if has_n else 0)

    operands = call_operands(args)
    seed = operands[0]
    in_specs = (
        None if seed is None else pl.BlockSpec((4,), lambda i, n, b: (0,)),
        None if args.q_seq_lengths is None else scalar_spec(),
        None if args.kv_seq_lengths is None else scalar_spec(),
        None if args.q_segment_ids is None else pl.BlockSpec((None, block_q), lambda i, n, b: (b, i)),
        None if args.kv_segment_ids is None else pl.BlockSpec((None, spec.S), lambda i, n, b: (b, 0)),
        pl.BlockSpec((None, block_q, None, spec.Hp), lambda i, n, b: (b, i, n, 0)),
        pl.BlockSpec((None, spec.S, None, spec.Hp), lambda i, n, b: (b, 0, n // G, 0)),
        pl.BlockSpec((None, spec.S, None, spec.Hvp), lambda i, n, b: (b, 0, n // G, 0)),
        None if args.bias is None else _bias_spec(spec.bias_shape, head_index),
        None if args.mask is None else _bias_spec(spec.mask_shape, head_index),
    )
    # Under shard_map the outputs vary over the same mesh axes as the queries.
    out_shape = (
        base.out_struct((spec.B, spec.T, spec.N, spec.Hv), args.dtype, args.q),
        base.out_struct((spec.B, spec.N, spec.T), jnp.float32, args.q),
    )
    out_specs = (
        pl.BlockSpec((None, block_q, None, spec.Hvp), lambda i, n, b: (b, i, n, 0)),
        pl.BlockSpec((None, None, block_q), lambda i, n, b: (b, n, i)),
    )
    kernel = functools.partial(_fwd_kernel, spec=spec, block_q=block_q, block_k=block_k)
    make_call = lambda interp: pl.pallas_call(  # noqa: E731
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_backend.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interp,
        name=name,
    )
    out, lse = triton_call(make_call, operands, interpret=interpret)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backend entry points.
# ----------------------------------------------------------------------------------------------


def unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Why the flash Pallas kernel cannot run ``args`` on ``platform`` (empty list if it can).

    The same constraints hold for the forward and the backward pass, so a call accepted here never
    fails later at grad time.

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.attention import base, triton_flash
      >>> x = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
      >>> triton_flash.unsupported(base.make_args(x, x, x), "cuda")
      []
      >>> triton_flash.unsupported(base.make_args(x, x, x, bias=jnp.zeros((1, 1, 8, 8))), "cuda")
      ['an additive `bias` is not supported by flash (use the memory-efficient backend)']
    """
    reasons = common_unsupported(args, platform)
    if args.bias is not None:
        reasons.append("an additive `bias` is not supported by flash (use the memory-efficient backend)")
    if args.mask is not None:
        reasons.append(
            "an arbitrary boolean `mask` is not supported by flash (use the "
            "memory-efficient backend, or causal / window / lengths / segment ids)"
        )
    return reasons


def attention(
    args: base.AttentionArgs,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
    bwd_config=None,
    **opts,
):
    """Flash attention with the Pallas Triton kernels; differentiable w.r.t. q, k, v.

    Args:
      args: canonical arguments (:func:`base.make_args`); no bias / mask (see :func:`unsupported`).
      config: forward :class:`Config` (default :func:`heuristics`).
      interpret: run the kernels in the Pallas interpreter (CPU testing).
      allow_tf32: float32 inputs use TF32 tensor-core dots (otherwise full IEEE float32).
      bwd_config: backward :class:`triton_flash_vjp.Config`.
      **opts: ignored dispatch options.

    Returns:
      ``(out [B, T, N, Hv], lse [B, N, T] float32)``; ``lse`` is differentiable too.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pallas_kernels.attention import base, triton_flash
      >>> x = jax.random.normal(jax.random.key(1), (1, 17, 4, 16))
      >>> kv = x[:, :, :2]
      >>> args = base.make_args(x, kv, kv, window=(4, 0))
      >>> g = jax.grad(lambda q: triton_flash.attention(args.replace(q=q), interpret=True)[0].sum())(x)
      >>> g.shape
      (1, 17, 4, 16)
    """
    del opts
    check_config(config, Config)
    reasons = unsupported(args, "cuda")
    if reasons:
        raise ValueError("flash (Pallas) cannot run this call: " + "; ".join(reasons))
    return triton_flash_vjp.differentiable(
        args,
        fwd=functools.partial(forward, config=config, interpret=interpret, allow_tf32=allow_tf32),
        bwd_config=bwd_config,
        interpret=interpret,
        allow_tf32=allow_tf32,
    )
