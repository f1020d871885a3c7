"""Flash attention for Hopper (sm90) in Pallas Mosaic GPU: warp-specialized, TMA-fed, WGMMA.

FlashAttention-3 (Shah et al., 2024, https://arxiv.org/abs/2407.08608) in Pallas's Mosaic GPU backend
(``jax.experimental.pallas.mosaic_gpu``). Every kernel here runs three warpgroups per program (CTA):

* a **memory warpgroup** streams the blocks the loop walks into a ring of ``stages`` shared-memory
  slots with TMA, each slot guarded by "loaded" barriers (the TMA arrives) and a "consumed" barrier
  (both compute warpgroups arrive once they are done with it);
* two **compute warpgroups** own 64 rows (forward, dQ) or 64 keys (dK / dV) each and multiply on the
  tensor cores (WGMMA), keeping their accumulators in registers.

**Forward.** A program owns ``2 x 64`` query rows of one head. ``Q K^T`` takes both operands from
shared memory; the online softmax runs in registers (base 2, the softmax scale folded into
``log2(e)``); ``P V`` takes ``P`` from registers. A shared "schedule" barrier makes the two compute
warpgroups alternate (section 3.1 of the paper, ping-pong), so one's softmax runs while the other's
matrix multiplies occupy the tensor cores. ``Config(overlap=True)`` adds the paper's intra-warpgroup
overlap (section 3.2), not yet timed on a GPU and so off by default: a step issues block ``j``'s
``Q K^T`` and block ``j - 1``'s ``P V`` together, waits for the first only, and runs block ``j``'s
softmax while ``P V`` multiplies; the memory warpgroup then refills a slot's keys once they are
released and its values a step later.

**Backward** (head dims 64 and 128; at 256 the Triton flash backward runs), FlashAttention-2's
split: ``delta = rowsum(dO * O) - dLSE`` in XLA, then

* a **dQ kernel** (rows as in the forward, key blocks streamed): ``S = Q K^T``, ``dP = dO V^T``,
  ``dS = P (dP - delta)``, ``dQ += dS K``;
* a **dK / dV kernel** (64 keys per warpgroup; the query blocks, ``dO``, LSE and delta of every query
  head of the key's GQA group streamed): ``S^T = K Q^T``, ``dV += P^T dO``, ``dP^T = V dO^T``,
  ``dK += dS^T Q``. The GQA sum stays in registers: no per-query-head dK / dV in memory.

A causal mask (any ``diag_offset``) and a local window ``(left, right)`` are applied only to the
blocks that straddle their edges; the blocks outside the band are never loaded or multiplied (the
ring starts at the first block either compute warpgroup needs), and a warpgroup releases the ring
slots streamed only for the other one, before and after its own band (waiting for each first: an
early arrival would complete the slot's previous phase while the other warpgroup may still read
it). A row the diagonal or the window leaves without a key (e.g. a bottom-right mask with more
queries than keys) gets output 0 and LSE ``-inf``, as the reference. Lengths that are not block
multiples are zero-padded by the wrappers: padded keys are masked in the last block, padded query
rows get an LSE of ``+inf`` (so ``P = 0``) in the backward.

What it runs (:func:`unsupported` says why not, and dispatch moves on): float16 / bfloat16, equal q/k
and v head dims of 64, 128 or 256, GQA / MQA, causal or not, local windows, on a compute capability
9.x GPU. An additive bias in the inputs' dtype (``[1 or B, 1 or N, T or 1, S or 1]``) runs like the
mask below, as tiles in that dtype (128-key forward steps become 64: shared memory), added to the
logits after the soft cap; the dQ kernel also writes ``dS`` (float32, ``[B, N, T, S]``), which XLA
zeroes where no query sees the key and sums over the bias's broadcast dimensions (its gradient). A
bias of another dtype, and one at head dim 256 (shared memory), are refused: under
``flash_cuda_kernel="auto"`` the Triton kernels run them. A boolean mask (``[1 or B, 1 or N, T or 1, S or 1]``) runs as int8 tiles that the memory warpgroup
streams with each block (``[128 rows, block]``; transposed, ``[128 keys, block]``, for dK / dV, from
a transposed copy XLA makes once), each compute warpgroup reading its 64 rows. A logits soft cap runs
in all three kernels (``tanh`` on the scaled logits, through ``exp2``; the backward multiplies ``dS``
by ``1 - tanh^2``). So do segment ids (packed sequences): each compute warpgroup loads its own rows'
ids once, the memory warpgroup streams the other side's ids with each block into the ring, and every
block is masked where the ids differ (a row whose segment has no key gets output 0 and LSE
``-inf``). With segment ids or a mask, XLA flags each (64-row tile, block) pair that has no visible
pair (:func:`_block_flags`: the tile's and the block's id ranges do not meet, exact for sorted ids;
or the mask's tile is all False), and a compute warpgroup reads its flag (a scalar) before each block
and releases a flagged block without multiplying it: packed sequences cost about the blocks on their
diagonal in products (the ring still streams every block; with ``Config`` / ``BwdConfig(block_ranges=True)``,
off until a GPU has timed it, each tile streams and walks only the blocks from its first to its last
visible one, two more columns of the flags). So does dropout, with the keep bits of every
other backend (:func:`base.dropout_keep_mask`): XLA hashes the seed, batch, head and query index of
each row once (:func:`base.dropout_row_hash`, ``[B, N, T]`` uint32, loaded like the LSE), and the
kernels finish the hash per key in registers; the forward drops probabilities after the softmax sum,
the backward drops ``P`` for ``dV`` and ``dP`` for ``dS``, each scaled by ``1 / (1 - rate)``. And
per-batch query / key lengths: each warpgroup reads its batch's two lengths as scalars, the key
blocks past the key length are neither streamed nor multiplied (the memory warpgroup streams what
either compute warpgroup needs), the block the length cuts is masked, query rows past the query
length see no key (output 0, LSE ``-inf``; ``P = 0`` in the backward).

Verification: CI has no GPU. The kernels are exported for CUDA from CPU with ``jax.export`` (Pallas
lowers them to the Mosaic GPU dialect there, so shapes, layouts, transforms and barrier types are
checked); on jax >= 0.11.2 they also run in Pallas's GPU interpret mode, with its race detector on,
against the float32 reference, gradients included. That interpreter cannot take a WGMMA operand from
registers, nor an accumulator carried through ``pl.run_state``: ``interpret=True`` stages the
register operand (``P``, ``dS``) through shared memory and adds each product to the accumulator
outside the WGMMA, and is otherwise the same program. The GPU lane (``pytest -m gpu``) runs the compiled
kernels: on an H200 (2026-11-27) the 14 of its cases that ran before the lane's time ran out passed, as
did the smoke test (three checks, one with a local window and a boolean mask); at the benchmark's
shapes (bf16, head dims 64 / 128, L 4k / 16k, causal and not) the output and the three gradients were as close to a float32 reference as cuDNN's. There they ran at 1.2-2.8x the
speed of the Triton flash kernels, 0.92-1.02x cuDNN's forward and 0.85-0.96x its forward + backward
(``docs/gpu/README.md``): ``flash_cuda_kernel="auto"`` tries them before the Triton flash kernel,
except for local windows (their lane cases have not run compiled yet).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu
from pallas_kernels.attention import base, sharded, triton_flash_vjp

__all__ = ["Config", "BwdConfig", "attention", "forward", "backward", "unsupported", "available"]

GPU_PLATFORMS = gpu.GPU_PLATFORMS
_LOG2E = math.log2(math.e)
_FLT_MAX = float(jnp.finfo(jnp.float32).max)
_LN2 = math.log(2.0)
_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Shared memory per block on sm90 (227 KiB), less room for the barriers and Mosaic GPU's own scratch
# (its lowering counted 2.1 KiB beyond our buffers for the forward at head dim 256 with a bias).
_SMEM_BYTES = 227 * 1024 - 3 * 1024


def _plgpu():
    """``jax.experimental.pallas.mosaic_gpu``, imported at first use (it loads the Mosaic GPU
    lowering)."""
    from jax.experimental.pallas import mosaic_gpu  # noqa: PLC0415

    return mosaic_gpu


def available() -> Optional[str]:
    """``None`` when this JAX has the Mosaic GPU Pallas API the kernel uses; else why not."""
    try:
        plgpu = _plgpu()
    except ImportError as e:  # pragma: no cover - every supported jax has it
        return f"this JAX has no Pallas Mosaic GPU backend ({e})"
    missing = [
        n
        for n in ("kernel", "wgmma", "copy_gmem_to_smem", "Barrier", "SMEM", "ACC", "layout_cast")
        if not hasattr(plgpu, n)
    ]
    if missing:
        return f"this JAX's Pallas Mosaic GPU backend lacks {', '.join(missing)}"
    return None


def _cuda_runtime_version() -> Optional[int]:
    """The CUDA runtime's version (e.g. ``12090``) where jaxlib has its CUDA plugin, else None."""
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415 - private: None on a CPU-only jaxlib
    except ImportError:  # pragma: no cover - every jaxlib has the module
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cuda_runtime_get_version())
    except Exception:  # noqa: BLE001 - no CUDA runtime loadable here
        return None


def interpret_available() -> bool:
    """Whether this JAX runs Mosaic GPU kernels in its GPU interpret mode (jax >= 0.11.2; 0.10 has
    none)."""
    return available() is None and hasattr(_plgpu(), "InterpretGPUParams")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of the forward kernel.

    Attributes:
      block_q: query rows per compute warpgroup (a program holds two: ``2 * block_q`` rows); 64.
      block_kv: keys per pipeline step, a multiple of 64.
      stages: key / value blocks in flight (shared-memory ring slots), at least 2.
      overlap: FlashAttention-3's intra-warpgroup overlap (section 3.2 of the paper): each step
        issues the next block's ``Q K^T`` together with the previous block's ``P V``, and the softmax
        of the next block runs while the tensor cores multiply, at the cost of holding the previous
        block's ``P`` (``[64, block_kv]`` in the inputs' dtype) in registers through the softmax.
        Off by default until a GPU has timed it (it is in :meth:`search_space`). Calls with segment
        ids or a boolean mask (whose blocks may be skipped) run the plain loop either way; needs
        ``plgpu.wgmma_accumulator_load`` (every supported JAX has it).
      block_ranges: with segment ids or a boolean mask, stream and walk only the key blocks from the
        first to the last that holds a visible pair of a warpgroup's rows (XLA finds them from the
        block flags; :func:`_append_ranges`), instead of the whole ring with the blocks between
        skipped: packed sequences then cost the blocks on their diagonal in memory traffic too, not
        only in products. The same output (a block outside the range is one the flags skip). Off by
        default until a GPU has timed it (it is in :meth:`search_space`); no effect on other calls.
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    overlap: bool = False
    block_ranges: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv", "stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Config.{name} must be an int; got {type(value).__name__}")
        for name in ("overlap", "block_ranges"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool; got {type(getattr(self, name)).__name__}")
        if self.block_q != 64:
            raise ValueError(f"Config.block_q must be 64 (one WGMMA row tile); got {self.block_q}")
        if self.block_kv <= 0 or self.block_kv % 64 or self.block_kv > 256:
            raise ValueError(
                f"Config.block_kv must be a multiple of 64 up to 256 (a WGMMA's N); got {self.block_kv}"
            )
        if self.stages < 2:
            raise ValueError(f"Config.stages must be at least 2; got {self.stages}")

    def smem_bytes(
        self,
        head_dim: int,
        itemsize: int = 2,
        segments: bool = False,
        dropout: bool = False,
        mask: bool = False,
        bias: bool = False,
    ) -> int:
        """Shared memory the forward kernel allocates for ``head_dim`` (queries / outputs of both
        compute warpgroups, the key and value ring, the softmax statistics; with ``segments`` the
        rows' segment ids and a ring of the keys'; with ``dropout`` the rows' hashes; with ``mask`` a
        ring of int8 mask tiles; with ``bias`` a ring of bias tiles), each buffer aligned as Mosaic
        GPU places it."""
        rows, ring = 2 * self.block_q, self.stages * self.block_kv
        tiles = [rows * head_dim * itemsize] + [ring * head_dim * itemsize] * 2 + [rows * ring] * mask
        tiles += [rows * ring * itemsize] * bias
        vectors = [rows] + [rows, ring] * segments + [rows] * dropout
        return _smem_total(tiles + [n * 4 for n in vectors])

    @staticmethod
    def heuristics(head_dim: int, bias: bool = False) -> "Config":
        """The default for a head dim: 128-key steps up to head dim 128, 64 at 256 or with a bias
        (shared memory)."""
        return Config(block_kv=128 if head_dim <= 128 and not bias else 64)

    @staticmethod
    def search_space(args: base.AttentionArgs, overlap: bool = True) -> list:
        """The configs a tuning sweep tries for ``args`` (``benchmarks/tune_gpu.py``): 64-256 keys per
        step, 2-4 ring slots, those that fit an sm90 block's shared memory; with ``overlap`` (unless
        ``overlap=False``) too at 64 and 128 keys per step where it applies (no segment ids or
        boolean mask, and this JAX has it)."""
        space = [Config(block_kv=b, stages=n) for b in (64, 128, 192, 256) for n in (2, 3, 4)]
        # Wider blocks: the scores, the accumulator and two P tiles would pass 232 registers a thread.
        if overlap and _overlap_applies(args):
            space += [Config(block_kv=b, stages=n, overlap=True) for b in (64, 128) for n in (2, 3, 4)]
        if _ranges_apply(args):
            space += [dataclasses.replace(c, block_ranges=True) for c in space]
        return [c for c in space if _fits(c, args)]


def _ranges_apply(args: base.AttentionArgs) -> bool:
    """Whether ``block_ranges`` (:class:`Config`, :class:`BwdConfig`) changes the kernels for
    ``args``: with segment ids or a boolean mask."""
    return args.q_segment_ids is not None or args.mask is not None


def overlap_available() -> bool:
    """Whether this JAX's Mosaic GPU API has what ``Config.overlap`` needs: an accumulator read that
    waits for all but the newest WGMMA (``plgpu.wgmma_accumulator_load``)."""
    return available() is None and hasattr(_plgpu(), "wgmma_accumulator_load")


def _overlap_applies(args: base.AttentionArgs) -> bool:
    """Whether ``Config.overlap`` changes the forward of ``args``: not with segment ids or a boolean
    mask (their blocks may be skipped), and only where this JAX has it."""
    masked = args.q_segment_ids is not None or args.mask is not None
    return overlap_available() and not masked


def _smem_total(buffers) -> int:
    """Bytes of shared memory for buffers of these sizes: Mosaic GPU aligns each to 1 KiB."""
    return sum(-(-n // 1024) * 1024 for n in buffers)


# ----------------------------------------------------------------------------------------------
# The kernel.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The static problem a kernel instance is built for (padded lengths ``Tp`` / ``Sp``)."""

    B: int
    Tp: int
    Sp: int
    S: int
    N: int
    K: int
    D: int
    dtype: str
    scale: float
    causal: bool
    diag_offset: int
    softcap: Optional[float] = None
    segments: bool = False
    dropout_threshold: Optional[int] = None  # uint32: a probability is kept iff its hash >= this
    keep_scale: float = 1.0  # 1 / (1 - dropout rate)
    q_lengths: bool = False  # per-batch valid query / key counts (int32 [B] operands)
    kv_lengths: bool = False
    window: Optional[tuple] = None  # (left, right): key j seen by query i iff it is within them
    mask: Optional[tuple] = None  # a boolean mask: (per batch, per head), False where broadcast
    bias: Optional[tuple] = None  # an additive bias (in the inputs' dtype): the same
    block_ranges: bool = False  # Config.block_ranges with segment ids or a mask: flags carry ranges

    @property
    def lengths(self) -> bool:
        return self.q_lengths or self.kv_lengths

    @property
    def every_block_masked(self) -> bool:
        """Whether the mask of a block depends on data (segment ids, a boolean mask): then every
        block a tile walks is masked."""
        return self.segments or self.mask is not None

    @property
    def banded(self) -> bool:
        """Whether the blocks a tile sees depend on where it is (causal, window), on the batch
        (lengths) or on the data (``block_ranges``): block ranges are traced, and warpgroups release
        what they do not use."""
        return self.causal or self.window is not None or self.lengths or self.block_ranges

    @property
    def right_reach(self) -> Optional[int]:
        """How far past the diagonal a query sees keys: the window's right side (at most 0 under a
        causal mask), 0 with a causal mask alone, None without either."""
        if self.window is not None:
            return min(self.window[1], 0) if self.causal else self.window[1]
        return 0 if self.causal else None


def _logits2(qk, s: _Shape, bias=None):
    """With a soft cap: ``(cap * log2(e) * t, t)`` for ``t = tanh(scale * qk / cap)``, the base-2
    logits and the ``tanh`` the backward's chain rule needs (``d logits / d (scale qk) = 1 - t^2``);
    without one ``(qk, None)`` (the scale is folded into the exponent there). With a ``bias`` tile
    (``s.bias``: every kernel passes one) it is added to the logits (after the soft cap), and the
    first output is in base 2 either way."""
    if s.bias is not None:
        logits = qk * s.scale if s.softcap is None else None
        t = None
        if s.softcap is not None:
            t = 1.0 - 2.0 / (jnp.exp2(qk * (2.0 * _LOG2E * s.scale / s.softcap)) + 1.0)
            logits = t * s.softcap
        x = logits + bias.astype(jnp.float32)
        # Kept finite where x is: finfo.min (the usual additive padding mask) times log2(e) would be
        # -inf, and a row of it would look fully masked where jax.nn gives the mean of V. max(min(x,
        # -FLT_MAX), .) changes nothing else; x = -inf stays -inf and a NaN stays NaN.
        return jnp.maximum(jnp.minimum(x, -_FLT_MAX), x * _LOG2E), t
    if s.softcap is None:
        return qk, None
    # tanh(x) = 1 - 2 / (e^(2x) + 1) through exp2: with approx_math a compiled jnp.tanh is
    # tanh.approx.f32 (about 2^-11 relative error, times the cap in the logits); ex2.approx and the
    # division are good to ~2^-22. Both ends are exact: e^(2x) -> inf gives 1, -> 0 gives -1.
    t = 1.0 - 2.0 / (jnp.exp2(qk * (2.0 * _LOG2E * s.scale / s.softcap)) + 1.0)
    return t * (s.softcap * _LOG2E), t


def _exponent_scale(s: _Shape) -> float:
    """The factor from :func:`_logits2`'s first output to base-2 logits."""
    return 1.0 if s.softcap is not None or s.bias is not None else s.scale * _LOG2E


def _fill_ring(ring_steps, stages: int, load, wait_free, wait_tail=None, reload=None):
    """The memory warpgroup's loop, shared by the kernels: ring steps ``0 .. stages - 1`` (those below
    ``ring_steps``) at once, then step ``j + stages`` into slot ``j % stages`` once both compute
    warpgroups have released it (``wait_free(slot)``), up to ``ring_steps``. ``load(j, slot)`` issues
    step ``j``'s TMA copies onto the slot's "loaded" barriers. Then it waits for the release of the
    last ``stages`` blocks, so that it has seen every phase of the "consumed" barriers before they go:
    free on the hardware (the compute warpgroups release a block before their epilogue), and what
    jax 0.11's GPU interpreter checks when a barrier is deallocated. Where ``wait_free`` waits for
    only part of a slot's release (the keys') and ``reload(j, slot)``, which refills a slot in place
    of ``load``, for the rest, ``wait_tail`` waits for the whole release of the last blocks."""
    plgpu = _plgpu()
    plgpu.set_max_registers(40, action="decrease")
    for i in range(stages):
        pl.when(i < ring_steps)(functools.partial(load, jnp.int32(i), i))
    refill = jnp.maximum(ring_steps - stages, 0)

    @pl.loop(0, refill)
    def _(j):
        slot = lax.rem(j, jnp.int32(stages))
        wait_free(slot)
        (reload or load)(j + stages, slot)

    @pl.loop(refill, ring_steps)
    def _(j):
        (wait_tail or wait_free)(lax.rem(j, jnp.int32(stages)))


def _wait_all(barriers, slot):
    """Waits on each of ``barriers`` (None where absent) at ``slot``: a ring slot's "loaded" barriers,
    each of which a compute warpgroup must pass once per block, used or not."""
    for bar in barriers:
        if bar is not None:
            _plgpu().barrier_wait(bar.at[slot])


def _keep(
    s: _Shape,
    q_start,
    k_start,
    shape,
    q_seg=None,
    kv_seg=None,
    q_len=None,
    kv_len=None,
    query_axis: int = 0,
    mask=None,
):
    """Which logits of a tile whose queries (from ``q_start``) run along ``query_axis`` and keys (from
    ``k_start``) along the other count, in the WGMMA layout: keys below ``S`` (the rest is padding)
    and below ``kv_len``, queries below ``q_len`` (the batch's lengths: int32 scalars, or None), on or
    below the causal diagonal, within the local window, in the query's segment (``q_seg`` /
    ``kv_seg``: the tile's queries' and keys' segment ids, loaded in the matching WGMMA row / column
    layouts, or None), and where the boolean mask's tile (``mask``: int8 of the tile's shape, or
    None) is nonzero."""
    plgpu = _plgpu()
    key_axis = 1 - query_axis
    keys = plgpu.broadcasted_iota(jnp.int32, shape, key_axis, layout=plgpu.Layout.WGMMA) + k_start
    keep = keys < s.S
    if kv_len is not None:
        keep = keep & (keys < kv_len)
    if s.causal or s.window is not None or q_len is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, shape, query_axis, layout=plgpu.Layout.WGMMA)
    if q_len is not None:
        keep = keep & (rows < q_len - q_start)
    if s.causal:
        keep = keep & (keys <= rows + (q_start + s.diag_offset))
    if s.window is not None:
        left, right = s.window
        keep = keep & (keys >= rows + (q_start + s.diag_offset - left))
        keep = keep & (keys <= rows + (q_start + s.diag_offset + right))
    if q_seg is not None:
        same = lax.broadcast_in_dim(q_seg, shape, [query_axis]) == lax.broadcast_in_dim(
            kv_seg, shape, [key_axis]
        )
        keep = keep & same
    if mask is not None:
        keep = keep & (mask != 0)
    return keep


def _byte_tiles(width: int):
    """Shared-memory transforms of an int8 tile ``width`` bytes wide (the boolean mask's): swizzled
    rows of 128 bytes where the width is a multiple of 128, else of 64 (a 192-key block: the tiling
    must divide the width), as TMA writes them."""
    plgpu = _plgpu()
    swizzle = 128 if width % 128 == 0 else 64
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def _dropout_keep(s: _Shape, row_hash, axis: int, k_start, shape):
    """The dropout keep bits of a tile whose queries run along ``axis`` (0: queries x keys, 1: keys x
    queries): ``row_hash`` holds each query's :func:`base.dropout_row_hash` (loaded in the matching
    WGMMA row / column layout), the key index runs along the other axis from ``k_start``. The same
    bits as :func:`base.dropout_keep_mask` and every other backend."""
    plgpu = _plgpu()
    keys = plgpu.broadcasted_iota(jnp.int32, shape, 1 - axis, layout=plgpu.Layout.WGMMA) + k_start
    h = lax.broadcast_in_dim(row_hash, shape, [axis])
    return base.dropout_keep_from_row_hash(h, keys.astype(jnp.uint32), s.dropout_threshold)


class _Blocks(NamedTuple):
    """The blocks a warpgroup walks: ``[start, free_lo)`` masked, ``[free_lo, free_hi)`` mask-free,
    ``[free_hi, stop)`` masked; empty when ``stop <= start``. Python ints where nothing varies with
    the tile or the batch (no causal mask, window or lengths), else traced int32."""

    start: Any
    free_lo: Any
    free_hi: Any
    stop: Any

    @property
    def empty(self):
        return self.stop <= self.start

    def within(self, ring_lo) -> "_Blocks":
        """These blocks, or none (every bound at ``ring_lo``: the warpgroup releases the whole ring)
        when they are empty."""
        if all(isinstance(b, int) for b in self):
            return self
        return _Blocks(*(jnp.where(self.empty, ring_lo, b) for b in self))


def _ring(blocks_of, first_rows, rows: int, s: _Shape):
    """``(lo, hi)``: the blocks the memory warpgroup streams, those either compute warpgroup needs
    (``blocks_of(start)`` gives the :class:`_Blocks` of the ``rows`` rows or keys from ``start``; the
    second warpgroup's start at ``first_rows + rows``). Under a causal mask alone the second needs the
    most; a query length can end inside the first's rows, a window starts the second's later."""
    a, b = blocks_of(first_rows), blocks_of(first_rows + rows)
    if not s.banded:
        return a.start, a.stop
    never = jnp.int32(jnp.iinfo(jnp.int32).max)
    lo = jnp.minimum(jnp.where(a.empty, never, a.start), jnp.where(b.empty, never, b.start))
    hi = jnp.maximum(jnp.where(a.empty, 0, a.stop), jnp.where(b.empty, 0, b.stop))
    return jnp.minimum(lo, hi), hi


def _block_loops(
    step, blocks: _Blocks, carry, s: _Shape, lead: bool, trail: bool = True, visible=None, skip=None
):
    """Runs ``step(j, carry, masked)`` over ``blocks`` in order, masked where they say (every block
    with segment ids or a boolean mask). Only the loops that can run are built: the leading masked
    one if ``lead``, the trailing one if ``trail``, none with static empty bounds (Mosaic GPU fails to
    lower an empty static loop, and each loop is a copy of the step's code). With ``visible(j)`` (an
    int32 scalar: 0 where the segment ids / mask leave no pair of block ``j`` visible) such a block
    runs ``skip(j, carry)`` instead: released, not multiplied."""

    def run(lo, hi, masked, carry, body=step):
        if isinstance(lo, int) and isinstance(hi, int) and hi <= lo:
            return carry
        return lax.fori_loop(lo, hi, functools.partial(body, masked=masked), carry)

    if s.every_block_masked:
        if visible is None:
            return run(blocks.start, blocks.stop, True, carry)

        def gated(j, carry, masked):
            run_it = functools.partial(step, j, masked=masked)
            return lax.cond(visible(j) != 0, run_it, functools.partial(skip, j), carry)

        return run(blocks.start, blocks.stop, True, carry, body=gated)
    if lead:
        carry = run(blocks.start, blocks.free_lo, True, carry)
    carry = run(blocks.free_lo, blocks.free_hi, False, carry)
    return run(blocks.free_hi, blocks.stop, True, carry) if trail else carry


class _ExtraRefs(NamedTuple):
    """A kernel's refs of its :func:`_kernel_extras` operands, None where absent."""

    q_seg: Any  # [B, Tp] int32
    kv_seg: Any  # [B, Sp] int32
    row_hash: Any  # [B, N, Tp] uint32
    q_len: Any  # [B] int32
    kv_len: Any  # [B] int32
    mask: Any  # [1 or B, 1 or N, Tp, Sp] int8, or its transpose [.., Sp, Tp] (the dK / dV kernel's)
    bias: Any  # the same in the inputs' dtype
    visible: Any  # int32 [1 or B, 1 or N, row tiles, blocks]: :func:`_block_flags`

    @staticmethod
    def of(refs: tuple, s: _Shape) -> "_ExtraRefs":
        refs = list(refs)
        segs = (refs.pop(0), refs.pop(0)) if s.segments else (None, None)
        row_hash = refs.pop(0) if s.dropout_threshold is not None else None
        q_len = refs.pop(0) if s.q_lengths else None
        kv_len = refs.pop(0) if s.kv_lengths else None
        mask = refs.pop(0) if s.mask is not None else None
        bias = refs.pop(0) if s.bias is not None else None
        visible = refs.pop(0) if s.every_block_masked else None
        return _ExtraRefs(*segs, row_hash, q_len, kv_len, mask, bias, visible)

    def _flags_row(self, bi, head, tile):
        """The flags ref's row of tile ``tile`` of batch ``bi`` and query head ``head`` (index 0 along a
        broadcast dimension)."""
        Bf, Nf = self.visible.shape[:2]
        return self.visible.at[bi if Bf > 1 else 0, head if Nf > 1 else 0, tile]

    def visible_fn(self, bi, head, tile):
        """``block -> int32 scalar``: :func:`_block_flags` of the 64-row (or, in the dK / dV kernel,
        64-key) tile ``tile`` of batch ``bi`` and query head ``head``; None without flags."""
        if self.visible is None:
            return None
        row = self._flags_row(bi, head, tile)
        return lambda j: row[j]

    def range_fn(self, bi, head):
        """``tile -> (lo, hi)``: the blocks from the first to one past the last with a visible pair
        of tile ``tile`` of batch ``bi`` and query head ``head`` (the two columns
        :func:`_append_ranges` adds to the flags)."""
        width = self.visible.shape[-1]

        def at(tile):
            row = self._flags_row(bi, head, tile)
            return row[width - 2], row[width - 1]

        return at

    def mask_tiles(self, s: _Shape, bi, head):
        """The mask ref's ``[rows, keys]`` (or transposed) plane of batch ``bi`` and query head
        ``head`` (index 0 along a broadcast dimension)."""
        per_batch, per_head = s.mask
        return self.mask.at[bi if per_batch else 0, head if per_head else 0]

    def bias_tiles(self, s: _Shape, bi, head):
        """The bias ref's plane of batch ``bi`` and query head ``head``, as :meth:`mask_tiles`."""
        per_batch, per_head = s.bias
        return self.bias.at[bi if per_batch else 0, head if per_head else 0]

    def lengths(self, bi):
        """Batch ``bi``'s ``(q_len, kv_len)`` int32 scalars (None where absent)."""
        return (
            None if self.q_len is None else self.q_len[bi],
            None if self.kv_len is None else self.kv_len[bi],
        )


def _narrowed(blocks_of, range_of, rows: int):
    """``blocks_of`` (``start -> _Blocks``) cut to ``range_of(start // rows)`` (``(lo, hi)``: the
    blocks holding a visible pair of the ``rows``-row or -key tile from ``start``); every block cut
    away is one the flags skip."""

    def of(start):
        b = blocks_of(start)
        lo, hi = range_of(lax.div(start, jnp.int32(rows)))
        begin = jnp.maximum(b.start, lo)
        stop = jnp.maximum(jnp.minimum(b.stop, hi), begin)
        free_lo = jnp.clip(b.free_lo, begin, stop)
        return _Blocks(begin, free_lo, jnp.clip(b.free_hi, free_lo, stop), stop)

    return of


def _key_blocks(q_start, block_q: int, s: _Shape, block_kv: int, q_len=None, kv_len=None) -> _Blocks:
    """The key blocks of query rows ``[q_start, q_start + block_q)`` (:class:`_Blocks`): those inside
    the causal / window band, below the key length ``kv_len`` and the padding; mask-free where every
    row sees every key of the block. Rows at or past the query length ``q_len`` see none (``q_len`` /
    ``kv_len``: the batch's int32 scalars, or None)."""
    n_full, n = s.S // block_kv, -(-s.S // block_kv)
    if not s.banded:  # only the padded keys of a ragged last block are masked
        return _Blocks(0, 0, n_full, n)
    bk = jnp.int32(block_kv)
    last = q_start + (block_q - 1)
    lo, hi = jnp.int32(0), jnp.int32(s.S)  # keys [lo, hi) some row sees
    free_lo, free_hi = jnp.int32(0), jnp.int32(n_full * block_kv)  # keys every row sees
    if s.right_reach is not None:
        hi = jnp.minimum(hi, last + (s.diag_offset + s.right_reach + 1))
        free_hi = jnp.minimum(free_hi, q_start + (s.diag_offset + s.right_reach + 1))
    if s.window is not None:
        lo = jnp.maximum(q_start + (s.diag_offset - s.window[0]), 0)
        free_lo = last + (s.diag_offset - s.window[0])
    if kv_len is not None:
        hi = jnp.minimum(hi, kv_len)
        free_hi = jnp.minimum(free_hi, kv_len)
    start = lax.div(lo, bk)
    stop = lax.div(jnp.maximum(hi, 0) + (block_kv - 1), bk)
    free_lo = lax.div(jnp.maximum(free_lo, 0) + (block_kv - 1), bk)
    free_hi = lax.div(jnp.maximum(free_hi, 0), bk)
    if q_len is not None:
        stop = jnp.where(q_start < q_len, stop, 0)
        free_hi = jnp.where(last < q_len, free_hi, 0)  # a tile the length cuts: every block masked
    stop = jnp.maximum(stop, start)
    free_lo = jnp.clip(free_lo, start, stop)
    return _Blocks(start, free_lo, jnp.clip(free_hi, free_lo, stop), stop)


def _forward_call(q, k, v, extras, s: _Shape, cfg: Config, interpret: bool):
    """The ``plgpu.kernel`` on padded ``q [B, Tp, N, D]``, ``k`` / ``v [B, Sp, K, D]`` and the padded
    :func:`_extras` -> ``(out [B, Tp, N, D], lse [B, N, Tp] float32, natural log)``."""
    plgpu = _plgpu()
    dtype = jnp.dtype(s.dtype)
    bq, bk, D = cfg.block_q, cfg.block_kv, s.D
    stages = max(1, min(cfg.stages, s.Sp // bk))
    G = s.N // s.K
    c = _exponent_scale(s)  # logits -> base-2 exponent

    def kernel(q_ref, k_ref, v_ref, x, out_ref, lse_ref, scoped):
        bi = lax.axis_index("batch")
        head = lax.axis_index("heads")
        tile = lax.axis_index("q_tiles")
        wg = lax.axis_index("wg")
        q_len, kv_len = x.lengths(bi)
        blocks_of = functools.partial(_key_blocks, block_q=bq, s=s, block_kv=bk, q_len=q_len, kv_len=kv_len)
        if s.block_ranges:
            blocks_of = _narrowed(blocks_of, x.range_fn(bi, head), bq)
        smem, loaded, consumed, schedule = scoped
        (
            qo_smem2,
            k_smem,
            v_smem,
            lse_smem2,
            p_smem2,
            qseg_smem2,
            kvseg_smem,
            hash_smem2,
            mask_smem,
            bias_smem,
        ) = smem
        k_loaded, v_loaded, q_loaded, kvseg_loaded, mask_loaded, bias_loaded = loaded
        k_consumed, v_consumed = consumed

        def schedule_turn():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        ring_lo, ring_hi = _ring(blocks_of, tile * (2 * bq), bq, s)

        def slot_of(j):  # key block j's ring slot
            return lax.rem(j - ring_lo, jnp.int32(stages))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q_start = tile * (2 * bq) + wg * bq
            blocks = blocks_of(q_start).within(ring_lo)

            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_start, bq), head], qo_smem, q_loaded.at[0, wg])
            q_seg = row_hash = None
            if s.segments:
                src = x.q_seg.at[bi, pl.ds(q_start, bq)]
                q_seg = _own_rows(src, qseg_smem2.at[wg], q_loaded.at[1, wg])
            if s.dropout_threshold is not None:
                src = x.row_hash.at[bi, head, pl.ds(q_start, bq)]
                row_hash = _own_rows(src, hash_smem2.at[wg], q_loaded.at[1 + s.segments, wg])
            plgpu.barrier_wait(q_loaded.at[0, wg])

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def release(j, _):
                # Ring slots this warpgroup's rows never need (causal, window, lengths): release
                # them, and keep the schedule barrier's turns in step with the other warpgroup. Each
                # is waited for first: an early arrival would count toward the slot's previous use,
                # which the other warpgroup may still be reading.
                slot = slot_of(j)
                _wait_all((k_loaded, v_loaded, kvseg_loaded, mask_loaded, bias_loaded), slot)
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                schedule_turn()
                schedule_turn()

            pl.when(wg == 1)(schedule_turn)
            if s.window is not None or s.block_ranges:  # blocks before this warpgroup's band: the other's
                lax.fori_loop(ring_lo, blocks.start, release, None)

            @pl.when(blocks.stop > blocks.start)
            def _():
                plgpu.barrier_wait(k_loaded.at[slot_of(blocks.start)])

            def scores(slot):
                """``Q K^T`` of the keys in ``slot`` (the schedule's first turn taken while the tensor
                cores multiply), awaited."""

                def qk_product(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_turn()
                    return acc_ref[...]

                return pl.run_scoped(qk_product, plgpu.ACC((bq, bk), jnp.float32))

            def logits(j, slot, qk, masked):
                """Block ``j``'s (in ``slot``) base-2 logits from its ``Q K^T`` (read after the keys'
                release): the soft cap, the bias and, where ``masked``, -inf where a pair is not
                visible. The bias, key ids and mask tiles are read before the values are released
                (their guard)."""
                bias = None
                if s.bias is not None:
                    plgpu.barrier_wait(bias_loaded.at[slot])
                    bias = bias_smem[slot, pl.ds(wg * bq, bq)]
                qk, _ = _logits2(qk, s, bias)
                if masked:
                    kv_seg = tile_mask = None
                    if s.segments:
                        plgpu.barrier_wait(kvseg_loaded.at[slot])
                        kv_seg = _load_rows(kvseg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                    if s.mask is not None:
                        plgpu.barrier_wait(mask_loaded.at[slot])
                        tile_mask = mask_smem[slot, pl.ds(wg * bq, bq)]
                    keep = _keep(s, q_start, j * bk, (bq, bk), q_seg, kv_seg, q_len, kv_len, mask=tile_mask)
                    qk = jnp.where(keep, qk, -jnp.inf)
                return qk

            def step(j, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = slot_of(j)
                qk = scores(slot)
                plgpu.barrier_arrive(k_consumed.at[slot])
                qk = logits(j, slot, qk, masked)

                m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
                m_use = m_new
                if masked or s.bias is not None:
                    # A row without a key so far (masked, or a bias of -inf): exponents against 0, so
                    # p = alpha = 0.
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_use, qk.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)  # the softmax sums every probability, dropped or not
                if row_hash is not None:
                    p = jnp.where(_dropout_keep(s, row_hash, 0, j * bk, (bq, bk)), p, 0.0)
                p_lo = p.astype(dtype)
                acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))

                plgpu.barrier_arrive(schedule)  # softmax done: the other warpgroup may multiply
                plgpu.barrier_wait(v_loaded.at[slot])
                plgpu.barrier_wait(schedule)  # the tensor cores are ours again

                def wait_next_keys():
                    nxt = j + 1

                    @pl.when(nxt < blocks.stop)
                    def _():
                        plgpu.barrier_wait(k_loaded.at[slot_of(nxt)])

                if interpret:
                    # The GPU interpreter takes WGMMA operands from shared memory only, and no
                    # accumulator through run_state: P is staged and the product added here.
                    p_smem = p_smem2.at[wg]
                    p_smem[...] = p_lo
                    plgpu.commit_smem()

                    def pv_product(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                        wait_next_keys()
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_product, plgpu.ACC((bq, D), jnp.float32))
                else:

                    def pv_accumulate(acc_ref):
                        plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
                        wait_next_keys()

                    acc = pl.run_state(pv_accumulate)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_new, l_i

            # Key blocks: masked before the band's mask-free part only with a window.
            def skip(j, carry):
                # A block the segment ids / mask leave without a visible pair (its keys were waited
                # for at the previous step): released as the other warpgroup's are, then the next
                # block's keys awaited as a step does.
                slot = slot_of(j)
                _wait_all((v_loaded, kvseg_loaded, mask_loaded, bias_loaded), slot)
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                schedule_turn()
                schedule_turn()

                @pl.when(j + 1 < blocks.stop)
                def _():
                    plgpu.barrier_wait(k_loaded.at[slot_of(j + 1)])

                return carry

            def softmax(j, qk, m_i, l_i, masked):
                """The online softmax of block ``j``'s logits: ``(P in the inputs' dtype, the new
                row max, the new row sum, the factor that rescales the accumulator)``."""
                m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
                m_use = m_new
                if masked or s.bias is not None:  # a row without a key so far: p = alpha = 0
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_use, qk.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                if row_hash is not None:
                    p = jnp.where(_dropout_keep(s, row_hash, 0, j * bk, (bq, bk)), p, 0.0)
                return p.astype(dtype), m_new, l_i, alpha

            def next_turn(j):
                """The second schedule turn of block ``j``'s step: while the other warpgroup
                multiplies, wait for the next block's keys (this block's values are awaited when its
                ``P V`` is issued, a step later)."""
                plgpu.barrier_arrive(schedule)

                @pl.when(j + 1 < blocks.stop)
                def _():
                    plgpu.barrier_wait(k_loaded.at[slot_of(j + 1)])

                plgpu.barrier_wait(schedule)

            def pv_staged(acc, p_lo, slot):
                """``acc + P V`` as the GPU interpreter runs it (``P`` through shared memory)."""
                p_smem = p_smem2.at[wg]
                p_smem[...] = p_lo
                plgpu.commit_smem()

                def pv_product(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                    return acc_ref[...]

                return acc + pl.run_scoped(pv_product, plgpu.ACC((bq, D), jnp.float32))

            def first_block(carry):
                # The pipeline's head: block `start`'s Q K^T and softmax (P waits for the next step).
                acc, m_i, l_i, _ = carry
                j = blocks.start
                slot = slot_of(j)
                qk = scores(slot)
                plgpu.barrier_arrive(k_consumed.at[slot])
                p_lo, m_new, l_i, _ = softmax(j, logits(j, slot, qk, True), m_i, l_i, True)  # acc is 0
                l_i, m_new, p_lo = lax.optimization_barrier((l_i, m_new, p_lo))
                next_turn(j)
                return acc, m_new, l_i, p_lo

            def overlapped_step(j, carry, masked: bool):
                # Block j's Q K^T and block j - 1's P V issued together; block j's softmax runs while
                # they multiply (the first wait leaves the P V in flight), then P V is awaited and
                # the accumulator rescaled.
                acc, m_i, l_i, p_prev = carry
                slot, prev = slot_of(j), slot_of(j - 1)
                if interpret:  # the same order of steps, each product awaited (see pv_staged)
                    qk = scores(slot)
                    plgpu.barrier_wait(v_loaded.at[prev])
                    acc = pv_staged(acc, p_prev, prev)
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    p_lo, m_new, l_new, alpha = softmax(j, logits(j, slot, qk, masked), m_i, l_i, masked)
                else:

                    def products(refs):
                        acc_ref, qk_ref, p_ref, m_ref, l_ref, alpha_ref = refs
                        plgpu.wgmma(qk_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                        plgpu.barrier_wait(v_loaded.at[prev])  # (block j's keys multiply meanwhile)
                        plgpu.wgmma(acc_ref, p_prev, v_smem.at[prev])
                        schedule_turn()
                        qk = plgpu.wgmma_accumulator_load(qk_ref, wait_n=1)  # P V still in flight
                        plgpu.barrier_arrive(k_consumed.at[slot])
                        outs = softmax(j, logits(j, slot, qk, masked), m_i, l_i, masked)
                        for ref, value in zip((p_ref, m_ref, l_ref, alpha_ref), outs):
                            ref[...] = value

                    zeros = plgpu.layout_cast(jnp.zeros((bq, bk), jnp.float32), plgpu.Layout.WGMMA)
                    state = (plgpu.ACC.init(acc), plgpu.ACC.init(zeros), p_prev, m_i, l_i, m_i)
                    acc, _, p_lo, m_new, l_new, alpha = pl.run_state(products)(state)  # waits for P V
                plgpu.barrier_arrive(v_consumed.at[prev])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                # p_prev goes through the barrier too: live until P V has been awaited, its registers
                # cannot hold the new P (which would make the softmax wait for P V).
                acc, l_new, m_new, p_lo, _ = lax.optimization_barrier((acc, l_new, m_new, p_lo, p_prev))
                next_turn(j)
                return acc, m_new, l_new, p_lo

            def last_block(carry):
                # The pipeline's tail: the last block's P V.
                acc, _, _, p_lo = carry
                slot = slot_of(blocks.stop - 1)
                plgpu.barrier_wait(v_loaded.at[slot])
                if interpret:
                    acc = pv_staged(acc, p_lo, slot)
                else:

                    def pv_accumulate(acc_ref):
                        plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])

                    acc = pl.run_state(pv_accumulate)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc

            if cfg.overlap and not s.every_block_masked:
                p0 = plgpu.layout_cast(jnp.zeros((bq, bk), dtype), plgpu.Layout.WGMMA)
                carry = (acc, m_i, l_i, p0)
                static = all(isinstance(b, int) for b in blocks)
                if static:  # a fixed range of at least one block (no causal mask, window or lengths)
                    carry = first_block(carry)
                else:
                    carry = lax.cond(blocks.stop > blocks.start, first_block, lambda c: c, carry)
                lo = blocks.start + 1
                if static:
                    fl = max(blocks.free_lo, lo)
                    rest = _Blocks(lo, fl, max(blocks.free_hi, fl), blocks.stop)
                else:  # every bound equal (ring_lo) when the blocks are empty: the loops run none
                    fl = jnp.maximum(blocks.free_lo, lo)
                    fh = jnp.maximum(blocks.free_hi, fl)
                    rest = _Blocks(lo, fl, fh, jnp.maximum(blocks.stop, fh))
                carry = _block_loops(overlapped_step, rest, carry, s, lead=s.window is not None)
                m_i, l_i = carry[1], carry[2]
                if static:
                    acc = last_block(carry)
                else:
                    acc = lax.cond(blocks.stop > blocks.start, last_block, lambda c: c[0], carry)
            else:
                acc, m_i, l_i = _block_loops(
                    step,
                    blocks,
                    (acc, m_i, l_i),
                    s,
                    lead=s.window is not None,
                    visible=x.visible_fn(bi, head, tile * 2 + wg),
                    skip=skip,
                )
            if s.banded:  # blocks after this warpgroup's band: the other's
                lax.fori_loop(blocks.stop, ring_hi, release, None)
            pl.when(wg == 0)(schedule_turn)

            # A row that saw no key (l = 0, acc = 0): output 0 and LSE -inf, as the reference.
            empty = l_i == 0.0
            l_div = jnp.where(empty, 1.0, l_i)
            inv = (s.keep_scale if s.dropout_threshold is not None else 1.0) / l_div
            qo_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
            lse_smem[...] = jnp.where(empty, -jnp.inf, (m_i + jnp.log2(l_div)) * _LN2)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[bi, pl.ds(q_start, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, head, pl.ds(q_start, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            kv_head = lax.div(head, jnp.int32(G))

            def load(j, slot, wait_values=None):
                rows = (bi, pl.ds(j * bk, bk), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
                if wait_values is not None:
                    wait_values()
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])
                if s.segments:  # read after the keys are released: guarded by the values' barrier
                    plgpu.copy_gmem_to_smem(
                        x.kv_seg.at[bi, pl.ds(j * bk, bk)], kvseg_smem.at[slot], kvseg_loaded.at[slot]
                    )
                if s.mask is not None:  # the tile of both compute warpgroups' rows; guarded the same way
                    tiles = x.mask_tiles(s, bi, head).at[pl.ds(tile * (2 * bq), 2 * bq), pl.ds(j * bk, bk)]
                    plgpu.copy_gmem_to_smem(tiles, mask_smem.at[slot], mask_loaded.at[slot])
                if s.bias is not None:
                    tiles = x.bias_tiles(s, bi, head).at[pl.ds(tile * (2 * bq), 2 * bq), pl.ds(j * bk, bk)]
                    plgpu.copy_gmem_to_smem(tiles, bias_smem.at[slot], bias_loaded.at[slot])

            def wait_free(slot):
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])

            if cfg.overlap and not s.every_block_masked:
                # The values of a block are released a step after its keys (its P V runs with the
                # next block's Q K^T): a slot's next keys are loaded once its keys are released, its
                # values (and the tiles they guard) once they are.
                def reload(r, slot):
                    wait_values = functools.partial(plgpu.barrier_wait, v_consumed.at[slot])
                    load(ring_lo + r, slot, wait_values=wait_values)

                _fill_ring(
                    ring_hi - ring_lo,
                    stages,
                    lambda r, slot: load(ring_lo + r, slot),
                    lambda slot: plgpu.barrier_wait(k_consumed.at[slot]),
                    wait_tail=wait_free,
                    reload=reload,
                )
            else:
                _fill_ring(ring_hi - ring_lo, stages, lambda r, slot: load(ring_lo + r, slot), wait_free)

    def entry(q_ref, k_ref, v_ref, *refs):
        x = _ExtraRefs.of(refs[:-2], s)
        out_ref, lse_ref = refs[-2:]
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = [
            plgpu.SMEM((2, bq, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq, bk), dtype, transforms=tiled) if interpret else None,
            plgpu.SMEM((2, bq), jnp.int32) if s.segments else None,
            plgpu.SMEM((stages, bk), jnp.int32) if s.segments else None,
            plgpu.SMEM((2, bq), jnp.uint32) if s.dropout_threshold is not None else None,
            plgpu.SMEM((stages, 2 * bq, bk), jnp.int8, transforms=_byte_tiles(bk)) if s.mask else None,
            plgpu.SMEM((stages, 2 * bq, bk), dtype, transforms=tiled) if s.bias else None,
        ]
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, x, out_ref, lse_ref, scoped),
            scratch,
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=(1 + s.segments + (s.dropout_threshold is not None), 2)),
                plgpu.Barrier(num_barriers=stages) if s.segments else None,
                plgpu.Barrier(num_barriers=stages) if s.mask else None,
                plgpu.Barrier(num_barriers=stages) if s.bias else None,
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    extra = _interpret_kw(interpret)
    out_type = (
        base.out_struct((s.B, s.Tp, s.N, D), dtype, q),
        base.out_struct((s.B, s.N, s.Tp), jnp.float32, q),
    )
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(s.N, s.Tp // (2 * bq), s.B),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **extra,
    )(q, k, v, *extras)


# ----------------------------------------------------------------------------------------------
# The backward kernels.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Tile sizes of the two backward kernels (both: two compute warpgroups and a memory one).

    Attributes:
      block_kv_dq: keys per step of the dQ kernel (its warpgroups own 64 query rows each).
      block_q_dkv: query rows per step of the dK / dV kernel (its warpgroups own 64 keys each).
      stages: blocks in flight (ring slots), at least 2.
      block_ranges: :class:`Config`'s ``block_ranges`` for both backward kernels (the dK / dV
        kernel's range over query blocks covers every query head of a kv head's group).
    """

    block_kv_dq: int = 64
    block_q_dkv: int = 64
    stages: int = 2
    block_ranges: bool = False

    def __post_init__(self):
        for name in ("block_kv_dq", "block_q_dkv", "stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"BwdConfig.{name} must be an int; got {type(value).__name__}")
        for name in ("block_kv_dq", "block_q_dkv"):
            value = getattr(self, name)
            if value <= 0 or value % 64 or value > 256:
                raise ValueError(
                    f"BwdConfig.{name} must be a multiple of 64 up to 256 (a WGMMA's N); got {value}"
                )
        if self.stages < 2:
            raise ValueError(f"BwdConfig.stages must be at least 2; got {self.stages}")
        if not isinstance(self.block_ranges, bool):
            raise TypeError(f"BwdConfig.block_ranges must be a bool; got {type(self.block_ranges).__name__}")

    def smem_bytes(
        self,
        head_dim: int,
        itemsize: int = 2,
        segments: bool = False,
        dropout: bool = False,
        mask: bool = False,
        bias: bool = False,
    ) -> int:
        """The larger of the two kernels' shared memory at ``head_dim``: the dQ kernel's queries and
        dO of both warpgroups, the key / value ring and the row statistics; the dK / dV kernel's keys
        and values of both warpgroups, the query / dO ring and its statistics; with ``segments`` each
        kernel's own segment ids and a ring of the other side's; with ``dropout`` the query rows'
        hashes (a third statistic); with ``mask`` a ring of int8 mask tiles in each; with ``bias`` a
        ring of bias tiles in each, and the dQ kernel's float32 dS tiles on their way out (the bias
        gradient)."""
        own = 2 * 64 * head_dim * itemsize  # two warpgroups' 64 rows (dQ) or keys (dK / dV)
        kv_ring = self.stages * self.block_kv_dq
        q_ring = self.stages * self.block_q_dkv
        dq = [own] * 2 + [kv_ring * head_dim * itemsize] * 2 + [128 * kv_ring] * mask
        dq += [128 * kv_ring * itemsize, 128 * self.block_kv_dq * 4] * bias
        dq_vectors = [128] * (2 + dropout) + [128, kv_ring] * segments
        dkv = [own] * 2 + [q_ring * head_dim * itemsize] * 2 + [128 * q_ring] * mask
        dkv += [128 * q_ring * itemsize] * bias
        dkv_vectors = [q_ring] * (2 + dropout) + [128, q_ring] * segments
        return max(
            _smem_total(dq + [n * 4 for n in dq_vectors]), _smem_total(dkv + [n * 4 for n in dkv_vectors])
        )

    @staticmethod
    def search_space(args: base.AttentionArgs) -> list:
        """The configs a tuning sweep tries for ``args`` (``benchmarks/tune_gpu.py``): 64 or 128 keys per
        dQ step and queries per dK / dV step, 2 or 3 ring slots, those that fit an sm90 block's shared
        memory (wider steps would hold more float32 tiles in registers than a warpgroup has)."""
        space = [
            BwdConfig(block_kv_dq=a, block_q_dkv=b, stages=n)
            for a in (64, 128)
            for b in (64, 128)
            for n in (2, 3)
        ]
        if _ranges_apply(args):
            space += [dataclasses.replace(c, block_ranges=True) for c in space]
        return [c for c in space if _fits(c, args)]


#: Head dims the Mosaic backward takes: dK and dV of a warpgroup's 64 keys stay in registers (2 x 64
#: float32 registers per thread at 128); at 256 the Triton backward runs.
_BWD_HEAD_DIMS = (64, 128)


def _load_rows(ref, layout):
    """A float32 vector from shared memory in ``layout`` (``plgpu.load`` needs an index argument in
    jax 0.10, deprecates it in 0.11 and has none from 0.12)."""
    if _load_needs_index():
        return _plgpu().load(ref, (), layout=layout)
    return _plgpu().load(ref, layout=layout)


def _own_rows(src, smem, barrier):
    """A compute warpgroup's own vector (its 64 rows' segment ids or dropout hashes): copied from
    ``src`` in global memory to ``smem``, waited for, loaded in the WGMMA row layout."""
    plgpu = _plgpu()
    plgpu.copy_gmem_to_smem(src, smem, barrier)
    plgpu.barrier_wait(barrier)
    return _load_rows(smem, plgpu.Layout.WGMMA.reduce(1))


@functools.cache
def _load_needs_index() -> bool:
    idx = inspect.signature(_plgpu().load).parameters.get("idx")
    return idx is not None and idx.default is inspect.Parameter.empty


def _accumulate(acc, lhs, rhs_smem, stage_smem, interpret: bool):
    """``acc + lhs @ rhs_smem`` on the tensor cores, ``lhs`` from registers (in interpret mode staged
    through ``stage_smem``: the interpreter takes WGMMA operands from shared memory only)."""
    plgpu = _plgpu()
    if interpret:
        stage_smem[...] = lhs
        plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, stage_smem, rhs_smem)
            return acc_ref[...]

        return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))

    def update(acc_ref):
        plgpu.wgmma(acc_ref, lhs, rhs_smem)

    return pl.run_state(update)(plgpu.ACC.init(acc))


def _product(a_smem, b_smem_t, shape):
    """``a @ b.T`` of two shared-memory tiles, float32."""
    plgpu = _plgpu()

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem_t.transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _ds(p, dp, delta, t, axis: int):
    """``dS = P (dP - delta)``, times ``1 - t^2`` under a soft cap (:func:`_logits2`'s ``t``), float32.
    ``delta`` holds one value per query, which runs along ``axis`` of the tile: 0 in the dQ kernel
    (queries x keys), 1 in the dK / dV kernel (keys x queries)."""
    ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [axis]))
    return ds if t is None else ds * (1.0 - t * t)


def _dq_call(
    q, k, v, do, lse2, delta, extras, s: _Shape, cfg: BwdConfig, interpret: bool, dbias: bool = False
):
    """dQ (``[B, Tp, N, D]`` in q.dtype) on padded inputs: ``lse2`` the forward's LSE in base 2
    (``+inf`` on padded or empty rows), ``delta`` ``rowsum(dO * O) - dLSE`` (``[B, N, Tp]`` float32),
    ``extras`` the padded :func:`_extras`. With ``dbias`` also ``dS`` (the gradient of the logits,
    ``[B, N, Tp, Sp]`` float32), written where a step ran: the tiles no step reached are left as they
    are (the caller zeroes what no query sees)."""
    plgpu = _plgpu()
    dtype = jnp.dtype(s.dtype)
    bq, bk, D = 64, cfg.block_kv_dq, s.D
    stages = max(1, min(cfg.stages, s.Sp // bk))
    G = s.N // s.K
    c = _exponent_scale(s)

    def kernel(ins, x, dq_ref, ds_ref, scoped):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        bi = lax.axis_index("batch")
        head = lax.axis_index("heads")
        tile = lax.axis_index("q_tiles")
        wg = lax.axis_index("wg")
        q_len, kv_len = x.lengths(bi)
        blocks_of = functools.partial(_key_blocks, block_q=bq, s=s, block_kv=bk, q_len=q_len, kv_len=kv_len)
        if s.block_ranges:
            blocks_of = _narrowed(blocks_of, x.range_fn(bi, head), bq)
        smem, loaded, own, consumed = scoped
        (
            q_smem2,
            do_smem2,
            lse_smem2,
            delta_smem2,
            k_smem,
            v_smem,
            ds_smem2,
            qseg_smem2,
            kvseg_smem,
            hash_smem2,
            mask_smem,
            bias_smem,
            dsout_smem2,
        ) = smem
        k_loaded, v_loaded, kvseg_loaded, mask_loaded, bias_loaded = loaded
        ring_lo, ring_hi = _ring(blocks_of, tile * (2 * bq), bq, s)

        def slot_of(j):  # key block j's ring slot
            return lax.rem(j - ring_lo, jnp.int32(stages))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            q_start = tile * (2 * bq) + wg * bq
            blocks = blocks_of(q_start).within(ring_lo)
            rows = (bi, pl.ds(q_start, bq), head)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, own.at[0, wg])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, own.at[1, wg])
            plgpu.copy_gmem_to_smem(lse_ref.at[bi, head, pl.ds(q_start, bq)], lse_smem2.at[wg], own.at[2, wg])
            plgpu.copy_gmem_to_smem(
                delta_ref.at[bi, head, pl.ds(q_start, bq)], delta_smem2.at[wg], own.at[3, wg]
            )
            if s.segments:
                plgpu.copy_gmem_to_smem(x.q_seg.at[bi, pl.ds(q_start, bq)], qseg_smem2.at[wg], own.at[4, wg])
            if s.dropout_threshold is not None:
                plgpu.copy_gmem_to_smem(
                    x.row_hash.at[bi, head, pl.ds(q_start, bq)], hash_smem2.at[wg], own.at[4 + s.segments, wg]
                )
            for i in range(own_count):
                plgpu.barrier_wait(own.at[i, wg])
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            lse = _load_rows(lse_smem2.at[wg], row_layout)
            delta = _load_rows(delta_smem2.at[wg], row_layout)
            q_seg = _load_rows(qseg_smem2.at[wg], row_layout) if s.segments else None
            row_hash = _load_rows(hash_smem2.at[wg], row_layout) if s.dropout_threshold is not None else None
            dq = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def release(j, _):
                # Blocks streamed for the other warpgroup's rows. Waited for first: an arrival before
                # the slot is refilled would count toward its previous use, which the other
                # warpgroup may still be reading.
                slot = slot_of(j)
                _wait_all((k_loaded, v_loaded, kvseg_loaded, mask_loaded, bias_loaded), slot)
                plgpu.barrier_arrive(consumed.at[slot])

            if s.window is not None or s.block_ranges:
                lax.fori_loop(ring_lo, blocks.start, release, None)

            def step(j, dq, masked: bool):
                slot = slot_of(j)
                plgpu.barrier_wait(k_loaded.at[slot])
                plgpu.barrier_wait(v_loaded.at[slot])
                bias = None
                if s.bias is not None:
                    plgpu.barrier_wait(bias_loaded.at[slot])
                    bias = bias_smem[slot, pl.ds(wg * bq, bq)]
                qk, t = _logits2(_product(q_smem, k_smem.at[slot], (bq, bk)), s, bias)
                dp = _product(do_smem, v_smem.at[slot], (bq, bk))
                if masked:
                    kv_seg = tile_mask = None
                    if s.segments:
                        plgpu.barrier_wait(kvseg_loaded.at[slot])
                        kv_seg = _load_rows(kvseg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                    if s.mask is not None:
                        plgpu.barrier_wait(mask_loaded.at[slot])
                        tile_mask = mask_smem[slot, pl.ds(wg * bq, bq)]
                    keep = _keep(s, q_start, j * bk, (bq, bk), q_seg, kv_seg, q_len, kv_len, mask=tile_mask)
                    qk = jnp.where(keep, qk, -jnp.inf)
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(lse, qk.shape, [0]))
                if row_hash is not None:  # dP of the kept probabilities, scaled as the forward's
                    keep = _dropout_keep(s, row_hash, 0, j * bk, (bq, bk))
                    dp = jnp.where(keep, dp * s.keep_scale, 0.0)
                ds = _ds(p, dp, delta, None, axis=0)  # the gradient of the logits (the bias's)
                if dbias:
                    dsout = dsout_smem2.at[wg]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile has left
                    dsout[...] = ds
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dsout, ds_ref.at[bi, head, pl.ds(q_start, bq), pl.ds(j * bk, bk)])
                if t is not None:
                    ds = ds * (1.0 - t * t)
                dq = _accumulate(
                    dq,
                    ds.astype(dtype),
                    k_smem.at[slot],
                    None if ds_smem2 is None else ds_smem2.at[wg],
                    interpret,
                )
                plgpu.barrier_arrive(consumed.at[slot])
                return dq

            dq = _block_loops(
                step,
                blocks,
                dq,
                s,
                lead=s.window is not None,
                visible=x.visible_fn(bi, head, tile * 2 + wg),
                skip=lambda j, dq: (release(j, None), dq)[1],
            )
            if s.banded:
                lax.fori_loop(blocks.stop, ring_hi, release, None)
            q_smem[...] = (dq * s.scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            kv_head = lax.div(head, jnp.int32(G))

            def load(j, slot):
                blk = (bi, pl.ds(j * bk, bk), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[blk], k_smem.at[slot], k_loaded.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[blk], v_smem.at[slot], v_loaded.at[slot])
                if s.segments:
                    plgpu.copy_gmem_to_smem(
                        x.kv_seg.at[bi, pl.ds(j * bk, bk)], kvseg_smem.at[slot], kvseg_loaded.at[slot]
                    )
                if s.mask is not None:
                    tiles = x.mask_tiles(s, bi, head).at[pl.ds(tile * (2 * bq), 2 * bq), pl.ds(j * bk, bk)]
                    plgpu.copy_gmem_to_smem(tiles, mask_smem.at[slot], mask_loaded.at[slot])
                if s.bias is not None:
                    tiles = x.bias_tiles(s, bi, head).at[pl.ds(tile * (2 * bq), 2 * bq), pl.ds(j * bk, bk)]
                    plgpu.copy_gmem_to_smem(tiles, bias_smem.at[slot], bias_loaded.at[slot])

            _fill_ring(
                ring_hi - ring_lo,
                stages,
                lambda r, slot: load(ring_lo + r, slot),
                lambda slot: plgpu.barrier_wait(consumed.at[slot]),
            )

    own_count = 4 + s.segments + (s.dropout_threshold is not None)

    def entry(*refs):
        n_out = 2 if dbias else 1
        ins, (dq_ref, *ds_ref) = refs[:-n_out], refs[-n_out:]
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        scratch = [
            plgpu.SMEM((2, bq, D), dtype, transforms=tiled),
            plgpu.SMEM((2, bq, D), dtype, transforms=tiled),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((stages, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((2, bq, bk), dtype, transforms=tiled) if interpret else None,
            plgpu.SMEM((2, bq), jnp.int32) if s.segments else None,
            plgpu.SMEM((stages, bk), jnp.int32) if s.segments else None,
            plgpu.SMEM((2, bq), jnp.uint32) if s.dropout_threshold is not None else None,
            plgpu.SMEM((stages, 2 * bq, bk), jnp.int8, transforms=_byte_tiles(bk)) if s.mask else None,
            plgpu.SMEM((stages, 2 * bq, bk), dtype, transforms=tiled) if s.bias else None,
            plgpu.SMEM((2, bq, bk), jnp.float32, transforms=tiled32) if dbias else None,
        ]
        pl.run_scoped(
            lambda *scoped: kernel(
                ins[:6], _ExtraRefs.of(ins[6:], s), dq_ref, ds_ref[0] if ds_ref else None, scoped
            ),
            scratch,
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages) if s.segments else None,
                plgpu.Barrier(num_barriers=stages) if s.mask else None,
                plgpu.Barrier(num_barriers=stages) if s.bias else None,
            ),
            plgpu.Barrier(num_barriers=(own_count, 2)),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
        )

    out_type = base.out_struct((s.B, s.Tp, s.N, D), dtype, q)
    if dbias:
        out_type = (out_type, base.out_struct((s.B, s.N, s.Tp, s.Sp), jnp.float32, q))
    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(s.N, s.Tp // (2 * bq), s.B),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **_interpret_kw(interpret),
    )(q, k, v, do, lse2, delta, *extras)


def _dkv_call(q, k, v, do, lse2, delta, extras, s: _Shape, cfg: BwdConfig, interpret: bool):
    """dK, dV (``[B, Sp, K, D]`` in k.dtype) on padded inputs (see :func:`_dq_call`). Each warpgroup
    owns 64 keys of one kv head and walks the query blocks of every query head of its group that can
    see them, so the GQA sum stays in registers."""
    plgpu = _plgpu()
    dtype = jnp.dtype(s.dtype)
    bk, bq, D = 64, cfg.block_q_dkv, s.D
    nq = s.Tp // bq  # query blocks (the padded rows contribute nothing: lse2 = +inf, dO = 0)
    s_stages = max(1, min(cfg.stages, nq))
    G = s.N // s.K
    c = _exponent_scale(s)

    def query_blocks(k_start, q_hi, kv_len) -> _Blocks:
        """The query blocks that see some of keys ``[k_start, k_start + 64)`` (:class:`_Blocks`; the
        causal / window band), mask-free where every row of the block sees every key. ``q_hi`` is
        ``nq``, or fewer under a query length (the rows past it have LSE ``+inf``: P = 0, no mask
        needed). Keys at or past the key length ``kv_len`` (or past ``S``) need none; a tile the
        length cuts is masked in every step."""
        if not s.banded:
            return _Blocks(0, 0, q_hi, q_hi)
        bq32 = jnp.int32(bq)
        # In query blocks: [lo, hi) see some key of the tile, [free_lo, free_hi) all of them.
        lo = free_lo = jnp.int32(0)
        hi = free_hi = jnp.int32(q_hi)
        if s.right_reach is not None:  # the first rows that see the tile's first / last key
            lo = lax.div(jnp.maximum(k_start - (s.diag_offset + s.right_reach), 0), bq32)
            first_all = k_start + (bk - 1 - s.diag_offset - s.right_reach)
            free_lo = lax.div(jnp.maximum(first_all, 0) + (bq - 1), bq32)
        if s.window is not None:  # the last rows that see the tile's last / first key, plus one
            past_any = k_start + (bk - s.diag_offset + s.window[0])
            past_all = k_start + (1 - s.diag_offset + s.window[0])
            hi = jnp.minimum(lax.div(jnp.maximum(past_any, 0) + (bq - 1), bq32), q_hi)
            free_hi = lax.div(jnp.maximum(past_all, 0), bq32)
        past = k_start >= s.S
        if kv_len is not None:
            past = past | (k_start >= kv_len)
            free_hi = jnp.where(k_start + bk > kv_len, 0, free_hi)
        hi = jnp.where(past, 0, hi)
        lo = jnp.minimum(lo, hi)
        free_lo = jnp.clip(free_lo, lo, hi)
        return _Blocks(lo, free_lo, jnp.clip(free_hi, free_lo, hi), hi)

    def kernel(ins, x, dk_ref, dv_ref, scoped):
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        bi = lax.axis_index("batch")
        kv_head = lax.axis_index("heads")
        tile = lax.axis_index("kv_tiles")
        wg = lax.axis_index("wg")
        q_len, kv_len = x.lengths(bi)
        q_hi = nq if q_len is None else jnp.clip(lax.div(q_len + (bq - 1), jnp.int32(bq)), 0, nq)
        smem, loaded, own, consumed = scoped
        (
            k_smem2,
            v_smem2,
            q_smem,
            do_smem,
            lse_smem,
            delta_smem,
            st_smem2,
            kseg_smem2,
            qseg_smem,
            hash_smem,
            mask_smem,
            bias_smem,
        ) = smem
        (
            q_loaded,
            do_loaded,
            lse_loaded,
            delta_loaded,
            qseg_loaded,
            hash_loaded,
            mask_loaded,
            bias_loaded,
        ) = loaded
        # The ring streams, for each query head of the group, the query blocks either warpgroup's
        # keys need: step t is (head g, block ring_lo + t % n).
        blocks_of = functools.partial(query_blocks, q_hi=q_hi, kv_len=kv_len)
        if s.block_ranges:  # a kv head's range: over its group's query heads
            blocks_of = _narrowed(blocks_of, x.range_fn(bi, kv_head * G), bk)
        ring_lo, ring_hi = _ring(blocks_of, tile * (2 * bk), bk, s)
        n = ring_hi - ring_lo
        ring_steps = G * n

        def slot_of(i, g):  # query block i of head g's ring slot
            return lax.rem(g * n + (i - ring_lo), jnp.int32(s_stages))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            k_start = tile * (2 * bk) + wg * bk
            blocks = blocks_of(k_start).within(ring_lo)
            keys_blk = (bi, pl.ds(k_start, bk), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[keys_blk], k_smem, own.at[0, wg])
            plgpu.copy_gmem_to_smem(v_ref.at[keys_blk], v_smem, own.at[1, wg])
            k_seg = None
            if s.segments:
                k_seg = _own_rows(x.kv_seg.at[bi, pl.ds(k_start, bk)], kseg_smem2.at[wg], own.at[2, wg])
            plgpu.barrier_wait(own.at[0, wg])
            plgpu.barrier_wait(own.at[1, wg])
            zeros = jnp.full((bk, D), 0.0, jnp.float32)
            dk = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
            dv = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)

            def wait_slot(slot):
                _wait_all(loaded, slot)

            def step(i, carry, g, masked: bool):
                dk, dv = carry
                slot = slot_of(i, g)
                wait_slot(slot)
                bias = None
                if s.bias is not None:  # the transposed bias: this warpgroup's keys x the queries
                    bias = bias_smem[slot, pl.ds(wg * bk, bk)]
                st, t = _logits2(_product(k_smem, q_smem.at[slot], (bk, bq)), s, bias)  # S^T: keys x queries
                lse = _load_rows(lse_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                delta = _load_rows(delta_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                if masked:  # the query length needs no mask here: its rows' P is 0 (LSE +inf)
                    q_seg = tile_mask = None
                    if s.segments:
                        q_seg = _load_rows(qseg_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                    if s.mask is not None:  # the transposed mask: this warpgroup's keys x the queries
                        tile_mask = mask_smem[slot, pl.ds(wg * bk, bk)]
                    keep = _keep(
                        s,
                        i * bq,
                        k_start,
                        (bk, bq),
                        q_seg,
                        k_seg,
                        kv_len=kv_len,
                        query_axis=1,
                        mask=tile_mask,
                    )
                    st = jnp.where(keep, st, -jnp.inf)
                pt = jnp.exp2(st * c - lax.broadcast_in_dim(lse, st.shape, [1]))
                pt_kept, keep = pt, None
                if s.dropout_threshold is not None:  # the kept probabilities, scaled as the forward's
                    row_hash = _load_rows(hash_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                    keep = _dropout_keep(s, row_hash, 1, k_start, (bk, bq))
                    pt_kept = jnp.where(keep, pt * s.keep_scale, 0.0)
                dv = _accumulate(
                    dv,
                    pt_kept.astype(dtype),
                    do_smem.at[slot],
                    None if st_smem2 is None else st_smem2.at[wg],
                    interpret,
                )
                dpt = _product(v_smem, do_smem.at[slot], (bk, bq))  # (dO V^T)^T
                if keep is not None:
                    dpt = jnp.where(keep, dpt * s.keep_scale, 0.0)
                dst = _ds(pt, dpt, delta, t, axis=1)
                dk = _accumulate(
                    dk,
                    dst.astype(dtype),
                    q_smem.at[slot],
                    None if st_smem2 is None else st_smem2.at[wg],
                    interpret,
                )
                plgpu.barrier_arrive(consumed.at[slot])
                return dk, dv

            def skip(i, _, g):
                # Blocks streamed for the other warpgroup's keys: waited for (each warpgroup must
                # pass every phase of a barrier it waits on later) and released.
                slot = slot_of(i, g)
                wait_slot(slot)
                plgpu.barrier_arrive(consumed.at[slot])

            def head_of_group(g, carry):
                if s.banded:
                    lax.fori_loop(ring_lo, blocks.start, functools.partial(skip, g=g), None)
                # Query blocks: masked first along the diagonal (causal / window), last past the
                # window or in every step of a tile the key length cuts.
                carry = _block_loops(
                    functools.partial(step, g=g),
                    blocks,
                    carry,
                    s,
                    lead=s.right_reach is not None,
                    trail=s.window is not None or s.kv_lengths,
                    visible=x.visible_fn(bi, kv_head * G + g, tile * 2 + wg),
                    skip=lambda i, carry: (skip(i, None, g), carry)[1],
                )
                if s.banded:
                    lax.fori_loop(blocks.stop, ring_hi, functools.partial(skip, g=g), None)
                return carry

            dk, dv = lax.fori_loop(0, G, head_of_group, (dk, dv))
            k_smem[...] = (dk * s.scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys_blk], commit_group=False)
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys_blk], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():

            def load(t, slot):
                per_head = jnp.int32(n) if isinstance(n, int) else n
                g = lax.div(t, per_head)
                i = ring_lo + lax.rem(t, per_head)
                head = kv_head * G + g
                rows = (bi, pl.ds(i * bq, bq), head)
                stats = (bi, head, pl.ds(i * bq, bq))
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_loaded.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], lse_loaded.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], delta_loaded.at[slot])
                if s.segments:
                    plgpu.copy_gmem_to_smem(
                        x.q_seg.at[bi, pl.ds(i * bq, bq)], qseg_smem.at[slot], qseg_loaded.at[slot]
                    )
                if s.dropout_threshold is not None:
                    plgpu.copy_gmem_to_smem(x.row_hash.at[stats], hash_smem.at[slot], hash_loaded.at[slot])
                if s.mask is not None:  # both warpgroups' keys x the block's queries
                    tiles = x.mask_tiles(s, bi, head).at[pl.ds(tile * (2 * bk), 2 * bk), pl.ds(i * bq, bq)]
                    plgpu.copy_gmem_to_smem(tiles, mask_smem.at[slot], mask_loaded.at[slot])
                if s.bias is not None:
                    tiles = x.bias_tiles(s, bi, head).at[pl.ds(tile * (2 * bk), 2 * bk), pl.ds(i * bq, bq)]
                    plgpu.copy_gmem_to_smem(tiles, bias_smem.at[slot], bias_loaded.at[slot])

            _fill_ring(ring_steps, s_stages, load, lambda slot: plgpu.barrier_wait(consumed.at[slot]))

    def entry(*refs):
        ins, outs = refs[:-2], refs[-2:]
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = [
            plgpu.SMEM((2, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((2, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((s_stages, bq, D), dtype, transforms=tiled),
            plgpu.SMEM((s_stages, bq, D), dtype, transforms=tiled),
            plgpu.SMEM((s_stages, bq), jnp.float32),
            plgpu.SMEM((s_stages, bq), jnp.float32),
            plgpu.SMEM((2, bk, bq), dtype, transforms=tiled) if interpret else None,
            plgpu.SMEM((2, bk), jnp.int32) if s.segments else None,
            plgpu.SMEM((s_stages, bq), jnp.int32) if s.segments else None,
            plgpu.SMEM((s_stages, bq), jnp.uint32) if s.dropout_threshold is not None else None,
            plgpu.SMEM((s_stages, 2 * bk, bq), jnp.int8, transforms=_byte_tiles(bq)) if s.mask else None,
            plgpu.SMEM((s_stages, 2 * bk, bq), dtype, transforms=tiled) if s.bias else None,
        ]
        ring = plgpu.Barrier(num_barriers=s_stages)
        pl.run_scoped(
            lambda *scoped: kernel(ins[:6], _ExtraRefs.of(ins[6:], s), *outs, scoped),
            scratch,
            (ring,) * 4
            + tuple(
                ring if on else None for on in (s.segments, s.dropout_threshold is not None, s.mask, s.bias)
            ),
            plgpu.Barrier(num_barriers=(3 if s.segments else 2, 2)),
            plgpu.Barrier(num_arrivals=2, num_barriers=s_stages),
            collective_axes="wg",
        )

    kv_struct = base.out_struct((s.B, s.Sp, s.K, D), dtype, k)
    return plgpu.kernel(
        entry,
        out_type=(kv_struct, kv_struct),
        grid=(s.K, s.Sp // (2 * bk), s.B),
        grid_names=("heads", "kv_tiles", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **_interpret_kw(interpret),
    )(q, k, v, do, lse2, delta, *extras)


def _interpret_kw(interpret: bool) -> dict:
    return {"interpret": _plgpu().InterpretGPUParams(detect_races=True)} if interpret else {}


def backward(
    args: base.AttentionArgs,
    out,
    lse,
    d_out,
    d_lse=None,
    *,
    config: Optional[BwdConfig] = None,
    interpret: bool = False,
    need_dbias: bool = True,
):
    """``(dq, dk, dv, dbias)`` of the forward kernel's ``(out, lse)`` for cotangents ``(d_out, d_lse)``
    (``d_lse`` may be None), with the Mosaic GPU dQ and dK / dV kernels (head dims 64 and 128).
    ``dbias`` is None without a bias or when ``need_dbias`` is False; else the dQ kernel writes the
    logits' gradient ``dS`` (``[B, N, T, S]`` float32) and XLA zeroes what no query sees (the tiles no
    step reached) and sums it over the bias's broadcast dimensions."""
    if config is not None and not isinstance(config, BwdConfig):
        raise TypeError(f"`bwd_config` must be a mosaic_flash.BwdConfig or None; got {type(config).__name__}")
    cfg = config or BwdConfig()
    _check_smem(cfg, args)
    T, S = args.q_len, args.kv_len
    # Both kernels' programs cover 128 queries / keys (two warpgroups of 64), and their steps the
    # other side's blocks: pad each length to a multiple of both.
    rows = math.lcm(128, cfg.block_q_dkv)
    keys = math.lcm(128, cfg.block_kv_dq)
    s = dataclasses.replace(_shape(args, Config()), Tp=-(-T // rows) * rows, Sp=-(-S // keys) * keys)
    s = _ranged(s, cfg)
    f32 = jnp.float32
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(f32), d_out.astype(f32), precision="highest")
    if d_lse is not None:
        delta = delta - d_lse.astype(f32)
    # Base-2 LSE; +inf where a row saw no key (its P is 0), and on the padded rows.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * _LOG2E)
    pad_rows = ((0, 0), (0, s.Tp - T), (0, 0), (0, 0))
    pad_keys = ((0, 0), (0, s.Sp - S), (0, 0), (0, 0))

    dbias = need_dbias and args.bias is not None

    def run(q, k, v, do, lse2, delta, *extras):
        raw = (q, k, v, extras)  # the unpadded operands (the bias gradient's mask)
        q, do = jnp.pad(q, pad_rows), jnp.pad(do.astype(q.dtype), pad_rows)
        k, v = jnp.pad(k, pad_keys), jnp.pad(v, pad_keys)
        lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, s.Tp - T)), constant_values=jnp.inf)
        delta = jnp.pad(delta, ((0, 0), (0, 0), (0, s.Tp - T)))
        extras = _kernel_extras(extras, s, q.shape[2])
        dq_extras = _with_flags(extras, s, 64, cfg.block_kv_dq)
        dq = _dq_call(q, k, v, do, lse2, delta, dq_extras, s, cfg, interpret, dbias=dbias)
        dkv_extras = _dkv_extras(extras, s, cfg.block_q_dkv)
        dk, dv = _dkv_call(q, k, v, do, lse2, delta, dkv_extras, s, cfg, interpret)
        if not dbias:
            return dq[:, :T], dk[:, :S], dv[:, :S]
        dq, ds = dq
        return dq[:, :T], dk[:, :S], dv[:, :S], _bias_grad(_with_extras(args, *raw), ds[:, :, :T, :S])

    d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse
    operands = (args.q, args.k, args.v, d_out, lse2, delta, *_extras(args), d_lse)
    if interpret:
        grads = run(*operands[:-1])
    else:

        def on_cpu(q, k, v, do, lse2, delta, *rest):  # lowered in multi-platform exports, never run
            *extras, d_lse = rest
            grads = base.reference_vjp(_with_extras(args, q, k, v, extras), do, d_lse)
            return tuple(grads[:4] if dbias else grads[:3])

        # The cotangents, segment ids and dropout seed are operands (a closure would make them
        # constants of the other branch).
        grads = gpu.gpu_call(lambda *a: run(*a[:-1]), on_cpu, operands)
    dq, dk, dv, *rest = grads
    return dq, dk, dv, (rest[0] if dbias else None)


def _bias_grad(args: base.AttentionArgs, ds):
    """The bias's gradient from the dQ kernel's ``dS [B, N, T, S]``: zero where no query sees the key
    (the causal / window band, lengths, segment ids, the mask: tiles there were never written),
    summed over the bias's broadcast dimensions, in its dtype."""
    seen = base.full_mask(args)
    if seen is not None:
        ds = jnp.where(seen, ds, 0.0)
    axes = tuple(a for a in range(4) if args.bias.shape[a] == 1 and ds.shape[a] != 1)
    return ds.sum(axis=axes, keepdims=True).astype(args.bias.dtype)


# ----------------------------------------------------------------------------------------------
# Backend entry points.
# ----------------------------------------------------------------------------------------------


def unsupported(
    args: base.AttentionArgs, platform: str, *, compute_capability: Optional[float] = None
) -> list:
    """Why the Mosaic GPU flash kernel cannot run ``args`` on ``platform`` (empty list if it can).

    Args:
      args: canonical arguments.
      platform: lowering platform.
      compute_capability: the target GPU's (e.g. ``9.0``); default: :func:`gpu.compute_capability`'s
        (``gpu.cuda_target``'s, else the local GPU's). WGMMA exists on sm90 only: an unknown target is
        refused.

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.attention import base, mosaic_flash
      >>> x = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
      >>> mosaic_flash.unsupported(base.make_args(x, x, x, is_causal=True), "cuda", compute_capability=9.0)
      []
      >>> mosaic_flash.unsupported(base.make_args(x, x, x, window=(16, 0)), "cuda", compute_capability=9.0)
      []
      >>> bias = jnp.zeros((1, 1, 128, 128), jnp.bfloat16)
      >>> mosaic_flash.unsupported(base.make_args(x, x, x, bias=bias), "cuda", compute_capability=9.0)
      []
      >>> mosaic_flash.unsupported(
      ...     base.make_args(x, x, x, bias=bias.astype(jnp.float32)), "cuda", compute_capability=9.0
      ... )  # doctest: +ELLIPSIS
      ["the Mosaic GPU kernel streams an additive `bias` in the inputs' dtype (bfloat16); this one is float32 ..."]
    """
    reasons = []
    why = available()
    if why:
        reasons.append(why)
    if args.head_dim in _HEAD_DIMS and args.head_dim not in _BWD_HEAD_DIMS:
        from pallas_kernels import triton_backend  # noqa: PLC0415 - loads Pallas: only when asked

        reasons += [
            f"{r} (at head dim {args.head_dim} the backward pass is the Triton flash kernel's)"
            for r in triton_backend.missing()
        ]
    if platform not in GPU_PLATFORMS:
        reasons.append(f"the Mosaic GPU flash kernel needs a CUDA GPU; platform={platform}")
    cc = compute_capability
    if cc is None and platform in GPU_PLATFORMS:
        local = gpu.compute_capability()
        cc = None if local is None else local / 10
    if platform in GPU_PLATFORMS and cc is None:
        reasons.append(
            "the Mosaic GPU flash kernel needs sm90 (Hopper: WGMMA) and the target GPU is unknown here "
            "(lower on the GPU, or under pallas_kernels.gpu.cuda_target(...))"
        )
    elif cc is not None and int(cc) != 9:
        reasons.append(f"the Mosaic GPU flash kernel needs sm90 (Hopper: WGMMA); compute capability {cc}")
    cuda = _cuda_runtime_version()
    if (args.causal or args.window is not None) and cuda is not None and 12080 <= cuda < 12091:
        reasons.append(
            f"causal masking in Mosaic GPU kernels is miscompiled by ptxas of CUDA 12.8 to 12.9.0 (the "
            f"runtime reports no patch level, so all of 12.8 and 12.9 is refused, as jax's "
            f"attention_mgpu does; a window is the same kind of mask); this runtime is {cuda}"
        )
    if jnp.dtype(args.dtype) not in _DTYPES:
        reasons.append(
            f"the Mosaic GPU flash kernel takes float16 / bfloat16 (got {jnp.dtype(args.dtype).name})"
        )
    if args.head_dim not in _HEAD_DIMS or args.v_head_dim != args.head_dim:
        reasons.append(
            f"the Mosaic GPU flash kernel needs equal q/k and v head dims of 64, 128 or 256 "
            f"(got {args.head_dim} and {args.v_head_dim})"
        )
    if 0 in (args.batch, args.num_heads, args.q_len, args.kv_len):
        reasons.append("an empty dimension: the XLA path handles it")
    tiles = max(-(-args.q_len // 128), -(-args.kv_len // 128))
    if args.batch > 65535 or tiles > 65535:
        reasons.append(f"batch={args.batch} / 128-row tiles={tiles} exceed the CUDA grid limit 65535")
    if args.bias is not None and jnp.dtype(args.bias.dtype) != jnp.dtype(args.dtype):
        reasons.append(
            f"the Mosaic GPU kernel streams an additive `bias` in the inputs' dtype "
            f"({jnp.dtype(args.dtype).name}); this one is {jnp.dtype(args.bias.dtype).name} (rounding it "
            f"would change the logits; the memory-efficient kernel takes it as it is)"
        )
    if not reasons:
        fwd_cfg = Config.heuristics(args.head_dim, bias=args.bias is not None)
        configs = [fwd_cfg] + ([BwdConfig()] if args.head_dim in _BWD_HEAD_DIMS else [])
        for cfg in configs:
            try:
                _check_smem(cfg, args)
            except ValueError as e:
                reasons.append(
                    f"{e} (the Triton kernels have room: flash without a bias, memory-efficient with one)"
                )
    if not args.scale > 0:
        reasons.append(f"the Mosaic GPU kernel needs a positive softmax scale (got {args.scale})")
    return reasons


def _shape(args: base.AttentionArgs, cfg: Config) -> _Shape:
    rows = 2 * cfg.block_q
    return _Shape(
        B=args.batch,
        Tp=-(-args.q_len // rows) * rows,
        Sp=-(-args.kv_len // cfg.block_kv) * cfg.block_kv,
        S=args.kv_len,
        N=args.num_heads,
        K=args.num_kv_heads,
        D=args.head_dim,
        dtype=jnp.dtype(args.dtype).name,
        scale=float(args.scale),
        causal=bool(args.causal),
        diag_offset=int(args.diag_offset),
        softcap=None if args.logits_soft_cap is None else float(args.logits_soft_cap),
        segments=args.q_segment_ids is not None,
        dropout_threshold=base.dropout_threshold(args.dropout_rate) if args.has_dropout else None,
        keep_scale=1.0 / (1.0 - args.dropout_rate) if args.has_dropout else 1.0,
        q_lengths=args.q_seq_lengths is not None,
        kv_lengths=args.kv_seq_lengths is not None,
        window=None if args.window is None else tuple(int(w) for w in args.window),
        mask=None if args.mask is None else (args.mask.shape[0] > 1, args.mask.shape[1] > 1),
        bias=None if args.bias is None else (args.bias.shape[0] > 1, args.bias.shape[1] > 1),
    )


def _ranged(s: _Shape, cfg) -> _Shape:
    """``s`` with ``block_ranges`` where ``cfg`` (a :class:`Config` or :class:`BwdConfig`) asks for it
    and the call has block flags to carry the ranges (segment ids or a boolean mask)."""
    if cfg.block_ranges and s.every_block_masked:
        return dataclasses.replace(s, block_ranges=True)
    return s


def _smem_need(cfg, args: base.AttentionArgs) -> int:
    """Bytes of shared memory ``cfg`` (a :class:`Config` or :class:`BwdConfig`) needs for ``args``."""
    return cfg.smem_bytes(
        args.head_dim,
        segments=args.q_segment_ids is not None,
        dropout=args.has_dropout,
        mask=args.mask is not None,
        bias=args.bias is not None,
    )


def _fits(cfg, args: base.AttentionArgs) -> bool:
    return _smem_need(cfg, args) <= _SMEM_BYTES


def _check_smem(cfg, args: base.AttentionArgs):
    """Raises ``ValueError`` when ``cfg`` (a :class:`Config` or :class:`BwdConfig`) needs more shared
    memory for ``args`` than an sm90 block has."""
    need = _smem_need(cfg, args)
    if need > _SMEM_BYTES:
        raise ValueError(
            f"{cfg} needs {need} bytes of shared memory at head dim {args.head_dim}; sm90 has {_SMEM_BYTES}"
        )


def _extras(args: base.AttentionArgs) -> tuple:
    """The operands the kernels take beside q, k, v: ``(q_segment_ids, kv_segment_ids)`` (int32) with
    segment ids, the dropout words (:func:`base.dropout_words`, uint32[4]) with dropout, then ``q_seq_lengths`` and
    ``kv_seq_lengths`` (int32 ``[B]``, each where given: the kernels read the batch's as scalars)."""
    extras = ()
    if args.q_segment_ids is not None:
        extras += (args.q_segment_ids.astype(jnp.int32), args.kv_segment_ids.astype(jnp.int32))
    if args.has_dropout:
        extras += (base.dropout_words_of(args),)
    for lengths in (args.q_seq_lengths, args.kv_seq_lengths):
        if lengths is not None:
            extras += (lengths.astype(jnp.int32),)
    if args.mask is not None:
        extras += (args.mask,)
    if args.bias is not None:
        extras += (args.bias,)
    return extras


def _kernel_extras(extras: tuple, s: _Shape, heads: int) -> tuple:
    """:func:`_extras` as the kernels read them: the segment ids padded to ``(Tp, Sp)`` (the padded
    rows and keys are masked otherwise); for the seed every query row's dropout hash
    (:func:`base.dropout_row_hash`, ``[B, heads, Tp]`` uint32: loaded like the LSE); the lengths as
    they are; a boolean mask as int8 ``[1 or B, 1 or N, Tp, Sp]`` (0 on the padding), a bias the same
    way in its dtype."""
    out = []
    rest = list(extras)
    if s.segments:
        q_seg, kv_seg = rest.pop(0), rest.pop(0)
        out += [
            jnp.pad(q_seg, ((0, 0), (0, s.Tp - q_seg.shape[1]))),
            jnp.pad(kv_seg, ((0, 0), (0, s.Sp - kv_seg.shape[1]))),
        ]
    if s.dropout_threshold is not None:
        seed = rest.pop(0)
        u32 = jnp.uint32
        b = jnp.arange(s.B, dtype=u32)[:, None, None]
        n = jnp.arange(heads, dtype=u32)[None, :, None]
        i = jnp.arange(s.Tp, dtype=u32)[None, None, :]
        out.append(base.dropout_row_hash_from_words(seed, b, n, i))

    def planes(x, dtype):  # broadcast rows / keys made full (rows to Tp: the padded ones)
        B_, N_, T, _ = x.shape
        x = jnp.broadcast_to(x, (B_, N_, T if T > 1 else s.Tp, s.S)).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, 0), (0, s.Tp - x.shape[2]), (0, s.Sp - s.S)))

    bias = rest.pop() if s.bias is not None else None
    if s.mask is not None:
        rest.append(planes(rest.pop(), jnp.int8))
    if bias is not None:
        rest.append(planes(bias, bias.dtype))
    return (*out, *rest)  # the lengths, the mask, the bias


def _block_flags(extras: tuple, s: _Shape, rows: int, keys: int):
    """int32 ``[1 or B, 1 or N, Tp // rows, Sp // keys]`` from the padded :func:`_kernel_extras`: 0
    where no (query, key) pair of a ``rows x keys`` tile can be visible, by the segment ids (their
    ranges over the tile's queries and keys do not meet: exact for sorted ids, packed sequences) or
    the boolean mask (all False); such tiles are released, not multiplied."""
    nr, nk = s.Tp // rows, s.Sp // keys
    flags = None
    if s.segments:
        q = extras[0].reshape(s.B, nr, rows)
        k = extras[1].reshape(s.B, nk, keys)
        q_lo, q_hi = q.min(-1)[:, :, None], q.max(-1)[:, :, None]
        k_lo, k_hi = k.min(-1)[:, None, :], k.max(-1)[:, None, :]
        flags = ((q_lo <= k_hi) & (k_lo <= q_hi))[:, None]
    if s.mask is not None:
        mask = extras[-2 if s.bias is not None else -1]
        Bm, Nm = mask.shape[:2]
        any_kept = (mask.reshape(Bm, Nm, nr, rows, nk, keys) != 0).any(axis=(3, 5))
        flags = any_kept if flags is None else flags & any_kept
    return flags.astype(jnp.int32)


def _append_ranges(flags, group: int = 1):
    """``flags`` (int32 ``[1 or B, 1 or N, tiles, blocks]``) with two more columns per tile: the first
    block with a visible pair and one past the last (both 0 where there is none). With ``group`` > 1
    (the dK / dV kernel: a kv head's ring serves ``group`` query heads) each head gets its group's
    range, the union of its heads'."""
    vis = flags != 0
    Bf, Nf, nt, nb = vis.shape
    if group > 1 and Nf > 1:
        union = vis.reshape(Bf, Nf // group, group, nt, nb).any(axis=2, keepdims=True)
        vis = jnp.broadcast_to(union, (Bf, Nf // group, group, nt, nb)).reshape(Bf, Nf, nt, nb)
    seen = vis.any(axis=-1)
    lo = jnp.where(seen, jnp.argmax(vis, axis=-1), 0)
    hi = jnp.where(seen, nb - jnp.argmax(vis[..., ::-1], axis=-1), 0)
    return jnp.concatenate([flags, lo[..., None].astype(jnp.int32), hi[..., None].astype(jnp.int32)], -1)


def _with_flags(extras: tuple, s: _Shape, rows: int, keys: int) -> tuple:
    """``extras`` and, with segment ids or a mask, their :func:`_block_flags` (a kernel's last operand;
    with ``s.block_ranges``, and their :func:`_append_ranges`)."""
    if not s.every_block_masked:
        return extras
    flags = _block_flags(extras, s, rows, keys)
    return (*extras, _append_ranges(flags) if s.block_ranges else flags)


def _dkv_extras(extras: tuple, s: _Shape, rows: int) -> tuple:
    """:func:`_kernel_extras` for the dK / dV kernel (query blocks of ``rows``): the mask and the bias
    ``[.., Sp, Tp]`` (their tiles are keys x queries there), the block flags of 64-key tiles x query
    blocks."""
    flags = None
    if s.every_block_masked:
        flags = jnp.swapaxes(_block_flags(extras, s, rows, 64), 2, 3)
        if s.block_ranges:
            flags = _append_ranges(flags, group=s.N // s.K)
    planes = (s.mask is not None) + (s.bias is not None)
    if planes:
        extras = (*extras[:-planes], *(jnp.swapaxes(x, 2, 3) for x in extras[-planes:]))
    return extras if flags is None else (*extras, flags)


def _with_extras(args: base.AttentionArgs, q, k, v, extras):
    """``args`` with new q / k / v and :func:`_extras` (the dropout words become the key and the offsets,
    which :func:`base.dropout_words` turns back into the same words: the same keep bits)."""
    args = args.replace(q=q, k=k, v=v)
    extras = list(extras)
    if args.q_segment_ids is not None:
        args = args.replace(q_segment_ids=extras.pop(0), kv_segment_ids=extras.pop(0))
    if args.has_dropout:  # the seed words as the key (taken as is), and the offsets
        words = extras.pop(0)
        args = args.replace(dropout_rng=words[:2], dropout_offsets=words[2:])
    if args.q_seq_lengths is not None:
        args = args.replace(q_seq_lengths=extras.pop(0))
    if args.kv_seq_lengths is not None:
        args = args.replace(kv_seq_lengths=extras.pop(0))
    if args.mask is not None:
        args = args.replace(mask=extras.pop(0))
    if args.bias is not None:
        args = args.replace(bias=extras.pop(0))
    return args


def forward(args: base.AttentionArgs, *, config: Optional[Config] = None, interpret: bool = False):
    """Runs the forward kernel on ``args`` (see :func:`unsupported`).

    Returns ``(out [B, T, N, H] in q.dtype, lse [B, N, T] float32)``, ``lse`` in natural log.
    """
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"`config` must be a mosaic_flash.Config or None; got {type(config).__name__}")
    cfg = config or Config.heuristics(args.head_dim, bias=args.bias is not None)
    _check_smem(cfg, args)
    if cfg.overlap and not overlap_available():
        raise ValueError(
            "Config.overlap needs jax.experimental.pallas.mosaic_gpu.wgmma_accumulator_load, which this "
            f"JAX ({jax.__version__}) lacks; use Config(overlap=False) or a newer JAX"
        )
    s = _ranged(_shape(args, cfg), cfg)
    T, S = args.q_len, args.kv_len

    def run(q, k, v, *extras):
        if s.Tp != T:
            q = jnp.pad(q, ((0, 0), (0, s.Tp - T), (0, 0), (0, 0)))
        if s.Sp != S:
            pad = ((0, 0), (0, s.Sp - S), (0, 0), (0, 0))
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        extras = _with_flags(_kernel_extras(extras, s, q.shape[2]), s, 64, cfg.block_kv)
        out, lse = _forward_call(q, k, v, extras, s, cfg, interpret)
        if s.Tp != T:
            out, lse = out[:, :T], lse[:, :, :T]
        return out, lse

    operands = (args.q, args.k, args.v, *_extras(args))
    if interpret:
        return run(*operands)
    # In a multi-platform lowering (jax.export for cpu and cuda) every branch of the dispatch's
    # platform_dependent is lowered for every platform, and a Mosaic GPU kernel has no CPU lowering:
    # on other platforms this lowers the reference instead (never selected there).
    return gpu.gpu_call(
        run, lambda q, k, v, *extras: base.reference(_with_extras(args, q, k, v, extras)), operands
    )


def attention(
    args: base.AttentionArgs,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
    bwd_config=None,
    **opts,
):
    """Flash attention with the Mosaic GPU kernels; differentiable w.r.t. q, k, v and the bias.

    Args:
      args: canonical arguments (:func:`base.make_args`); see :func:`unsupported`.
      config: forward :class:`Config` (default :meth:`Config.heuristics`).
      interpret: run in Pallas's GPU interpret mode (CPU testing, jax >= 0.11.2; see the module doc).
      allow_tf32: passed to the Triton backward of head dim 256 (half precision inputs: no effect).
      bwd_config: the backward's :class:`BwdConfig` (head dims 64 and 128), else the Triton
        backward's :class:`triton_flash_vjp.Config`.
      **opts: ignored dispatch options.

    Returns:
      ``(out [B, T, N, H], lse [B, N, T] float32)``; ``lse`` is differentiable too.
    """
    del opts
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"`config` must be a mosaic_flash.Config or None; got {type(config).__name__}")
    if args.head_dim in _BWD_HEAD_DIMS and bwd_config is not None and not isinstance(bwd_config, BwdConfig):
        raise TypeError(
            f"`bwd_config` must be a mosaic_flash.BwdConfig or None; got {type(bwd_config).__name__}"
        )
    reasons = unsupported(args, "cuda", compute_capability=9.0 if interpret else None)
    if interpret and not interpret_available():
        reasons.append("this JAX has no Mosaic GPU interpret mode (jax >= 0.11.2)")
    if reasons:
        raise ValueError("the Mosaic GPU flash kernel cannot run this call: " + "; ".join(reasons))
    fwd = functools.partial(forward, config=config, interpret=interpret)
    if args.head_dim in _BWD_HEAD_DIMS:
        bwd = functools.partial(backward, config=bwd_config, interpret=interpret)
    else:  # head dim 256: the Triton flash backward
        bwd = functools.partial(
            triton_flash_vjp.backward, config=bwd_config, interpret=interpret, allow_tf32=allow_tf32
        )
    if interpret:
        return _interpreted_vjp(args, fwd, bwd)
    return sharded.attention_vjp(args, fwd, bwd, name="Pallas Mosaic GPU flash", skips_dbias=True)


def _interpreted_vjp(args: base.AttentionArgs, fwd, bwd):
    """The interpreted kernels in a plain ``custom_vjp``.

    The compiled path splits the call over sharded batch / kv-head axes (:mod:`sharded`, through
    ``custom_partitioning``), which cannot lower the GPU interpreter's ordered host callbacks."""

    @jax.custom_vjp
    def run(q, k, v, bias):
        return fwd(args.replace(q=q, k=k, v=v, bias=bias))

    def run_fwd(q, k, v, bias):
        out, lse = run(q, k, v, bias)
        return (out, lse), (q, k, v, bias, out, lse)

    def run_bwd(res, g):
        q, k, v, bias, out, lse = res
        d_out, d_lse = g
        return bwd(args.replace(q=q, k=k, v=v, bias=bias), out, lse, d_out, d_lse)

    run.defvjp(run_fwd, run_bwd)
    return run(args.q, args.k, args.v, args.bias)
