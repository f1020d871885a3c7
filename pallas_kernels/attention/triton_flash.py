"""Flash attention on GPU: a Pallas (Triton backend) forward kernel, differentiable.

FlashAttention-2 (Dao, 2023, https://arxiv.org/abs/2307.08691): the grid runs over
``(query block, query head, batch)``; each program keeps one ``[block_q, H]`` query tile on chip and
scans the key/value blocks it can see with an online softmax (section 3.1.1: an unscaled accumulator
``acc``, the running row maximum ``m`` and the running denominator ``l``, rescaled by
``exp(m_old - m_new)`` at each step). The scan runs in base 2 (``exp2``) with ``log2(e)`` folded
into the logits; the LSE written out is the natural-log one the backward pass (:mod:`flash_vjp`) and
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
:mod:`mem_efficient`. This module's :func:`attention` (the ``flash`` backend) refuses bias / mask
like torch's flash backend does.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, flash
  >>> q = jax.random.normal(jax.random.key(0), (1, 20, 2, 32), jnp.float32)
  >>> args = base.make_args(q, q, q, is_causal=True)
  >>> out, lse = flash.attention(args, interpret=True)  # interpret=True: runs on CPU
  >>> ref, _ = base.reference(args)
  >>> bool(jnp.allclose(out, ref, atol=1e-4))
  True
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu, triton_backend
from pallas_kernels.attention import base

Array = Any

__all__ = ["Config", "heuristics", "unsupported", "attention", "forward", "GPU_PLATFORMS"]

#: Lowering platforms the Triton kernels run on.
GPU_PLATFORMS = gpu.GPU_PLATFORMS
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_MAX_HEAD_DIM = 256
_KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile sizes and launch parameters of the forward kernel.

  Attributes:
    block_q: query rows per program (power of two >= 16; shrunk to the sequence when shorter).
    block_k: keys per inner step (power of two >= 16).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the key loop.
  """
  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"Config.{name} must be a power of two >= 16; got {name}={v!r}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"Config.num_warps must be one of 1, 2, 4, 8, 16; got {self.num_warps=}")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"Config.num_stages must be an int >= 1; got {self.num_stages=}")


def heuristics(head_dim: int, dtype=jnp.bfloat16, compute_capability: Optional[int] = None) -> Config:
  """A sensible forward :class:`Config` by head dim, dtype and GPU generation.

  Args:
    head_dim: the (unpadded) query/key head dim.
    dtype: input dtype; float32 tiles take twice the shared memory, so they get smaller blocks.
    compute_capability: e.g. 75 (T4), 80 (A100), 90 (H100); None means "Ampere or newer".

  Example:
    >>> from pallas_kernels.attention import flash
    >>> flash.heuristics(64).block_q
    128
  """
  cc = 80 if compute_capability is None else compute_capability
  hp = _pad_dim(head_dim)
  wide = jnp.dtype(dtype).itemsize >= 4
  if cc < 80:  # Turing: 64 KiB shared memory, no async copies.
    if hp > 128 and wide:
      return Config(block_q=32, block_k=16, num_warps=4, num_stages=1)
    return Config(block_q=64, block_k=32 if hp > 64 or wide else 64, num_warps=4, num_stages=1)
  if hp <= 64:
    return Config(block_q=128, block_k=64 if wide else 128, num_warps=4,
                  num_stages=3 if cc >= 90 else 2)
  if hp <= 128:
    return Config(block_q=128, block_k=32 if wide else 64, num_warps=8 if cc >= 90 else 4,
                  num_stages=2)
  if wide:  # float32 at head dim 256: 1 KiB per row
    return Config(block_q=32, block_k=32, num_warps=8 if cc >= 90 else 4, num_stages=2)
  return Config(block_q=64, block_k=32, num_warps=8 if cc >= 90 else 4, num_stages=2)


@functools.lru_cache(maxsize=None)
def local_compute_capability() -> Optional[int]:
  """Compute capability of the GPU being lowered for (e.g. 90): see :func:`pallas_kernels.gpu.compute_capability`."""
  return gpu.compute_capability()


def _pad_dim(h: int) -> int:
  return max(16, pl.next_power_of_2(h))


def _block(requested: int, length: int) -> int:
  """The block size actually used: ``requested``, shrunk for short sequences (>= 16 for ``dot``)."""
  return min(requested, max(16, pl.next_power_of_2(length)))


# ----------------------------------------------------------------------------------------------
# Static description of a call, shared by the forward, backward and decode kernels.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
  """Everything static a kernel body needs (hashable; derived from :class:`base.AttentionArgs`)."""
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
  bias_shape: Optional[Tuple[int, int, int, int]]
  mask_shape: Optional[Tuple[int, int, int, int]]
  allow_tf32: bool

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def Hp(self) -> int:
    return _pad_dim(self.H)

  @property
  def Hvp(self) -> int:
    return _pad_dim(self.Hv)

  @property
  def precision(self):
    return lax.Precision.HIGH if self.allow_tf32 else None

  @property
  def keep_scale(self) -> float:
    return 1.0 / (1.0 - self.dropout_rate)

  @property
  def dropout_threshold(self) -> int:
    return base.dropout_threshold(self.dropout_rate)


def make_spec(args: base.AttentionArgs, *, allow_tf32: bool = False) -> Spec:
  return Spec(
      B=args.batch, T=args.q_len, S=args.kv_len, N=args.num_heads, K=args.num_kv_heads,
      H=args.head_dim, Hv=args.v_head_dim, scale=args.scale, causal=args.causal,
      diag_offset=args.diag_offset, window=args.window, softcap=args.logits_soft_cap,
      dropout_rate=args.dropout_rate, has_q_len=args.q_seq_lengths is not None,
      has_kv_len=args.kv_seq_lengths is not None, has_segments=args.q_segment_ids is not None,
      bias_shape=None if args.bias is None else tuple(args.bias.shape),
      mask_shape=None if args.mask is None else tuple(args.mask.shape),
      allow_tf32=bool(allow_tf32 and args.dtype == jnp.float32))


def dropout_seed_words(args: base.AttentionArgs):
  """``uint32[2]`` seed words for the in-kernel keep-mask (None without dropout)."""
  return base.dropout_seed(args.dropout_rng, (args.q, args.k, args.v)) if args.has_dropout else None


# ----------------------------------------------------------------------------------------------
# Kernel-body helpers (plain jnp on tiles; shared with flash_vjp / mem_efficient / decode).
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


def load_tile(ref, start, size: int, limit: int, dim: int, dim_p: int, *, ragged: bool, head=None):
  """A ``[size, dim_p]`` tile of a ``[L, dim]`` ref at rows ``start``: zero past ``limit`` / ``dim``."""
  rows = start + jnp.arange(size, dtype=jnp.int32)
  cols = jnp.arange(dim_p, dtype=jnp.int32)
  mask = None
  if ragged:
    mask = (rows < limit)[:, None]
  if dim != dim_p:
    cm = (cols < dim)[None, :]
    mask = cm if mask is None else mask & cm
  if mask is not None and mask.shape != (size, dim_p):
    mask = jnp.broadcast_to(mask, (size, dim_p))
  ref = _tile_index(ref, start, size, head)
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=0)


def store_tile(ref, value, start, size: int, limit: int, dim: int, *, ragged: bool, head=None):
  """Stores ``value [size, dim_p]`` to a ``[L, dim]`` ref at rows ``start``, masked like :func:`load_tile`."""
  dim_p = value.shape[1]
  rows = start + jnp.arange(size, dtype=jnp.int32)
  cols = jnp.arange(dim_p, dtype=jnp.int32)
  mask = None
  if ragged:
    mask = (rows < limit)[:, None]
  if dim != dim_p:
    cm = (cols < dim)[None, :]
    mask = cm if mask is None else mask & cm
  if mask is not None and mask.shape != (size, dim_p):
    mask = jnp.broadcast_to(mask, (size, dim_p))
  ref = _tile_index(ref, start, size, head)
  plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def load_bias_like(ref, shape4, spec: Spec, q_start, block_q: int, k_start, block_k: int, *,
                   other, head=None):
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


def logits_mask(spec: Spec, rows, cols, *, q_len=None, kv_len=None, q_seg=None, kv_seg=None,
                mask_tile=None, force_bounds: bool = False, key_bounds: bool = True):
  """The "attend" mask of a ``[bq, bk]`` tile (None when nothing masks).

  ``rows [bq, 1]`` / ``cols [1, bk]`` are global indices. Keys ``>= S`` are always masked when the
  tile can reach past ``S``; queries ``>= T`` too when ``force_bounds`` (backward pass).
  """
  m = base.index_mask(rows, cols, causal=spec.causal, diag_offset=spec.diag_offset,
                      window=spec.window, q_len=q_len, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)

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


def dropout_keep(spec: Spec, seed_ref, b, n, rows, cols):
  """Keep bits of a ``[bq, bk]`` tile: :func:`base.dropout_keep_from_seed` on global indices."""
  return base.dropout_keep_from_seed(seed_ref[0], seed_ref[1], b, n, rows, cols,
                                     spec.dropout_threshold)


def key_block_range(spec: Spec, q_start, q_stop, block_k: int, *, q_len=None, kv_len=None):
  """Key blocks ``[lo, hi)`` that query rows ``[q_start, q_stop)`` may attend to (block skipping)."""
  lo, hi = base.key_range(q_start, q_stop, spec.S, causal=spec.causal,
                          diag_offset=spec.diag_offset, window=spec.window)
  if kv_len is not None:
    hi = jnp.minimum(hi, kv_len)
  if q_len is not None:
    hi = jnp.where(q_start >= q_len, 0, hi)
  return block_range(lo, hi, block_k)


def query_block_range(spec: Spec, k_start, k_stop, block_q: int, *, q_len=None, kv_len=None):
  """Query blocks ``[lo, hi)`` whose rows may attend to keys ``[k_start, k_stop)``."""
  d = spec.diag_offset
  lo, hi = jnp.int32(0), jnp.int32(spec.T)
  if spec.causal:
    lo = jnp.maximum(lo, k_start - d)
  if spec.window is not None:
    left, right = spec.window
    lo = jnp.maximum(lo, k_start - d - right)
    hi = jnp.minimum(hi, k_stop - d + left)
  if q_len is not None:
    hi = jnp.minimum(hi, q_len)
  if kv_len is not None:
    hi = jnp.where(k_start >= kv_len, 0, hi)
  lo = jnp.clip(lo, 0, spec.T)
  return block_range(lo, hi, block_q)


def block_range(lo, hi, block: int):
  """Blocks ``[lo // block, cdiv(hi, block))`` covering ``[lo, hi)``; empty when ``hi <= lo``."""
  first = lo // block
  return first, jnp.where(hi > lo, (hi + block - 1) // block, first)


# ----------------------------------------------------------------------------------------------
# Multi-platform lowering of a Triton pallas_call.
# ----------------------------------------------------------------------------------------------
#
# `jax.lax.platform_dependent(cpu=xla_path, cuda=triton_path)` lowers *both* branches for every
# lowering platform of the module, and a Triton `pallas_call` refuses to lower for "cpu" ("Only
# interpret mode is supported on CPU backend"), so an export for ("cpu", "cuda") failed. This
# primitive wraps the pallas_call: on "cuda" it lowers to the Triton kernel; in a multi-platform
# lowering its other-platform branch (never selected by the dispatch's platform_dependent) is the
# same kernel in interpret mode, i.e. plain, correct HLO. Lowered for "cpu" alone it raises, like
# Pallas does.

_gpu_call_p = jex_core.Primitive("jb_pallas_triton_call")
_gpu_call_p.multiple_results = True


def _gpu_call_impl(*args, gpu, cpu):
  del cpu
  return jex_core.jaxpr_as_fun(gpu)(*args)


def _gpu_call_abstract_eval(*avals, gpu, cpu):
  del avals, cpu
  return list(gpu.out_avals)


def _gpu_call_lower_gpu(ctx, *args, gpu, cpu):
  del cpu
  return mlir.lower_fun(jex_core.jaxpr_as_fun(gpu), multiple_results=True)(ctx, *args)


def _gpu_call_lower_other(ctx, *args, gpu, cpu):
  del gpu
  platforms = ctx.platforms or ctx.module_context.platforms
  if len(ctx.module_context.platforms) == 1:
    raise ValueError(f"the Pallas Triton attention kernels lower for CUDA only, not for "
                     f"{tuple(platforms)}; pass interpret=True (testing) or use the XLA backend")
  return mlir.lower_fun(jex_core.jaxpr_as_fun(cpu), multiple_results=True)(ctx, *args)


def _gpu_call_batch(args, dims, *, gpu, cpu):
  axes = [d if isinstance(d, int) else None for d in dims]  # not-mapped dims are None here
  fg = jax.vmap(jex_core.jaxpr_as_fun(gpu), in_axes=axes)
  fc = jax.vmap(jex_core.jaxpr_as_fun(cpu), in_axes=axes)
  outs = _bind_gpu_call(fg, fc, args)
  return outs, [0] * len(outs)


def _bind_gpu_call(fn_gpu, fn_cpu, leaves):
  gpu = jax.make_jaxpr(lambda *a: tuple(fn_gpu(*a)))(*leaves)
  cpu = jax.make_jaxpr(lambda *a: tuple(fn_cpu(*a)))(*leaves)
  return _gpu_call_p.bind(*leaves, gpu=gpu, cpu=cpu)


_gpu_call_p.def_impl(_gpu_call_impl)
_gpu_call_p.def_abstract_eval(_gpu_call_abstract_eval)
mlir.register_lowering(_gpu_call_p, _gpu_call_lower_other)
for _p in ("cuda", "rocm"):
  mlir.register_lowering(_gpu_call_p, _gpu_call_lower_gpu, platform=_p)
batching.primitive_batchers[_gpu_call_p] = _gpu_call_batch


def triton_call(make_call: Callable, operands: tuple, *, interpret: bool):
  """Runs ``make_call(interpret)(*operands)`` (a ``pl.pallas_call``; ``None`` operands allowed).

  With ``interpret=False`` the call is wrapped so that it also lowers inside a multi-platform
  (e.g. ``platforms=("cpu", "cuda")``) export; see the comment above.
  """
  if interpret:
    return make_call(True)(*operands)
  leaves, tree = jax.tree.flatten(operands)
  out_tree = jax.tree.structure(jax.eval_shape(lambda *a: make_call(False)(
      *jax.tree.unflatten(tree, a)), *leaves))

  def flat(interp):
    return lambda *a: jax.tree.leaves(make_call(interp)(*jax.tree.unflatten(tree, a)))

  outs = _bind_gpu_call(flat(False), flat(True), leaves)
  return jax.tree.unflatten(out_tree, outs)


# ----------------------------------------------------------------------------------------------
# Forward kernel.
# ----------------------------------------------------------------------------------------------

def _fwd_kernel(seed_ref, qlen_ref, kvlen_ref, qseg_ref, kvseg_ref, q_ref, k_ref, v_ref, bias_ref,
                mask_ref, o_ref, lse_ref, *, spec: Spec, block_q: int, block_k: int):
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
      bias_tile = load_bias_like(bias_ref, spec.bias_shape, spec, q_start, block_q, k_start,
                                 block_k, other=0)
    if mask_ref is not None:
      mask_tile = load_bias_like(mask_ref, spec.mask_shape, spec, q_start, block_q, k_start,
                                 block_k, other=False)
    mask = None
    mspec = dataclasses.replace(spec, causal=False) if interior else spec
    if (mspec.causal or spec.window is not None or (ragged_k and not interior)
        or q_len is not None or kv_len is not None or q_seg is not None or mask_tile is not None):
      mask = logits_mask(mspec, rows, cols, q_len=q_len, kv_len=kv_len, q_seg=q_seg,
                         kv_seg=kv_seg, mask_tile=mask_tile, key_bounds=not interior)
    s, _ = scores(spec, q, k, rows, cols, bias_tile=bias_tile, mask=mask)
    s = s * _LOG2E
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
  lse = jnp.where(empty, -jnp.inf, (m_safe + jnp.log2(l_safe)) * _LN2)
  store_tile(o_ref, out, 0, block_q, spec.T - q_start, spec.Hv, ragged=ragged_q)
  if ragged_q:
    plgpu.store(lse_ref, lse, mask=rows1 < spec.T)
  else:
    lse_ref[...] = lse


def _bias_spec(shape4, index):
  """BlockSpec for a rank-4 bias / mask with broadcast dims; ``index(b, n) -> (bi, ni)``."""
  bb, nb, tb, sb = shape4
  return pl.BlockSpec((None, None, tb, sb),
                      lambda *g: (*index(g, bb != 1, nb != 1), 0, 0))


def forward(args: base.AttentionArgs, *, config: Optional[Config] = None, interpret: bool = False,
            allow_tf32: bool = False, name: str = "jb_flash_fwd"):
  """Runs the forward kernel on validated ``args`` (bias / mask tiles read when present).

  Returns ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32)``.
  """
  spec = make_spec(args, allow_tf32=allow_tf32)
  cfg = config or heuristics(spec.H, args.dtype, local_compute_capability())
  block_q = _block(cfg.block_q, spec.T)
  block_k = _block(cfg.block_k, spec.S)
  G = spec.G
  nq = pl.cdiv(spec.T, block_q)
  grid = (nq, spec.N, spec.B)

  def scalar_spec():
    return pl.BlockSpec((None,), lambda i, n, b: (b,))

  def head_index(g, has_b, has_n):
    _, n, b = g
    return (b if has_b else 0, n if has_n else 0)

  seed = dropout_seed_words(args)
  operands = (
      seed, args.q_seq_lengths, args.kv_seq_lengths, args.q_segment_ids, args.kv_segment_ids,
      args.q, args.k, args.v, args.bias, args.mask)
  in_specs = (
      None if seed is None else pl.BlockSpec((2,), lambda i, n, b: (0,)),
      None if args.q_seq_lengths is None else scalar_spec(),
      None if args.kv_seq_lengths is None else scalar_spec(),
      None if args.q_segment_ids is None else pl.BlockSpec((None, block_q), lambda i, n, b: (b, i)),
      None if args.kv_segment_ids is None else pl.BlockSpec((None, spec.S),
                                                            lambda i, n, b: (b, 0)),
      pl.BlockSpec((None, block_q, None, spec.Hp), lambda i, n, b: (b, i, n, 0)),
      pl.BlockSpec((None, spec.S, None, spec.Hp), lambda i, n, b: (b, 0, n // G, 0)),
      pl.BlockSpec((None, spec.S, None, spec.Hvp), lambda i, n, b: (b, 0, n // G, 0)),
      None if args.bias is None else _bias_spec(spec.bias_shape, head_index),
      None if args.mask is None else _bias_spec(spec.mask_shape, head_index),
  )
  # Under shard_map the outputs vary over the same mesh axes as the queries.
  out_shape = (base.out_struct((spec.B, spec.T, spec.N, spec.Hv), args.dtype, args.q),
               base.out_struct((spec.B, spec.N, spec.T), jnp.float32, args.q))
  out_specs = (pl.BlockSpec((None, block_q, None, spec.Hvp), lambda i, n, b: (b, i, n, 0)),
               pl.BlockSpec((None, None, block_q), lambda i, n, b: (b, n, i)))
  kernel = functools.partial(_fwd_kernel, spec=spec, block_q=block_q, block_k=block_k)
  make_call = lambda interp: pl.pallas_call(  # noqa: E731
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_backend.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interp, name=name)
  out, lse = triton_call(make_call, operands, interpret=interpret)
  return out, lse


# ----------------------------------------------------------------------------------------------
# Backend entry points.
# ----------------------------------------------------------------------------------------------

def common_unsupported(args: base.AttentionArgs, platform: str) -> list:
  """Constraints shared by every Pallas Triton kernel here (forward and backward alike)."""
  reasons = []
  if platform not in GPU_PLATFORMS:
    reasons.append(f"Pallas Triton kernels need a CUDA GPU; {platform=} (use interpret=True "
                   "only for testing)")
  if jnp.dtype(args.dtype) not in _KERNEL_DTYPES:
    reasons.append(f"dtype {args.dtype} is not supported (float16, bfloat16, float32)")
  if args.head_dim > _MAX_HEAD_DIM:
    reasons.append(f"head_dim={args.head_dim} > {_MAX_HEAD_DIM}")
  if args.v_head_dim > _MAX_HEAD_DIM:
    reasons.append(f"value head_dim={args.v_head_dim} > {_MAX_HEAD_DIM}")
  if args.batch > 65535 or args.num_heads > 65535:
    reasons.append(f"batch={args.batch} / heads={args.num_heads} exceed the CUDA grid limit 65535")
  if 0 in (args.batch, args.num_heads, args.q_len, args.kv_len, args.head_dim, args.v_head_dim):
    reasons.append(f"an empty dimension (batch={args.batch}, heads={args.num_heads}, "
                   f"q_len={args.q_len}, kv_len={args.kv_len}, head_dim={args.head_dim}, "
                   f"v_head_dim={args.v_head_dim}): the XLA path handles it")
  return reasons


def unsupported(args: base.AttentionArgs, platform: str) -> list:
  """Why the flash Pallas kernel cannot run ``args`` on ``platform`` (empty list if it can).

  The same constraints hold for the forward and the backward pass, so a call accepted here never
  fails later at grad time.

  Example:
    >>> import jax.numpy as jnp
    >>> from pallas_kernels.attention import base, flash
    >>> x = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    >>> flash.unsupported(base.make_args(x, x, x), "cuda")
    []
    >>> flash.unsupported(base.make_args(x, x, x, bias=jnp.zeros((1, 1, 8, 8))), "cuda")
    ['an additive `bias` is not supported by flash (use the memory-efficient backend)']
  """
  reasons = common_unsupported(args, platform)
  if args.bias is not None:
    reasons.append("an additive `bias` is not supported by flash (use the memory-efficient backend)")
  if args.mask is not None:
    reasons.append("an arbitrary boolean `mask` is not supported by flash (use the "
                   "memory-efficient backend, or causal / window / lengths / segment ids)")
  return reasons


def _check_config(config, cls):
  if config is not None and not isinstance(config, cls):
    raise TypeError(f"`config` must be a {cls.__module__}.{cls.__qualname__} or None; "
                    f"got {type(config).__name__}")


def attention(args: base.AttentionArgs, *, config: Optional[Config] = None, interpret: bool = False,
              allow_tf32: bool = False, bwd_config=None, use_decode: Optional[bool] = None,
              **opts):
  """Flash attention with the Pallas Triton kernels; differentiable w.r.t. q, k, v.

  Args:
    args: canonical arguments (:func:`base.make_args`); no bias / mask (see :func:`unsupported`).
    config: forward :class:`Config` (default :func:`heuristics`).
    interpret: run the kernels in the Pallas interpreter (CPU testing).
    allow_tf32: float32 inputs use TF32 tensor-core dots (otherwise full IEEE float32).
    bwd_config: backward :class:`flash_vjp.Config`.
    use_decode: run the split-K :mod:`decode` kernel instead (same results). ``None``: when no
      ``config`` is given and ``T <= 16`` (decoding), where this grid would leave the GPU idle.
    **opts: ignored dispatch options.

  Returns:
    ``(out [B, T, N, Hv], lse [B, N, T] float32)``; ``lse`` is differentiable too.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_kernels.attention import base, flash
    >>> x = jax.random.normal(jax.random.key(1), (1, 17, 4, 16))
    >>> kv = x[:, :, :2]
    >>> args = base.make_args(x, kv, kv, window=(4, 0))
    >>> g = jax.grad(lambda q: flash.attention(args.replace(q=q), interpret=True)[0].sum())(x)
    >>> g.shape
    (1, 17, 4, 16)
  """
  del opts
  from pallas_kernels.attention import decode, flash_vjp  # noqa: PLC0415 (import cycle)
  _check_config(config, Config)
  reasons = unsupported(args, "cuda")
  if reasons:
    raise ValueError("flash (Pallas) cannot run this call: " + "; ".join(reasons))
  if use_decode is None:
    use_decode = config is None and not decode.unsupported(args, "cuda")
  if use_decode:
    return decode.attention(args, interpret=interpret, allow_tf32=allow_tf32,
                            bwd_config=bwd_config)
  return flash_vjp.differentiable(args, fwd=functools.partial(forward, config=config,
                                                              interpret=interpret,
                                                              allow_tf32=allow_tf32),
                                  bwd_config=bwd_config, interpret=interpret,
                                  allow_tf32=allow_tf32)
