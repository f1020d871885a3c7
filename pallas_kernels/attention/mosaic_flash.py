"""Flash attention forward for Hopper (sm90) in Pallas Mosaic GPU: warp-specialized, TMA-fed, WGMMA.

FlashAttention-3 (Shah et al., 2024, https://arxiv.org/abs/2407.08608) in Pallas's Mosaic GPU backend
(``jax.experimental.pallas.mosaic_gpu``). Each program (CTA) owns ``2 x block_q`` query rows of one
head and runs three warpgroups:

* a **memory warpgroup** streams key / value blocks into a ring of ``stages`` shared-memory slots with
  TMA, each slot guarded by a "loaded" barrier (the TMA arrives) and a "consumed" barrier (both compute
  warpgroups arrive once they are done with it);
* two **compute warpgroups**, ``block_q`` rows each, multiply ``Q K^T`` on the tensor cores (WGMMA,
  both operands in shared memory), run the online softmax in registers (base 2, the softmax scale
  folded into ``log2(e)``), and multiply ``P V`` with ``P`` taken from registers. A shared
  "schedule" barrier makes the two alternate (section 3.1 of the paper, ping-pong scheduling), so one
  warpgroup's softmax runs while the other's matrix multiplies occupy the tensor cores.

A causal mask (any ``diag_offset``) is applied only to the key blocks that straddle the diagonal; the
blocks above it are never loaded or multiplied, and the warpgroup that finishes first releases the ring
slots it skips. Query / key lengths that are not block multiples are zero-padded by the wrapper and
the padded keys masked in the last block.

What it runs (:func:`unsupported` says why not, and dispatch moves on): float16 / bfloat16, equal q/k
and v head dims of 64, 128 or 256, GQA / MQA, causal or not, on a compute capability 9.x GPU. Bias,
masks, windows, lengths, segment ids, soft cap and dropout go to the Triton kernels.

The backward pass is the Pallas Triton flash backward (:mod:`triton_flash_vjp`) on this kernel's
``out`` and ``lse``.

Verification: CI has no GPU. The kernel is exported for CUDA from CPU with ``jax.export`` (Pallas
lowers it to the Mosaic GPU dialect there, so shapes, layouts, transforms and barrier types are
checked); on jax >= 0.12 it also runs in Pallas's GPU interpret mode against the float32 reference. That
interpreter cannot take a WGMMA operand from registers, nor an accumulator carried through
``pl.run_state``: ``interpret=True`` stages ``P`` through shared memory and adds each ``P V`` product
to the running output outside the accumulator, and is otherwise the same program. The compiled kernel
is checked in the GPU lane (``pytest -m gpu``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu
from pallas_kernels.attention import base, reference, triton_common, triton_flash_vjp

__all__ = ["Config", "attention", "forward", "unsupported", "available"]

GPU_PLATFORMS = gpu.GPU_PLATFORMS
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_HEAD_DIMS = (64, 128, 256)
_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Shared memory per block on sm90 (227 KiB), less room for barriers.
_SMEM_BYTES = 227 * 1024 - 1024


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


def interpret_available() -> bool:
    """Whether this JAX runs Mosaic GPU kernels in its GPU interpret mode (jax >= 0.12)."""
    return available() is None and hasattr(_plgpu(), "InterpretGPUParams")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of the forward kernel.

    Attributes:
      block_q: query rows per compute warpgroup (a program holds two: ``2 * block_q`` rows); 64.
      block_kv: keys per pipeline step, a multiple of 64.
      stages: key / value blocks in flight (shared-memory ring slots), at least 2.
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv", "stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Config.{name} must be an int; got {type(value).__name__}")
        if self.block_q != 64:
            raise ValueError(f"Config.block_q must be 64 (one WGMMA row tile); got {self.block_q}")
        if self.block_kv <= 0 or self.block_kv % 64:
            raise ValueError(f"Config.block_kv must be a positive multiple of 64; got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"Config.stages must be at least 2; got {self.stages}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the forward kernel allocates for ``head_dim`` (queries / outputs of both
        compute warpgroups, the key and value ring, the softmax statistics)."""
        qo = 2 * self.block_q * head_dim
        kv = 2 * self.stages * self.block_kv * head_dim
        return (qo + kv) * itemsize + 2 * self.block_q * 4

    @staticmethod
    def heuristics(head_dim: int) -> "Config":
        """The default for a head dim: 128-key steps up to head dim 128, 64 at 256 (shared memory)."""
        return Config(block_kv=128 if head_dim <= 128 else 64)


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


def _causal_steps(q_start, block_q: int, s: _Shape, block_kv: int):
    """``(full, total)`` key blocks for query rows ``[q_start, q_start + block_q)`` under the causal
    mask ``key <= query + diag_offset``: blocks ``[0, full)`` need no mask, ``[full, total)`` straddle
    the diagonal or hold padded keys (traced int32)."""
    hi = jnp.minimum(q_start + block_q + s.diag_offset, s.S)  # keys the last row may see
    total = lax.div(hi + (block_kv - 1), jnp.int32(block_kv))
    # Every key < q_start + diag_offset + 1 is seen by every row; a block is mask-free when it is
    # below that and holds no padding.
    free = jnp.minimum(q_start + s.diag_offset + 1, (s.S // block_kv) * block_kv)
    full = jnp.clip(lax.div(jnp.maximum(free, 0), jnp.int32(block_kv)), 0, total)
    return full, total


def _forward_call(q, k, v, s: _Shape, cfg: Config, interpret: bool):
    """The ``plgpu.kernel`` on padded ``q [B, Tp, N, D]``, ``k`` / ``v [B, Sp, K, D]`` ->
    ``(out [B, Tp, N, D], lse [B, N, Tp] float32, natural log)``."""
    plgpu = _plgpu()
    dtype = jnp.dtype(s.dtype)
    bq, bk, D = cfg.block_q, cfg.block_kv, s.D
    stages = max(1, min(cfg.stages, s.Sp // bk))
    G = s.N // s.K
    c = s.scale * _LOG2E  # logits -> base-2 exponent

    def steps_of(q_start):
        if s.causal:
            return _causal_steps(q_start, bq, s, bk)
        # Without a causal mask only the padded keys of a ragged last block are masked (static).
        return s.S // bk, -(-s.S // bk)

    def kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped):
        bi = lax.axis_index("batch")
        head = lax.axis_index("heads")
        tile = lax.axis_index("q_tiles")
        wg = lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem, lse_smem2, p_smem2), loaded, consumed, schedule = scoped
        k_loaded, v_loaded, q_loaded = loaded
        k_consumed, v_consumed = consumed

        def schedule_turn():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        # The second warpgroup's rows need the most key blocks; the ring runs that many.
        _, ring_steps = steps_of(tile * (2 * bq) + bq)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem = qo_smem2.at[wg]
            lse_smem = lse_smem2.at[wg]
            q_start = tile * (2 * bq) + wg * bq
            full, total = steps_of(q_start)

            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_start, bq), head], qo_smem, q_loaded.at[wg])
            plgpu.barrier_wait(q_loaded.at[wg])

            m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(total > 0)
            def _():
                plgpu.barrier_wait(k_loaded.at[0])

            pl.when(wg == 1)(schedule_turn)

            def step(j, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(j, jnp.int32(stages))

                def qk_product(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_turn()
                    return acc_ref[...]

                qk = pl.run_scoped(qk_product, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_consumed.at[slot])

                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
                    keys = cols + j * bk
                    keep = keys < s.S
                    if s.causal:
                        keep = keep & (keys <= rows + (q_start + s.diag_offset))
                    qk = jnp.where(keep, qk, -jnp.inf)

                m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p_lo = p.astype(dtype)
                acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))

                plgpu.barrier_arrive(schedule)  # softmax done: the other warpgroup may multiply
                plgpu.barrier_wait(v_loaded.at[slot])
                plgpu.barrier_wait(schedule)  # the tensor cores are ours again

                def wait_next_keys():
                    nxt = j + 1

                    @pl.when(nxt < total)
                    def _():
                        plgpu.barrier_wait(k_loaded.at[lax.rem(nxt, jnp.int32(stages))])

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

            carry = (acc, m_i, l_i)
            # Static bounds (no causal mask) build only the loops that run: Mosaic GPU fails to
            # lower an empty static loop.
            if not isinstance(full, int) or full > 0:
                carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
            if not isinstance(full, int) or total > full:
                carry = lax.fori_loop(full, total, functools.partial(step, masked=True), carry)
            acc, m_i, l_i = carry

            def release(j, _):
                # Ring slots this warpgroup's rows never needed (causal): release them, and keep
                # the schedule barrier's turns in step with the other warpgroup.
                slot = lax.rem(j, jnp.int32(stages))
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                schedule_turn()
                schedule_turn()

            if s.causal:
                lax.fori_loop(total, ring_steps, release, None)
            pl.when(wg == 0)(schedule_turn)

            # Every row has seen a key (unsupported() refuses structures that empty one): l_i > 0.
            qo_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
            lse_smem[...] = (m_i + jnp.log2(l_i)) * _LN2
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[bi, pl.ds(q_start, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, head, pl.ds(q_start, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(G))

            def load(j, slot):
                rows = (bi, pl.ds(j * bk, bk), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

            for i in range(stages):
                pl.when(i < ring_steps)(functools.partial(load, jnp.int32(i), i))

            @pl.loop(0, jnp.maximum(ring_steps - stages, 0))
            def _(j):
                slot = lax.rem(j, jnp.int32(stages))
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])
                load(j + stages, slot)

    def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
        tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = [
            plgpu.SMEM((2, bq, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((stages, bk, D), dtype, transforms=tiled),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq, bk), dtype, transforms=tiled) if interpret else None,
        ]
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped),
            scratch,
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2),
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    extra = {}
    if interpret:
        extra["interpret"] = plgpu.InterpretGPUParams(detect_races=True)
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
    )(q, k, v)


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
      compute_capability: the target GPU's (e.g. ``9.0``); default: the local GPU's, when there is
        one. WGMMA exists on sm90 only.

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.attention import base, mosaic_flash
      >>> x = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
      >>> mosaic_flash.unsupported(base.make_args(x, x, x, is_causal=True), "cuda", compute_capability=9.0)
      []
      >>> mosaic_flash.unsupported(base.make_args(x, x, x, logits_soft_cap=30.0), "cuda", compute_capability=9.0)
      ['a logits soft cap is not in the Mosaic GPU kernel (the Triton flash kernel has one)']
    """
    reasons = []
    why = available()
    if why:
        reasons.append(why)
    from pallas_kernels import triton_backend  # noqa: PLC0415 - loads Pallas: only when asked

    reasons += [f"{r} (the backward pass is the Triton flash kernel's)" for r in triton_backend.missing()]
    if platform not in GPU_PLATFORMS:
        reasons.append(f"the Mosaic GPU flash kernel needs a CUDA GPU; platform={platform}")
    cc = compute_capability
    if cc is None and platform in GPU_PLATFORMS:
        local = gpu.compute_capability()
        cc = None if local is None else local / 10
    if cc is not None and int(cc) != 9:
        reasons.append(f"the Mosaic GPU flash kernel needs sm90 (Hopper: WGMMA); compute capability {cc}")
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
    tiles = -(-args.q_len // 128)
    if args.batch > 65535 or tiles > 65535:
        reasons.append(f"batch={args.batch} / query tiles={tiles} exceed the CUDA grid limit 65535")
    if args.bias is not None:
        reasons.append(
            "an additive `bias` is not in the Mosaic GPU kernel (use the memory-efficient backend)"
        )
    if args.mask is not None:
        reasons.append("an arbitrary boolean `mask` is not in the Mosaic GPU kernel")
    if args.window is not None:
        reasons.append("a local window is not in the Mosaic GPU kernel (the Triton flash kernel has one)")
    if args.q_seq_lengths is not None or args.kv_seq_lengths is not None:
        reasons.append("sequence lengths are not in the Mosaic GPU kernel (the Triton flash kernel has them)")
    if args.q_segment_ids is not None:
        reasons.append("segment ids are not in the Mosaic GPU kernel (the Triton flash kernel has them)")
    if args.logits_soft_cap is not None:
        reasons.append("a logits soft cap is not in the Mosaic GPU kernel (the Triton flash kernel has one)")
    if args.has_dropout:
        reasons.append("dropout is not in the Mosaic GPU kernel (the Triton flash kernel has it)")
    if not args.scale > 0:
        reasons.append(f"the Mosaic GPU kernel needs a positive softmax scale (got {args.scale})")
    if args.kv_len and reference.structure_empties_rows(args):
        reasons.append(
            "the causal diagonal leaves some query row without a key (the Mosaic GPU kernel assumes "
            "every row sees one)"
        )
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
    )


def forward(args: base.AttentionArgs, *, config: Optional[Config] = None, interpret: bool = False):
    """Runs the forward kernel on ``args`` (see :func:`unsupported`).

    Returns ``(out [B, T, N, H] in q.dtype, lse [B, N, T] float32)``, ``lse`` in natural log.
    """
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"`config` must be a mosaic_flash.Config or None; got {type(config).__name__}")
    cfg = config or Config.heuristics(args.head_dim)
    if cfg.smem_bytes(args.head_dim) > _SMEM_BYTES:
        raise ValueError(
            f"{cfg} needs {cfg.smem_bytes(args.head_dim)} bytes of shared memory at head dim "
            f"{args.head_dim}; sm90 has {_SMEM_BYTES}"
        )
    s = _shape(args, cfg)
    T, S = args.q_len, args.kv_len

    def run(q, k, v):
        if s.Tp != T:
            q = jnp.pad(q, ((0, 0), (0, s.Tp - T), (0, 0), (0, 0)))
        if s.Sp != S:
            pad = ((0, 0), (0, s.Sp - S), (0, 0), (0, 0))
            k, v = jnp.pad(k, pad), jnp.pad(v, pad)
        out, lse = _forward_call(q, k, v, s, cfg, interpret)
        if s.Tp != T:
            out, lse = out[:, :T], lse[:, :, :T]
        return out, lse

    if interpret:
        return run(args.q, args.k, args.v)
    # In a multi-platform lowering (jax.export for cpu and cuda) every branch of the dispatch's
    # platform_dependent is lowered for every platform, and a Mosaic GPU kernel has no CPU lowering:
    # on other platforms this lowers the reference instead (never selected there).
    return triton_common.gpu_call(
        run, lambda q, k, v: base.reference(args.replace(q=q, k=k, v=v)), (args.q, args.k, args.v)
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
    """Flash attention with the Mosaic GPU forward kernel; differentiable w.r.t. q, k, v.

    Args:
      args: canonical arguments (:func:`base.make_args`); see :func:`unsupported`.
      config: forward :class:`Config` (default :meth:`Config.heuristics`).
      interpret: run in Pallas's GPU interpret mode (CPU testing, jax >= 0.12; see the module doc).
      allow_tf32: passed to the Triton backward (its inputs are half precision here: no effect).
      bwd_config: the backward's :class:`triton_flash_vjp.Config`.
      **opts: ignored dispatch options.

    Returns:
      ``(out [B, T, N, H], lse [B, N, T] float32)``; ``lse`` is differentiable too.
    """
    del opts
    reasons = unsupported(args, "cuda", compute_capability=9.0 if interpret else None)
    if interpret and not interpret_available():
        reasons.append("this JAX has no Mosaic GPU interpret mode (jax >= 0.12)")
    if reasons:
        raise ValueError("the Mosaic GPU flash kernel cannot run this call: " + "; ".join(reasons))
    fwd = functools.partial(forward, config=config, interpret=interpret)
    if interpret:
        return _interpreted_vjp(args, fwd, bwd_config)
    return triton_flash_vjp.differentiable(
        args, fwd=fwd, bwd_config=bwd_config, interpret=False, allow_tf32=allow_tf32
    )


def _interpreted_vjp(args: base.AttentionArgs, fwd, bwd_config):
    """The interpreted forward with the interpreted Triton backward, in a plain ``custom_vjp``.

    The compiled path splits the call over sharded batch / kv-head axes (:mod:`sharded`, through
    ``custom_partitioning``), which cannot lower the GPU interpreter's ordered host callbacks."""

    @jax.custom_vjp
    def run(q, k, v):
        return fwd(args.replace(q=q, k=k, v=v))

    def run_fwd(q, k, v):
        out, lse = run(q, k, v)
        return (out, lse), (q, k, v, out, lse)

    def run_bwd(res, g):
        q, k, v, out, lse = res
        d_out, d_lse = g
        dq, dk, dv, _ = triton_flash_vjp.backward(
            args.replace(q=q, k=k, v=v), out, lse, d_out, d_lse, config=bwd_config, interpret=True
        )
        return dq, dk, dv

    run.defvjp(run_fwd, run_bwd)
    return run(args.q, args.k, args.v)
