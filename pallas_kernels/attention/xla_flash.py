"""FlashAttention-2 in plain XLA: blockwise online softmax, O(L x block) memory forward and backward.

This is the implementation of ``SDPBackend.FLASH_ATTENTION`` that runs on every platform; the
dispatcher prefers the C++ kernel of :mod:`cpp_flash` over it when lowering for CPU where that kernel
can run the call (flag ``flash_cpu_kernel``). The algorithm is FlashAttention-2 (Dao, 2023, arXiv:2307.08691):

* Forward (Algorithm 1): an outer ``lax.scan`` over query blocks; for each, a ``lax.fori_loop`` over
  only the key blocks the block can see (causal / window structure, so fully masked blocks are never
  computed). We keep an *unscaled* accumulator ``acc``, the running row max ``m`` and row sum ``l``
  (section 3.1.1: rescale by ``exp(m_old - m_new)`` per step, divide by ``l`` once at the end).
  Every head of a GQA group shares the key/value block: the ``G`` query heads of one key/value head
  are stacked into the rows of one matmul (``[B, K, G * block_q, H] @ [B, K, block_k, H]^T``), so
  there is no materialised repeat and the inner matmuls stay large.
* Backward (Algorithm 2): an outer ``lax.scan`` over key blocks, an inner loop over the query blocks
  that see it; ``P`` is recomputed from the saved LSE, ``dK``/``dV`` accumulate in the loop carry and
  ``dQ`` in a ``[T, H]``-sized buffer updated in place. ``D_i = rowsum(dO_i * O_i)`` (minus the LSE
  cotangent, so ``lse`` is differentiable too).
* Masks (causal, window, lengths, segment ids, padding) are generated per block from indices.
  Interior blocks whose causal/window mask is all-true run a body without the mask select.
* ``logits_soft_cap`` is applied per block (its derivative ``1 - tanh^2`` in the backward); dropout
  uses the stateless :func:`base.dropout_keep_mask` of global indices, so it matches every backend.

Peak memory is ``O((T + S) * H + block_q * block_k * N)`` for both passes, against ``O(T * S * N)``
for the math path.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, xla_flash
  >>> q = jax.random.normal(jax.random.key(0), (1, 300, 4, 32))
  >>> args = base.make_args(q, q, q, is_causal=True)
  >>> cfg = xla_flash.Config(block_q=128, block_k=128)
  >>> out, lse = xla_flash.attention(args, config=cfg)
  >>> ref, _ = base.reference(args)
  >>> bool(jnp.allclose(out, ref, atol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention import base, sharded

__all__ = ["Config", "attention", "unsupported"]

_HIGHEST = lax.Precision.HIGHEST
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of the XLA flash implementation.

    Attributes:
      block_q: query rows per block (per head; the ``G`` heads of a GQA group are stacked on top).
      block_k: keys per block.
      block_q_bwd: query block of the backward (default: ``block_q``).
      block_k_bwd: key block of the backward (default: ``block_k``).
      compute_dtype: dtype of the matmuls and the softmax (``"float32"``; inputs are upcast once).
    """

    block_q: int = 512
    block_k: int = 512
    block_q_bwd: Optional[int] = None
    block_k_bwd: Optional[int] = None
    compute_dtype: str = "float32"

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            val = getattr(self, name)
            if val is None and name.endswith("_bwd"):
                continue
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"Config.{name} must be an int >= 1; got {name}={val!r}")

    @property
    def bwd(self) -> Tuple[int, int]:
        return (self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k)

    @classmethod
    def heuristics(cls, args: base.AttentionArgs, platform: str = "cpu") -> "Config":
        """Tiles measured best on a 2-core x86 CPU (f32, head dim 64, L = 4k):

        * forward: 1024 x 1024 without structure (fewest loop steps, GEMMs still cache friendly);
          512 x 512 under causal / window masks (finer block skipping wins);
        * backward: 256 query rows x 1024 keys (the five GEMMs per step stay in cache);
        * the ``G`` heads of a GQA group share one tile, so ``block_q`` is divided by ``G``;
        * every tile shrinks to the (8-rounded) sequence length for short sequences.
        """
        del platform

        def fit(n, b):
            return max(1, min(b, -(-n // 8) * 8))

        structural = args.causal or args.window is not None
        bq, bk = (512, 512) if structural else (1024, 1024)
        g = args.groups
        return cls(
            block_q=fit(args.q_len, max(64, bq // g)),
            block_k=fit(args.kv_len, bk),
            block_q_bwd=fit(args.q_len, max(32, 256 // g)),
            block_k_bwd=fit(args.kv_len, 1024),
        )


def unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Reasons this implementation cannot run ``args`` (empty if it can). Runs on any platform."""
    del platform
    reasons = []
    if args.bias is not None:
        reasons.append("FLASH takes no additive bias / float attn_mask (EFFICIENT_ATTENTION or MATH do)")
    if args.mask is not None:
        reasons.append(
            "FLASH takes no arbitrary boolean attn_mask yet, also on CPU (torch's CPU flash "
            "does): enable EFFICIENT_ATTENTION or MATH too (e.g. sdpa_kernel([FLASH_ATTENTION,"
            " EFFICIENT_ATTENTION])), or express the mask as is_causal / a CausalBias / "
            "window / lengths / segment ids"
        )
    return reasons


def attention(args: base.AttentionArgs, *, config: Optional[Config] = None, **opts):
    """Blockwise flash attention in XLA: ``(out [B, T, N, Hv] q.dtype, lse [B, N, T] float32)``.

    Runs on every platform; differentiable (``jax.vjp``) w.r.t. q, k, v; the backward recomputes per
    block. ``config`` defaults to :meth:`Config.heuristics`; ``opts`` are ignored dispatch options.
    """
    del opts
    reasons = unsupported(args, "any")
    if reasons:
        raise NotImplementedError("; ".join(reasons))
    return blockwise_attention(args, config or Config.heuristics(args))


# ----------------------------------------------------------------------------------------------
# The shared blockwise engine (also used by xla_mem_efficient with a bias / bool mask).
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
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
    cap: Optional[float]
    rate: float
    bq: int
    bk: int
    bq_b: int
    bk_b: int
    cdt: str
    out_dtype: str
    bias_shape: Optional[Tuple[int, ...]]
    bias_dtype: Optional[str]
    mask_shape: Optional[Tuple[int, ...]]

    @property
    def G(self):
        return self.N // self.K

    @property
    def structural(self):
        return self.causal or self.window is not None


def blockwise_attention(args: base.AttentionArgs, config: Config):
    """Runs the blockwise engine on ``args`` (bias / mask allowed) with ``config``'s tiles."""
    q = args.q
    B, T, N, _ = q.shape
    if 0 in (B, T, args.k.shape[1], N):
        return jnp.zeros((B, T, N, args.v.shape[3]), q.dtype), jnp.full((B, N, T), -jnp.inf, jnp.float32)

    def forward(a):
        st, aux = _prepare(a, config)
        return _forward(st, a.q, a.k, a.v, a.bias, aux)

    def backward(a, out, lse, g_out, g_lse):
        st, aux = _prepare(a, config)
        return _backward(st, a.q, a.k, a.v, a.bias, aux, out, lse, g_out, g_lse)

    return sharded.attention_vjp(args, forward, backward, name="blockwise flash (XLA)")


def _prepare(args: base.AttentionArgs, config: Config):
    """The engine's static record and its data operands, from ``args`` (global or one shard's)."""
    q, k, v = args.q, args.k, args.v
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = min(config.block_q, T), min(config.block_k, S)
    bq_b, bk_b = config.bwd
    bq_b, bk_b = min(bq_b, T), min(bk_b, S)
    st = _Static(
        B=B,
        T=T,
        S=S,
        N=N,
        K=K,
        H=H,
        Hv=Hv,
        scale=args.scale,
        causal=args.causal,
        diag_offset=args.diag_offset,
        window=args.window,
        cap=args.logits_soft_cap,
        rate=args.dropout_rate,
        bq=max(bq, 1),
        bk=max(bk, 1),
        bq_b=max(bq_b, 1),
        bk_b=max(bk_b, 1),
        cdt=config.compute_dtype,
        out_dtype=jnp.dtype(q.dtype).name,
        bias_shape=None if args.bias is None else tuple(args.bias.shape),
        bias_dtype=None if args.bias is None else jnp.dtype(args.bias.dtype).name,
        mask_shape=None if args.mask is None else tuple(args.mask.shape),
    )
    aux = dict(
        mask=args.mask,
        q_len=args.q_seq_lengths,
        kv_len=args.kv_seq_lengths,
        q_seg=args.q_segment_ids,
        kv_seg=args.kv_segment_ids,
        seed=None
        if args.dropout_rng is None
        else base.dropout_seed(args.dropout_rng, (args.q, args.k, args.v)),
    )
    return st, aux


# ---- layouts ---------------------------------------------------------------------------------


def _cdiv(a, b):
    return -(-a // b)


def _pad_axis(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)


def _q_blocks(x, st, bq):
    """[B, T, N, D] -> [B, K, nq, G * bq, D] (the G heads of a group stacked on the rows)."""
    B, T, N, D = x.shape
    nq = _cdiv(T, bq)
    x = _pad_axis(x, 1, nq * bq)
    x = x.reshape(B, nq, bq, st.K, st.G, D).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(B, st.K, nq, st.G * bq, D)


def _q_unblock(xb, st, bq):
    B, K, nq, _, D = xb.shape
    x = xb.reshape(B, K, nq, st.G, bq, D).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(B, nq * bq, st.N, D)[:, : st.T]


def _row_blocks(x, st, bq, value):
    """[B, N, T] -> [B, K, nq, G * bq]."""
    B, N, T = x.shape
    nq = _cdiv(T, bq)
    x = _pad_axis(x, 2, nq * bq, value)
    x = x.reshape(B, st.K, st.G, nq, bq).transpose(0, 1, 3, 2, 4)
    return x.reshape(B, st.K, nq, st.G * bq)


def _row_unblock(xb, st, bq):
    B, K, nq, _ = xb.shape
    x = xb.reshape(B, K, nq, st.G, bq).transpose(0, 1, 3, 2, 4)
    return x.reshape(B, st.N, nq * bq)[:, :, : st.T]


def _kv_blocks(x, bk):
    """[B, S, K, D] -> [B, K, nk, bk, D]."""
    B, S, K, D = x.shape
    nk = _cdiv(S, bk)
    x = _pad_axis(x, 1, nk * bk)
    return x.reshape(B, nk, bk, K, D).transpose(0, 3, 1, 2, 4)


def _kv_unblock(xb, S):
    B, K, nk, bk, D = xb.shape
    return xb.transpose(0, 2, 3, 1, 4).reshape(B, nk * bk, K, D)[:, :S]


def _dense_prep(x, st, Tp, Sp, value):
    """[Bb, Nb, Tb, Sb] (broadcastable) -> [Bb, Kb, Gb, Tb', Sb'] padded to (Tp, Sp) where not 1."""
    Bb, Nb, Tb, Sb = x.shape
    x = x.reshape(Bb, st.K, st.G, Tb, Sb) if Nb == st.N and Nb > 1 else x.reshape(Bb, 1, 1, Tb, Sb)
    if Tb > 1:
        x = _pad_axis(x, 3, Tp, value)
    if Sb > 1:
        x = _pad_axis(x, 4, Sp, value)
    return x


def _tile_starts(shape, b, kh, i, j, bq, bk):
    starts = [0, 0, 0, 0, 0]
    sizes = [1, 1, shape[2], 1, 1]
    if shape[0] > 1:
        starts[0] = b
    if shape[1] > 1:
        starts[1] = kh
    if shape[3] > 1:
        starts[3], sizes[3] = i * bq, bq
    if shape[4] > 1:
        starts[4], sizes[4] = j * bk, bk
    return starts, sizes


def _dense_tile(xp, b, kh, i, j, bq, bk):
    """The [1, 1, Gb, bq|1, bk|1] tile of a prepared bias / mask for head (b, kh), block (i, j)."""
    starts, sizes = _tile_starts(xp.shape, b, kh, i, j, bq, bk)
    return lax.dynamic_slice(xp, starts, sizes)


def _dense_untile_add(acc, tile, b, kh, i, j, bq, bk):
    starts, _ = _tile_starts(acc.shape, b, kh, i, j, bq, bk)
    cur = lax.dynamic_slice(acc, starts, tile.shape)
    return lax.dynamic_update_slice(acc, cur + tile, starts)


def _reduce_to(x5, shape5):
    """Sums a [B, K, G, bq, bk] tile over the axes where ``shape5`` is 1."""
    axes = tuple(d for d, (a, b) in enumerate(zip(x5.shape, shape5)) if b == 1 and a != 1)
    return jnp.sum(x5, axis=axes, keepdims=True) if axes else x5


# ---- block ranges (structure only: causal / window / key padding) ------------------------------


def _fwd_ranges(st, i, bq, bk):
    """Key blocks ``[jlo, jhi)`` seen by query block ``i``, and the all-visible sub-range [ulo, uhi)."""
    nk = _cdiv(st.S, bk)
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


def _bwd_ranges(st, j, bq, bk):
    """Query blocks ``[ilo, ihi)`` that see key block ``j``, and the all-visible sub-range."""
    nq = _cdiv(st.T, bq)
    off = st.diag_offset
    ks = j * bk
    ke = jnp.minimum(ks + bk, st.S)
    lo = jnp.asarray(0, jnp.int32)
    hi = jnp.asarray(st.T, jnp.int32)
    if st.causal:
        lo = jnp.maximum(lo, ks - off)
    if st.window is not None:
        left, right = st.window
        lo = jnp.maximum(lo, ks - off - right)
        hi = jnp.minimum(hi, ke - off + left)
    lo = jnp.clip(lo, 0, st.T)
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


def _banded_loop(lo, ulo, uhi, hi, step, carry, masked_edges: bool):
    """Runs ``step(masked)`` over blocks ``[lo, hi)``; blocks in ``[ulo, uhi)`` need no structural mask."""
    if not masked_edges:
        return lax.fori_loop(lo, hi, step(False), carry)
    carry = lax.fori_loop(lo, ulo, step(True), carry)
    carry = lax.fori_loop(ulo, uhi, step(False), carry)
    return lax.fori_loop(uhi, hi, step(True), carry)


# ---- per-block logits ------------------------------------------------------------------------


def _block_logits(st, qb, kb, b, kh, i, j, bq, bk, structural, data):
    """Scores of one tile of head group (b, kh) in base-2 units (``log2(e) * logits``), [1, 1, G*bq, bk].

    Soft cap, bias and masks applied. ``qb`` is pre-scaled by :func:`_q_scale`. Returns ``(s, t)``
    where ``t`` is ``tanh`` of the soft cap (None without one). Base 2 because ``exp2`` is markedly
    cheaper than ``exp`` on XLA CPU and the softmax is invariant to it (FlashAttention does the same).
    """
    B, K, R, _ = qb.shape
    G = st.G
    s = jnp.einsum("bkrh,bkch->bkrc", qb, kb, precision=_HIGHEST, preferred_element_type=jnp.float32)
    t = None
    if st.cap is not None:
        t = jnp.tanh(s * (1.0 / st.cap))
        s = (st.cap * _LOG2E) * t
    s5 = s.reshape(B, K, G, bq, bk)
    if data.get("bias") is not None:
        s5 = s5 + _dense_tile(data["bias"], b, kh, i, j, bq, bk).astype(jnp.float32) * _LOG2E
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
        mt = _dense_tile(data["mask"], b, kh, i, j, bq, bk)
        m = mt if m is None else m & mt
    if m is not None:
        s5 = jnp.where(m, s5, -jnp.inf)
    return s5.reshape(B, K, R, bk), t


def _q_scale(st):
    """Factor folded into q: ``scale * log2(e)`` (base-2 logits), or ``scale`` under a soft cap."""
    return st.scale if st.cap is not None else st.scale * _LOG2E


def _keep(st, seed, b, kh, i, j, bq, bk):
    G = st.G
    n = (kh * G + jnp.arange(G, dtype=jnp.int32)).reshape(1, 1, G, 1, 1)
    rows = (i * bq + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
    cols = (j * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
    keep = base.dropout_keep_from_seed(
        seed[0], seed[1], jnp.reshape(b, (1, 1, 1, 1, 1)), n, rows, cols, base.dropout_threshold(st.rate)
    )
    return keep.reshape(1, 1, G * bq, bk)


def _data_blocks(st, bias, aux, bq, bk):
    """Per-call data masks in block-friendly layouts (lengths stay [B], segment ids blocked)."""
    Tp, Sp = _cdiv(st.T, bq) * bq, _cdiv(st.S, bk) * bk
    d = dict(q_len=aux["q_len"], kv_len=aux["kv_len"])
    d["bias"] = None if bias is None else _dense_prep(bias, st, Tp, Sp, 0)
    d["mask"] = None if aux["mask"] is None else _dense_prep(aux["mask"], st, Tp, Sp, False)
    if aux["q_seg"] is not None:
        d["q_seg_all"] = _pad_axis(aux["q_seg"], 1, Tp, -1).reshape(st.B, -1, bq).transpose(1, 0, 2)
        d["kv_seg_all"] = _pad_axis(aux["kv_seg"], 1, Sp, -2).reshape(st.B, -1, bk).transpose(1, 0, 2)
    return d


def _tile_data(d, b, i, j):
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


def _varying_axes(*trees):
    """shard_map axes along which any input varies (loop carries must vary along them too)."""
    axes = set()
    for x in jax.tree.leaves(trees):
        t = getattr(jax.typeof(x), "manual_axis_type", None)
        if t is not None:
            axes |= set(t.varying)
    return tuple(sorted(axes))


def _vary(tree, axes):
    if not axes:
        return tree

    def one(x):
        missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


# ---- forward -----------------------------------------------------------------------------------


def _forward(st, q, k, v, bias, aux):
    # One (batch, kv head, query block) per scan step: the matmuls are plain 2-D GEMMs
    # ([G * bq, H] x [H, bk]), which XLA CPU runs markedly faster than the same work batched.
    cdt = jnp.dtype(st.cdt)
    bq, bk = st.bq, st.bk
    qb_all = _q_blocks((q.astype(cdt) * jnp.asarray(_q_scale(st), cdt)), st, bq)
    kb_all = _kv_blocks(k.astype(cdt), bk)
    vb_all = _kv_blocks(v.astype(cdt), bk)
    d = _data_blocks(st, bias, aux, bq, bk)
    B, K, nq, R = st.B, st.K, qb_all.shape[2], st.G * bq
    axes = _varying_axes(q, k, v, bias, aux)

    def q_block(_, xs):
        t, qb = xs
        b, kh, i = t // (K * nq), (t // nq) % K, t % nq
        qb = qb[None, None]

        def step(structural):
            def body(j, carry):
                m_prev, l_prev, acc = carry
                s, _ = _block_logits(
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
                    _tile_data(d, b, i, j),
                )
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp2(s - m_use[..., None])
                alpha = jnp.exp2(m_prev - m_use)
                l_new = alpha * l_prev + jnp.sum(p, axis=-1)
                if st.rate > 0:
                    p = jnp.where(_keep(st, aux["seed"], b, kh, i, j, bq, bk), p, 0.0)
                pv = jnp.einsum(
                    "bkrc,bkcv->bkrv",
                    p.astype(cdt),
                    vb_all[b, kh, j][None, None],
                    precision=_HIGHEST,
                    preferred_element_type=jnp.float32,
                )
                return m_new, l_new, acc * alpha[..., None] + pv

            return body

        jlo, ulo, uhi, jhi = _fwd_ranges(st, i, bq, bk)
        carry = _vary(
            (
                jnp.full((1, 1, R), -jnp.inf, jnp.float32),
                jnp.zeros((1, 1, R), jnp.float32),
                jnp.zeros((1, 1, R, st.Hv), jnp.float32),
            ),
            axes,
        )
        carry = _banded_loop(jlo, ulo, uhi, jhi, step, carry, st.structural or st.S % bk > 0)
        m, l, acc = carry
        if st.rate > 0:
            acc = acc * (1.0 / (1.0 - st.rate))
        out = acc / jnp.where(l == 0, 1.0, l)[..., None]
        lse = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(jnp.where(l == 0, 1.0, l))) * _LN2)
        return None, (out[0, 0], lse[0, 0])

    n = B * K * nq
    _, (ob, lseb) = lax.scan(q_block, None, (jnp.arange(n, dtype=jnp.int32), qb_all.reshape(n, R, st.H)))
    out = _q_unblock(ob.reshape(B, K, nq, R, st.Hv), st, bq).astype(st.out_dtype)
    lse = _row_unblock(lseb.reshape(B, K, nq, R), st, bq)
    return out, lse


# ---- backward ----------------------------------------------------------------------------------


def _backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
    cdt = jnp.dtype(st.cdt)
    bq, bk = st.bq_b, st.bk_b
    G, R = st.G, st.G * bq
    qb_all = _q_blocks((q.astype(cdt) * jnp.asarray(_q_scale(st), cdt)), st, bq)
    kb_all = _kv_blocks(k.astype(cdt), bk)
    vb_all = _kv_blocks(v.astype(cdt), bk)
    do_all = _q_blocks(g_out.astype(cdt), st, bq)
    delta = jnp.einsum(
        "btnv,btnv->bnt", g_out.astype(jnp.float32), out.astype(jnp.float32), precision=_HIGHEST
    )
    if g_lse is not None:
        delta = delta - g_lse.astype(jnp.float32)
    delta_all = _row_blocks(delta, st, bq, 0.0)
    # Rows with lse = -inf (fully masked) and padded rows get +inf so P = exp(s - lse) = 0.
    lse_all = _row_blocks(jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E), st, bq, jnp.inf)
    d = _data_blocks(st, bias, aux, bq, bk)
    B, K, nk = st.B, st.K, kb_all.shape[2]
    axes = _varying_axes(q, k, v, bias, aux, out, lse, g_out, g_lse)
    dq0 = _vary(jnp.zeros(qb_all.shape, jnp.float32), axes)
    db0 = None if d["bias"] is None else _vary(jnp.zeros(d["bias"].shape, jnp.float32), axes)

    def k_block(carry, xs):
        dq_all, db_all = carry
        u, kb, vb = xs
        b, kh, j = u // (K * nk), (u // nk) % K, u % nk
        kb, vb = kb[None, None], vb[None, None]

        def step(structural):
            def body(i, c):
                dk, dv, dq_all, db_all = c
                qb, dob = qb_all[b, kh, i][None, None], do_all[b, kh, i][None, None]
                s, t = _block_logits(st, qb, kb, b, kh, i, j, bq, bk, structural, _tile_data(d, b, i, j))
                p = jnp.exp2(s - lse_all[b, kh, i][None, None, :, None])
                dp = jnp.einsum(
                    "bkrv,bkcv->bkrc", dob, vb, precision=_HIGHEST, preferred_element_type=jnp.float32
                )
                if st.rate > 0:
                    keep = _keep(st, aux["seed"], b, kh, i, j, bq, bk)
                    inv = 1.0 / (1.0 - st.rate)
                    pd = jnp.where(keep, p * inv, 0.0)
                    dp = jnp.where(keep, dp * inv, 0.0)
                else:
                    pd = p
                # dV^T and dK^T are accumulated transposed: XLA CPU runs X^T P ~4x faster than P^T X.
                dv = dv + jnp.einsum(
                    "bkrv,bkrc->bkvc",
                    dob,
                    pd.astype(cdt),
                    precision=_HIGHEST,
                    preferred_element_type=jnp.float32,
                )
                ds = p * (dp - delta_all[b, kh, i][None, None, :, None])
                if db_all is not None:
                    bs = d["bias"].shape
                    tile = _reduce_to(
                        ds.reshape(1, 1, G, bq, bk),
                        (1, 1, bs[2], 1 if bs[3] == 1 else bq, 1 if bs[4] == 1 else bk),
                    )
                    db_all = _dense_untile_add(db_all, tile, b, kh, i, j, bq, bk)
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds.astype(cdt)
                dk = dk + jnp.einsum(
                    "bkrh,bkrc->bkhc", qb, ds, precision=_HIGHEST, preferred_element_type=jnp.float32
                )
                dq_i = jnp.einsum(
                    "bkrc,bkch->bkrh", ds, kb, precision=_HIGHEST, preferred_element_type=jnp.float32
                )
                dq_all = dq_all.at[b, kh, i].add(dq_i[0, 0])
                return dk, dv, dq_all, db_all

            return body

        ilo, ulo, uhi, ihi = _bwd_ranges(st, j, bq, bk)
        c = (
            *_vary(
                (jnp.zeros((1, 1, st.H, bk), jnp.float32), jnp.zeros((1, 1, st.Hv, bk), jnp.float32)), axes
            ),
            dq_all,
            db_all,
        )
        c = _banded_loop(ilo, ulo, uhi, ihi, step, c, st.structural or st.S % bk > 0)
        dk, dv, dq_all, db_all = c
        dk, dv = dk[0, 0].T, dv[0, 0].T
        if st.cap is None:  # qb carries a log2(e) factor that the logits gradient must not.
            dk = dk * _LN2
        return (dq_all, db_all), (dk, dv)

    n = B * K * nk
    (dq_all, db_all), (dk_all, dv_all) = lax.scan(
        k_block,
        (dq0, db0),
        (jnp.arange(n, dtype=jnp.int32), kb_all.reshape(n, bk, st.H), vb_all.reshape(n, bk, st.Hv)),
    )
    dq = (_q_unblock(dq_all, st, bq) * st.scale).astype(q.dtype)
    dk = _kv_unblock(dk_all.reshape(B, K, nk, bk, st.H), st.S).astype(k.dtype)
    dv = _kv_unblock(dv_all.reshape(B, K, nk, bk, st.Hv), st.S).astype(v.dtype)
    dbias = None
    if bias is not None:
        Bb, Nb, Tb, Sb = bias.shape
        dbias = db_all[:, :, :, :Tb, :Sb].reshape(Bb, Nb, Tb, Sb).astype(bias.dtype)
    return dq, dk, dv, dbias
