"""FlashAttention-2 in plain XLA: blockwise online softmax, O(L x block) memory forward and backward.

This is the CPU path of ``SDPBackend.FLASH_ATTENTION`` (and a portable fallback elsewhere). The
algorithm is FlashAttention-2 (Dao, 2023, arXiv:2307.08691):

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
  >>> out, lse = xla_flash.attention(args, config=xla_flash.Config(block_q=128, block_k=128))
  >>> ref, _ = base.reference(args)
  >>> bool(jnp.allclose(out, ref, atol=1e-5))
  True
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention import base

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
    """Block sizes for ``args``: 512 x 512 tiles (measured best on CPU for head dim 64-128),
    shrunk to the (8-rounded) sequence lengths for short sequences; smaller key blocks for large
    head dims / GQA groups so one ``[G * block_q, block_k]`` score tile stays a few MiB."""
    del platform

    def fit(n, b):
      return max(1, min(b, -(-n // 8) * 8))

    bq, bk = 512, 512
    if args.groups * args.num_kv_heads * args.head_dim >= 2048:
      bq = 256
    return cls(block_q=fit(args.q_len, bq), block_k=fit(args.kv_len, bk))


def unsupported(args: base.AttentionArgs, platform: str) -> list:
  """Reasons this implementation cannot run ``args`` (empty if it can). Runs on any platform."""
  del platform
  reasons = []
  if args.bias is not None:
    reasons.append("FLASH takes no additive bias / float attn_mask (EFFICIENT_ATTENTION or MATH do)")
  if args.mask is not None:
    reasons.append("FLASH takes no arbitrary boolean attn_mask (use is_causal / window / lengths / "
                   "segment ids, or EFFICIENT_ATTENTION / MATH)")
  return reasons


def attention(args: base.AttentionArgs, *, config: Optional[Config] = None, **opts):
  """XLA flash attention: ``(out [B, T, N, Hv] q.dtype, lse [B, N, T] float32)``.

  Differentiable (``jax.vjp``) w.r.t. q, k, v; the backward recomputes per block.
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
  q, k, v = args.q, args.k, args.v
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  bq, bk = min(config.block_q, T), min(config.block_k, S)
  bq_b, bk_b = config.bwd
  bq_b, bk_b = min(bq_b, T), min(bk_b, S)
  st = _Static(
      B=B, T=T, S=S, N=N, K=K, H=H, Hv=Hv, scale=args.scale, causal=args.causal,
      diag_offset=args.diag_offset, window=args.window, cap=args.logits_soft_cap,
      rate=args.dropout_rate, bq=max(bq, 1), bk=max(bk, 1), bq_b=max(bq_b, 1), bk_b=max(bk_b, 1),
      cdt=config.compute_dtype, out_dtype=jnp.dtype(q.dtype).name,
      bias_shape=None if args.bias is None else tuple(args.bias.shape),
      bias_dtype=None if args.bias is None else jnp.dtype(args.bias.dtype).name,
      mask_shape=None if args.mask is None else tuple(args.mask.shape))
  aux = dict(mask=args.mask, q_len=args.q_seq_lengths, kv_len=args.kv_seq_lengths,
             q_seg=args.q_segment_ids, kv_seg=args.kv_segment_ids,
             seed=None if args.dropout_rng is None else base.dropout_seed(args.dropout_rng))
  if T == 0 or S == 0:
    out = jnp.zeros((B, T, N, Hv), q.dtype)
    return out, jnp.full((B, N, T), -jnp.inf, jnp.float32)
  return _flash(st, q, k, v, args.bias, aux)


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
  """[B, T, N, D] -> [nq, B, K, G * bq, D] (the G heads of a group stacked on the rows)."""
  B, T, N, D = x.shape
  nq = _cdiv(T, bq)
  x = _pad_axis(x, 1, nq * bq)
  x = x.reshape(B, nq, bq, st.K, st.G, D).transpose(1, 0, 3, 4, 2, 5)
  return x.reshape(nq, B, st.K, st.G * bq, D)


def _q_unblock(xb, st, bq):
  nq, B, K, _, D = xb.shape
  x = xb.reshape(nq, B, K, st.G, bq, D).transpose(1, 0, 4, 2, 3, 5)
  return x.reshape(B, nq * bq, st.N, D)[:, :st.T]


def _row_blocks(x, st, bq, value):
  """[B, N, T] -> [nq, B, K, G * bq]."""
  B, N, T = x.shape
  nq = _cdiv(T, bq)
  x = _pad_axis(x, 2, nq * bq, value)
  x = x.reshape(B, st.K, st.G, nq, bq).transpose(3, 0, 1, 2, 4)
  return x.reshape(nq, B, st.K, st.G * bq)


def _row_unblock(xb, st, bq):
  nq, B, K, _ = xb.shape
  x = xb.reshape(nq, B, K, st.G, bq).transpose(1, 2, 3, 0, 4)
  return x.reshape(B, st.N, nq * bq)[:, :, :st.T]


def _kv_blocks(x, bk):
  """[B, S, K, D] -> [nk, B, K, bk, D]."""
  B, S, K, D = x.shape
  nk = _cdiv(S, bk)
  x = _pad_axis(x, 1, nk * bk)
  return x.reshape(B, nk, bk, K, D).transpose(1, 0, 3, 2, 4)


def _kv_unblock(xb, S):
  nk, B, K, bk, D = xb.shape
  return xb.transpose(1, 0, 3, 2, 4).reshape(B, nk * bk, K, D)[:, :S]


def _dense_prep(x, st, Tp, Sp, value):
  """[Bb, Nb, Tb, Sb] (broadcastable) -> [Bb, Kb, Gb, Tb', Sb'] padded to (Tp, Sp) where not 1."""
  Bb, Nb, Tb, Sb = x.shape
  x = x.reshape(Bb, st.K, st.G, Tb, Sb) if Nb == st.N and Nb > 1 else x.reshape(Bb, 1, 1, Tb, Sb)
  if Tb > 1:
    x = _pad_axis(x, 3, Tp, value)
  if Sb > 1:
    x = _pad_axis(x, 4, Sp, value)
  return x


def _dense_tile(xp, i, j, bq, bk):
  starts = [0, 0, 0, 0, 0]
  sizes = list(xp.shape)
  if xp.shape[3] > 1:
    starts[3], sizes[3] = i * bq, bq
  if xp.shape[4] > 1:
    starts[4], sizes[4] = j * bk, bk
  return lax.dynamic_slice(xp, starts, sizes)


def _dense_untile_add(acc, tile, i, j, bq, bk):
  starts = [0, 0, 0, 0, 0]
  if acc.shape[3] > 1:
    starts[3] = i * bq
  if acc.shape[4] > 1:
    starts[4] = j * bk
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

def _block_logits(st, qb, kb, i, j, bq, bk, structural, data):
  """Scores of one tile in base-2 units (``log2(e) * logits``), [B, K, G*bq, bk] f32.

  Soft cap, bias and masks applied. ``qb`` is pre-scaled by :func:`_q_scale`. Returns ``(s, t)``
  where ``t`` is ``tanh`` of the soft cap (None without one). Base 2 because ``exp2`` is markedly
  cheaper than ``exp`` on XLA CPU and the softmax is invariant to it (FlashAttention does the same).
  """
  B, K, R, _ = qb.shape
  G = st.G
  s = jnp.einsum("bkrh,bkch->bkrc", qb, kb, precision=_HIGHEST,
                 preferred_element_type=jnp.float32)
  t = None
  if st.cap is not None:
    t = jnp.tanh(s * (1.0 / st.cap))
    s = (st.cap * _LOG2E) * t
  s5 = s.reshape(B, K, G, bq, bk)
  if data.get("bias") is not None:
    s5 = s5 + _dense_tile(data["bias"], i, j, bq, bk).astype(jnp.float32) * _LOG2E
  rows = (i * bq + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
  cols = (j * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
  m = None
  if structural:
    m = base.index_mask(rows, cols, causal=st.causal, diag_offset=st.diag_offset,
                        window=st.window)
    if st.S % bk:
      m = cols < st.S if m is None else m & (cols < st.S)
  extra = base.index_mask(
      rows, cols,
      q_len=None if data.get("q_len") is None else data["q_len"].reshape(-1, 1, 1, 1, 1),
      kv_len=None if data.get("kv_len") is None else data["kv_len"].reshape(-1, 1, 1, 1, 1),
      q_seg=None if data.get("q_seg") is None else data["q_seg"].reshape(-1, 1, 1, bq, 1),
      kv_seg=None if data.get("kv_seg") is None else data["kv_seg"].reshape(-1, 1, 1, 1, bk))
  if extra is not None:
    m = extra if m is None else m & extra
  if data.get("mask") is not None:
    mt = _dense_tile(data["mask"], i, j, bq, bk)
    m = mt if m is None else m & mt
  if m is not None:
    s5 = jnp.where(m, s5, -jnp.inf)
  return s5.reshape(B, K, R, bk), t


def _q_scale(st):
  """Factor folded into q: ``scale * log2(e)`` (base-2 logits), or ``scale`` under a soft cap."""
  return st.scale if st.cap is not None else st.scale * _LOG2E


def _keep(st, seed, i, j, bq, bk):
  B, K, G = st.B, st.K, st.G
  b = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1, 1)
  n = (jnp.arange(K, dtype=jnp.int32)[:, None] * G
       + jnp.arange(G, dtype=jnp.int32)[None, :]).reshape(1, K, G, 1, 1)
  rows = (i * bq + jnp.arange(bq, dtype=jnp.int32)).reshape(1, 1, 1, bq, 1)
  cols = (j * bk + jnp.arange(bk, dtype=jnp.int32)).reshape(1, 1, 1, 1, bk)
  keep = base.dropout_keep_from_seed(seed[0], seed[1], b, n, rows, cols,
                                     base.dropout_threshold(st.rate))
  return keep.reshape(B, K, G * bq, bk)


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


def _tile_data(d, i, j):
  out = dict(bias=d["bias"], mask=d["mask"], q_len=d["q_len"], kv_len=d["kv_len"])
  if "q_seg_all" in d:
    out["q_seg"] = d["q_seg_all"][i]
    out["kv_seg"] = d["kv_seg_all"][j]
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
  cdt = jnp.dtype(st.cdt)
  bq, bk = st.bq, st.bk
  qb_all = _q_blocks((q.astype(cdt) * jnp.asarray(_q_scale(st), cdt)), st, bq)
  kb_all = _kv_blocks(k.astype(cdt), bk)
  vb_all = _kv_blocks(v.astype(cdt), bk)
  d = _data_blocks(st, bias, aux, bq, bk)
  B, K, R = st.B, st.K, st.G * bq
  axes = _varying_axes(q, k, v, bias, aux)

  def q_block(_, xs):
    i, qb = xs

    def step(structural):
      def body(j, carry):
        m_prev, l_prev, acc = carry
        s, _ = _block_logits(st, qb, kb_all[j], i, j, bq, bk, structural, _tile_data(d, i, j))
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_use[..., None])
        alpha = jnp.exp2(m_prev - m_use)
        l_new = alpha * l_prev + jnp.sum(p, axis=-1)
        if st.rate > 0:
          keep = _keep(st, aux["seed"], i, j, bq, bk)
          p = jnp.where(keep, p, 0.0)
        pv = jnp.einsum("bkrc,bkcv->bkrv", p.astype(cdt), vb_all[j], precision=_HIGHEST,
                        preferred_element_type=jnp.float32)
        return m_new, l_new, acc * alpha[..., None] + pv
      return body

    jlo, ulo, uhi, jhi = _fwd_ranges(st, i, bq, bk)
    carry = _vary((jnp.full((B, K, R), -jnp.inf, jnp.float32), jnp.zeros((B, K, R), jnp.float32),
                   jnp.zeros((B, K, R, st.Hv), jnp.float32)), axes)
    carry = _banded_loop(jlo, ulo, uhi, jhi, step, carry, st.structural or st.S % bk > 0)
    m, l, acc = carry
    if st.rate > 0:
      acc = acc * (1.0 / (1.0 - st.rate))
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]
    lse = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(jnp.where(l == 0, 1.0, l))) * _LN2)
    return None, (out, lse)

  nq = qb_all.shape[0]
  _, (ob, lseb) = lax.scan(q_block, None, (jnp.arange(nq, dtype=jnp.int32), qb_all))
  out = _q_unblock(ob, st, bq).astype(st.out_dtype)
  lse = _row_unblock(lseb, st, bq)
  return out, lse


# ---- backward ----------------------------------------------------------------------------------

def _backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
  cdt = jnp.dtype(st.cdt)
  bq, bk = st.bq_b, st.bk_b
  B, K, R = st.B, st.K, st.G * bq
  qb_all = _q_blocks((q.astype(cdt) * jnp.asarray(_q_scale(st), cdt)), st, bq)
  kb_all = _kv_blocks(k.astype(cdt), bk)
  vb_all = _kv_blocks(v.astype(cdt), bk)
  do_all = _q_blocks(g_out.astype(cdt), st, bq)
  delta = jnp.einsum("btnv,btnv->bnt", g_out.astype(jnp.float32), out.astype(jnp.float32),
                     precision=_HIGHEST)
  if g_lse is not None:
    delta = delta - g_lse.astype(jnp.float32)
  delta_all = _row_blocks(delta, st, bq, 0.0)
  # Rows with lse = -inf (fully masked) and padded rows get +inf so P = exp(s - lse) = 0.
  lse_all = _row_blocks(jnp.where(lse == -jnp.inf, jnp.inf, lse * _LOG2E), st, bq, jnp.inf)
  d = _data_blocks(st, bias, aux, bq, bk)
  nq, nk = qb_all.shape[0], kb_all.shape[0]
  axes = _varying_axes(q, k, v, bias, aux, out, lse, g_out, g_lse)
  dq0 = _vary(jnp.zeros(qb_all.shape, jnp.float32), axes)
  db0 = None if d["bias"] is None else _vary(jnp.zeros(d["bias"].shape, jnp.float32), axes)

  def k_block(carry, xs):
    dq_all, db_all = carry
    j, kb, vb = xs

    def step(structural):
      def body(i, c):
        dk, dv, dq_all, db_all = c
        qb, dob = qb_all[i], do_all[i]
        s, t = _block_logits(st, qb, kb, i, j, bq, bk, structural, _tile_data(d, i, j))
        p = jnp.exp2(s - lse_all[i][..., None])
        dp = jnp.einsum("bkrv,bkcv->bkrc", dob, vb, precision=_HIGHEST,
                        preferred_element_type=jnp.float32)
        if st.rate > 0:
          keep = _keep(st, aux["seed"], i, j, bq, bk)
          inv = 1.0 / (1.0 - st.rate)
          pd = jnp.where(keep, p * inv, 0.0)
          dp = jnp.where(keep, dp * inv, 0.0)
        else:
          pd = p
        # dV^T and dK^T are accumulated transposed: XLA CPU runs X^T P ~4x faster than P^T X.
        dv = dv + jnp.einsum("bkrv,bkrc->bkvc", dob, pd.astype(cdt), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
        ds = p * (dp - delta_all[i][..., None])
        if db_all is not None:
          tile = _reduce_to(ds.reshape(B, K, st.G, bq, bk), d["bias"].shape[:3] + (
              1 if d["bias"].shape[3] == 1 else bq, 1 if d["bias"].shape[4] == 1 else bk))
          db_all = _dense_untile_add(db_all, tile, i, j, bq, bk)
        if t is not None:
          ds = ds * (1.0 - t * t)
        ds = ds.astype(cdt)
        dk = dk + jnp.einsum("bkrh,bkrc->bkhc", qb, ds, precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bkrc,bkch->bkrh", ds, kb, precision=_HIGHEST,
                          preferred_element_type=jnp.float32)
        dq_all = dq_all.at[i].add(dq_i)
        return dk, dv, dq_all, db_all
      return body

    ilo, ulo, uhi, ihi = _bwd_ranges(st, j, bq, bk)
    c = (*_vary((jnp.zeros((B, K, st.H, bk), jnp.float32),
                 jnp.zeros((B, K, st.Hv, bk), jnp.float32)), axes), dq_all, db_all)
    c = _banded_loop(ilo, ulo, uhi, ihi, step, c, st.structural or st.S % bk > 0)
    dk, dv, dq_all, db_all = c
    dk, dv = jnp.swapaxes(dk, -1, -2), jnp.swapaxes(dv, -1, -2)
    if st.cap is None:  # qb carries a log2(e) factor that the logits gradient must not.
      dk = dk * _LN2
    return (dq_all, db_all), (dk, dv)

  (dq_all, db_all), (dk_all, dv_all) = lax.scan(
      k_block, (dq0, db0), (jnp.arange(nk, dtype=jnp.int32), kb_all, vb_all))
  del nq
  dq = (_q_unblock(dq_all, st, bq) * st.scale).astype(q.dtype)
  dk = _kv_unblock(dk_all, st.S).astype(k.dtype)
  dv = _kv_unblock(dv_all, st.S).astype(v.dtype)
  dbias = None
  if bias is not None:
    Bb, Nb, Tb, Sb = bias.shape
    dbias = db_all[:, :, :, :Tb, :Sb].reshape(Bb, Nb, Tb, Sb).astype(bias.dtype)
  return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, bias, aux):
  return _forward(st, q, k, v, bias, aux)


def _flash_fwd(st, q, k, v, bias, aux):
  out, lse = _forward(st, q, k, v, bias, aux)
  return (out, lse), (q, k, v, bias, aux, out, lse)


def _flash_bwd(st, res, g):
  q, k, v, bias, aux, out, lse = res
  g_out, g_lse = g
  if isinstance(g_lse, jax.custom_derivatives.SymbolicZero):  # pragma: no cover
    g_lse = None
  dq, dk, dv, dbias = _backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse)
  return dq, dk, dv, dbias, None


_flash.defvjp(_flash_fwd, _flash_bwd)
