"""Pallas (Triton) GPU kernels for the int4 matmul.

Two kernels over the packed ``[N, K/2]`` nibbles (`base.PackedInt4Weight`):

* **W4A16** (`weight_only_matmul`): nibbles are unpacked and scaled in
  registers (``(u - 8) * scale`` in the compute dtype, bf16/f16, or f32 with
  IEEE dots), one MMA per nibble plane (low nibbles x even-k activations,
  high nibbles x odd-k activations, so nothing is shuffled), fp32
  accumulation. A nibble becomes a float without a conversion instruction
  (`_float_planes`, `_half_planes`: or-ed into the mantissa of a power of two,
  which is then subtracted). For decode (``M <= 16``) K is split across
  programs (split-K) and the fp32 partials are summed by XLA.
* **W4A8** (`dyn_quant_matmul`, the dynamic-quant semantics of base.py): the
  activations are quantized to int8 by XLA (`base.quantize_activations`),
  the kernel runs int8 x int8 -> int32 MMAs per group and restores the zero
  point exactly, ``sum (qa - zp) q = qa . q - zp * sum q`` (with
  ``Config.byte_planes``, the weights as ``16 q`` bytes and ``sum q`` from an
  MMA with ones: `_sixteen_planes`). Every int8 dot
  contracts over >= `MIN_INT8_DOT_K` = 32 k: Triton's NVIDIA backend has no
  narrower int8 MMA (``mma.m16n8k32``, ``wgmma ... k32``), and a 16-k int8
  operand (a 32-k group's nibble plane) is fed to the k32 instruction with its
  registers repeated, so every product is counted twice. A group
  whose nibble plane is not a multiple of 32 bytes (groupsize an odd multiple
  of 32) is covered by 32-byte windows that overlap the neighbouring k, with
  the k outside the group masked to 0 (`_windows`). Decode: the grid
  is split over groups and each program writes the int32 group sums
  (``[G, M, N]``); XLA then applies torch's ordered float tail, so split-K
  stays bit-exact. Prefill: one program per ``[block_m, block_n]`` tile walks
  every group in order and accumulates ``float(I) * scale`` in fp32 with no
  FMA contraction (`base.rounded_mul`), again bit-exact.

Both kernels take ``interpret: bool``: ``interpret=True`` runs them on CPU
through the Pallas interpreter (tests); on a GPU leave it False. Their tiles
(`Config`, its ``heuristics`` and ``search_space``) live in `triton_config`;
``Config.swap_ab`` runs either kernel transposed (the weights as the MMA's A
operand). ``benchmarks/kernel_resources.py`` shows what a config compiles to
for sm90 (registers, spills, MMA instructions) on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu, partition, triton_backend

from . import base
from .base import PackedInt4Weight
from .triton_config import DECODE_M, MIN_INT8_DOT_K, Config, heuristics

__all__ = [
    "Config",
    "heuristics",
    "dyn_quant_matmul",
    "weight_only_matmul",
    "unsupported",
    "DECODE_M",
    "MIN_INT8_DOT_K",
]


def unsupported(call: base.Int4Call, platform: str | None) -> list[str]:
    """Reasons these kernels cannot run ``call`` when lowered for ``platform`` (empty when they can;
    ``platform=None``: the kernel's own limits only, e.g. for interpret mode)."""
    why = []
    if platform is not None and platform not in gpu.TRITON_PLATFORMS:
        why.append(f"Pallas Triton kernels need a GPU; platform={platform!r}")
    if call.packed.groupsize % 32:
        why.append(
            f"groupsize={call.packed.groupsize} is not a multiple of 32 (channel-wise K not a multiple of 32)"
        )
    if jnp.dtype(call.x_dtype) not in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        why.append(f"dtype {jnp.dtype(call.x_dtype)} is not supported")
    return why


# -------------------------------------------------------------- kernel bodies


def _load(ref, mask, other):
    return plgpu.load(ref, mask=mask, other=other)


def _planes(w):
    """uint8 tile -> (low, high) nibble planes as int32 in -8..7."""
    w = w.astype(jnp.int32)
    return (w & 0x0F) - 8, (w >> 4) - 8


_TWO_23 = 0x4B000000  # the bits of the float32 2**23, whose ulp is 1


def _float_planes(w):
    """uint8 tile -> (low, high) nibble planes as float32 ``u - 8``, exact, with no int-to-float
    conversion: a nibble ``u`` or-ed into the mantissa of 2**23 is the float ``2**23 + u``, and
    subtracting ``2**23 + 8`` leaves ``u - 8`` exactly. Conversions run at an eighth of float32 adds'
    rate on sm90 (16 against 128 per clock and SM), and decode dequantizes every weight of the matrix
    per call."""
    w = w.astype(jnp.int32)
    lo = lax.bitcast_convert_type((w & 0x0F) | _TWO_23, jnp.float32)
    hi = lax.bitcast_convert_type((w >> 4) | _TWO_23, jnp.float32)
    return lo - float(2**23 + 8), hi - float(2**23 + 8)


def _sixteen_planes(w):
    """uint8 tile -> (low, high) nibble planes as int8 ``16 (u - 8)``, exact: a nibble moved to the
    byte's top (``w << 4`` for the low one, ``w & 0xF0`` for the high one) with its top bit flipped is
    the two's-complement byte ``16 (u - 8)``. The bytes are never widened to int32 (which `_planes`
    does, then subtracts and narrows each), so the compiler can work on four bytes per register."""
    lo = lax.bitcast_convert_type((w << 4) ^ jnp.uint8(0x80), jnp.int8)
    hi = lax.bitcast_convert_type((w & jnp.uint8(0xF0)) ^ jnp.uint8(0x80), jnp.int8)
    return lo, hi


def _windows(groupsize: int, block_k: int) -> tuple[int, bool]:
    """(steps per group, masked) of the W4A8 kernel's walk over one group's bytes.

    A step reads a window of ``block_k / 2`` bytes (each nibble plane an int8
    dot over that many k). When the window does not divide the group's
    ``groupsize / 2`` bytes, the last window of a group is moved back so that
    it ends at the group's end (or starts at 0) and the bytes it shares with
    the previous window, or with the neighbouring group, are masked out.
    """
    bkh, gh = block_k // 2, groupsize // 2
    return -(-gh // bkh), gh % bkh != 0


def _w4a8_kernel(
    ae_ref,
    ao_ref,
    zp_ref,
    w_ref,
    st_ref,
    out_ref,
    *,
    M,
    N,
    groupsize,
    block_m,
    block_n,
    block_k,
    groups_per_prog,
    fused,
    swap_ab,
    byte_planes,
):
    pid_n, pid_m, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rmask = pid_m * block_m + jnp.arange(block_m) < M
    cmask = pid_n * block_n + jnp.arange(block_n) < N
    bkh, gh = block_k // 2, groupsize // 2
    steps, masked = _windows(groupsize, block_k)
    zp = _load(zp_ref, rmask, 0)
    # swap_ab: every [block_m, block_n] tile below is held transposed, [block_n, block_m], so that the
    # weight planes are the int8 MMAs' A operand (see `Config.swap_ab`).
    tile = (block_n, block_m) if swap_ab else (block_m, block_n)
    per_row = (lambda v: v[None, :]) if swap_ab else (lambda v: v[:, None])  # a [block_m] vector
    per_col = (lambda v: v[:, None]) if swap_ab else (lambda v: v[None, :])  # a [block_n] vector
    omask = rmask[:, None] & cmask[None, :]

    # `Config.byte_planes`: the weights enter the MMAs as 16 (u - 8) (`_sixteen_planes`; a group's sums
    # stay within int32 for groupsize < 2**17: |16 (u - 8) qa| <= 2**14 per product); the dots are then
    # 16 times the sums, and the weights' sums per column (for the zero point) come from an int8 MMA of
    # the planes with a tile of ones.
    ones_rows = 16  # the narrowest MMA side

    def idots(a, plane):  # a [block_m, bkh] int8 . plane [block_n, bkh]^T, in the tile's orientation
        w = plane.astype(jnp.int8)
        lhs, rhs = (w, a) if swap_ab else (a, w)
        return jnp.dot(lhs, rhs.T, preferred_element_type=jnp.int32)

    def plane_sums(ones, plane):  # ones [16, bkh] . plane [block_n, bkh]^T: every row the column sums
        lhs, rhs = (plane, ones) if swap_ab else (ones, plane)
        return jnp.dot(lhs, rhs.T, preferred_element_type=jnp.int32)

    sums_tile = (block_n, ones_rows) if swap_ab else (ones_rows, block_n)

    def window(g, t):
        """The first byte ``k0`` of step ``t`` of group ``g`` and, where windows overlap, which of its
        ``bkh`` bytes are the step's own (None: all)."""
        first = g * gh + t * bkh  # first byte of the group this step adds
        if not masked:
            return first, None
        last = jnp.minimum(first + bkh, (g + 1) * gh)  # one past the last
        k0 = jnp.maximum(last - bkh, 0)  # the window: in bounds, ends by `last`
        col = k0 + jnp.arange(bkh)
        return k0, (col >= first) & (col < last)

    def activations(k0, valid):  # even and odd k of the window; 0 outside the step's own k
        ae = _load(ae_ref.at[:, pl.ds(k0, bkh)], rmask[:, None], 0)
        ao = _load(ao_ref.at[:, pl.ds(k0, bkh)], rmask[:, None], 0)
        if valid is not None:
            ae = jnp.where(valid[None, :], ae, jnp.int8(0))
            ao = jnp.where(valid[None, :], ao, jnp.int8(0))
        return ae, ao

    def weights(k0):
        return _load(w_ref.at[:, pl.ds(k0, bkh)], cmask[:, None], 0x88)

    def group(j, acc):
        g = pid_s * groups_per_prog + j

        def step16(t, carry):
            idot, qs = carry
            k0, valid = window(g, t)
            ae, ao = activations(k0, valid)
            lo, hi = _sixteen_planes(weights(k0))
            ones = jnp.ones((ones_rows, bkh), jnp.int8)
            if valid is not None:  # the weights outside the step's own k add nothing to the sums
                ones = jnp.where(valid[None, :], ones, jnp.int8(0))
            idot += idots(ae, lo) + idots(ao, hi)
            qs += plane_sums(ones, lo) + plane_sums(ones, hi)
            return idot, qs

        def step(t, carry):
            idot, qsum = carry
            k0, valid = window(g, t)
            ae, ao = activations(k0, valid)
            lo, hi = _planes(weights(k0))
            both = lo + hi if valid is None else jnp.where(valid[None, :], lo + hi, 0)
            # int8 dots over bkh >= MIN_INT8_DOT_K k (see the module docstring).
            idot += idots(ae, lo)
            idot += idots(ao, hi)
            return idot, qsum + jnp.sum(both, axis=1)

        if byte_planes:
            idot, qs = lax.fori_loop(
                0, steps, step16, (jnp.zeros(tile, jnp.int32), jnp.zeros(sums_tile, jnp.int32))
            )
            idot = idot >> 4  # exact: 16 times an int32 sum
            qsum = jnp.sum(qs, axis=1 if swap_ab else 0) >> 8  # 16 rows of 16 times the sums
        else:
            idot, qsum = lax.fori_loop(
                0, steps, step, (jnp.zeros(tile, jnp.int32), jnp.zeros((block_n,), jnp.int32))
            )
        isum = idot - per_row(zp) * per_col(qsum)  # exact: sum (qa - zp) * q
        if not fused:
            plgpu.store(out_ref.at[j], isum.T if swap_ab else isum, mask=omask)
            return acc
        s = _load(st_ref.at[g], cmask, 0.0)
        # The guard against FMA contraction is the group sum itself, as in `base.accumulate_groups`
        # (bit for bit with it: where a zero point is INT32_MIN, a sum can be INT32_MIN and the guard
        # fires there too). A guard the compiler can bound is folded away and the multiply-add
        # contracted (seen in the sm90 SASS and on XLA's CPU backend).
        return acc + base.rounded_mul(isum.astype(jnp.float32), per_col(s), isum)

    acc = lax.fori_loop(0, groups_per_prog, group, jnp.zeros(tile, jnp.float32))
    if fused:
        plgpu.store(out_ref, acc.T if swap_ab else acc, mask=omask)


@dataclasses.dataclass(frozen=True)
class _W4A16:
    """The static shape and options of one W4A16 launch (what both program bodies read)."""

    M: int
    N: int
    groupsize: int
    block_m: int
    block_n: int
    block_k: int
    steps_per_prog: int
    compute_dtype: Any
    scale_after_dot: bool
    mma: bool
    swap_ab: bool


def _w4a16_kernel(xe_ref, xo_ref, w_ref, st_ref, out_ref, *, c: _W4A16):
    """The W4A16 program: MMAs per nibble plane, or (``mma=False``) a multiply-and-sum per row."""
    (_w4a16_mma if c.mma else _w4a16_rows)(xe_ref, xo_ref, w_ref, st_ref, out_ref, c)


def _w4a16_tile(c: _W4A16, w_ref, st_ref, cmask, pid_s, t):
    """Step ``t`` of a program: its first byte ``k0``, the group scales ``[block_n]`` (the step's k lie in
    one group: block_k divides groupsize) and the packed bytes ``[block_n, block_k / 2]`` (0x88, two
    zero weights, past N)."""
    kstep = pid_s * c.steps_per_prog + t
    k0 = kstep * (c.block_k // 2)
    s = _load(st_ref.at[(kstep * c.block_k) // c.groupsize], cmask, 0.0)
    return k0, s, _load(w_ref.at[:, pl.ds(k0, c.block_k // 2)], cmask[:, None], 0x88)


_HALF_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 136.0), jnp.dtype(jnp.float16): (0x6400, 1032.0)}


def _half_planes(w, dtype):
    """uint8 tile -> (low, high) nibble planes as the exact integers ``u - 8`` in ``dtype`` (bfloat16 or
    float16) with integer ops and one subtraction in that dtype: ``u`` or-ed into the mantissa of 128
    (bfloat16: 7 mantissa bits, ulp 1 from 128 to 256) or 1024 (float16: 10 bits) is that power of two
    plus ``u``; subtracting it plus 8 is exact."""
    bits, offset = _HALF_MAGIC[jnp.dtype(dtype)]
    w = w.astype(jnp.int32)
    lo = lax.bitcast_convert_type(((w & 0x0F) | bits).astype(jnp.uint16), dtype)
    hi = lax.bitcast_convert_type(((w >> 4) | bits).astype(jnp.uint16), dtype)
    return lo - jnp.asarray(offset, dtype), hi - jnp.asarray(offset, dtype)


def _scaled(plane, s, compute_dtype):
    """``(u - 8) * scale`` rounded to the compute dtype: the weight dequantized in registers."""
    return (plane * s[:, None]).astype(compute_dtype)


def _w4a16_mma(xe_ref, xo_ref, w_ref, st_ref, out_ref, c: _W4A16):
    M, N, block_m, block_n, block_k = c.M, c.N, c.block_m, c.block_n, c.block_k
    steps_per_prog, compute_dtype, scale_after_dot = c.steps_per_prog, c.compute_dtype, c.scale_after_dot
    pid_n, pid_m, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rmask = pid_m * block_m + jnp.arange(block_m) < M
    cmask = pid_n * block_n + jnp.arange(block_n) < N
    bkh = block_k // 2
    prec = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    swap = c.swap_ab

    def mul(x, w):  # x [block_m, k] . w [block_n, k]^T; swapped: w . x^T, [block_n, block_m]
        a, b = (w, x) if swap else (x, w)
        return jnp.dot(a, b.T, preferred_element_type=jnp.float32, precision=prec)

    def step(t, acc):
        k0, s, w = _w4a16_tile(c, w_ref, st_ref, cmask, pid_s, t)
        xe = _load(xe_ref.at[:, pl.ds(k0, bkh)], rmask[:, None], 0).astype(compute_dtype)
        xo = _load(xo_ref.at[:, pl.ds(k0, bkh)], rmask[:, None], 0).astype(compute_dtype)
        if scale_after_dot:  # the exact integers u - 8; the group's scales multiply the step's dot
            half = jnp.dtype(compute_dtype) in _HALF_MAGIC
            lo, hi = _half_planes(w, compute_dtype) if half else _float_planes(w)
            d = mul(xe, lo) + mul(xo, hi)
            return acc + d * (s[:, None] if swap else s[None, :])
        lo, hi = _float_planes(w)
        lo, hi = _scaled(lo, s, compute_dtype), _scaled(hi, s, compute_dtype)
        return acc + mul(xe, lo) + mul(xo, hi)

    shape = (block_n, block_m) if swap else (block_m, block_n)
    acc = lax.fori_loop(0, steps_per_prog, step, jnp.zeros(shape, jnp.float32))
    plgpu.store(out_ref, acc.T if swap else acc, mask=rmask[:, None] & cmask[None, :])


def _w4a16_rows(xe_ref, xo_ref, w_ref, st_ref, out_ref, c: _W4A16):
    """The W4A16 step without MMAs (``Config.mma=False``, decode): each of the ``min(block_m, M)`` rows
    of the program is a multiply and a sum over k in float32 against the dequantized tile, in the layout
    the tile was loaded in (no MMA operand layout, no padding of one row to 16)."""
    M, block_m, bkh = c.M, c.block_m, c.block_k // 2
    steps_per_prog, compute_dtype, scale_after_dot = c.steps_per_prog, c.compute_dtype, c.scale_after_dot
    pid_n, pid_m, pid_s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cmask = pid_n * c.block_n + jnp.arange(c.block_n) < c.N
    rows = min(block_m, M)
    valid = [pid_m * block_m + r < M for r in range(rows)]

    def xrow(ref, r, k0):  # row r of the activations, [1, bkh], rounded to the compute dtype as for MMAs
        x = _load(ref.at[pl.ds(r, 1), pl.ds(k0, bkh)], jnp.full((1, bkh), valid[r]), 0)
        return x.astype(compute_dtype).astype(jnp.float32)

    def step(t, acc):
        k0, s, w = _w4a16_tile(c, w_ref, st_ref, cmask, pid_s, t)
        lo, hi = _float_planes(w)
        if not scale_after_dot:  # the weight as the MMA path rounds it
            lo, hi = _scaled(lo, s, compute_dtype), _scaled(hi, s, compute_dtype)
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
        out = []
        for r in range(rows):
            d = jnp.sum(lo * xrow(xe_ref, r, k0), axis=1) + jnp.sum(hi * xrow(xo_ref, r, k0), axis=1)
            out.append(acc[r] + (d * s if scale_after_dot else d))
        return tuple(out)

    zero = jnp.zeros(cmask.shape, jnp.float32)
    acc = lax.fori_loop(0, steps_per_prog, step, tuple(zero for _ in range(rows)))
    for r in range(rows):
        plgpu.store(out_ref.at[pl.ds(r, 1), :], acc[r][None, :], mask=(cmask & valid[r])[None, :])


# ------------------------------------------------------------------- launches


def _prepare(x2: jax.Array):
    return x2[:, 0::2], x2[:, 1::2]


def _varying(*operands):
    """The operands cast to vary over every `shard_map` axis any of them varies over, and that typing
    (for the kernel's ``out_shape``). Under ``check_vma`` Pallas needs an output's typing, and the
    product of rows split over one axis with a weight split over another varies over both."""
    out = tuple(partition.vary_like(a, *operands) for a in operands)
    return out, partition.manual_axis_type(out[0])


def _specs(cfg: Config, Kh: int, G: int):
    x_spec = pl.BlockSpec((cfg.block_m, Kh), lambda n, m, s: (m, 0))
    w_spec = pl.BlockSpec((cfg.block_n, Kh), lambda n, m, s: (n, 0))
    st_spec = pl.BlockSpec((G, cfg.block_n), lambda n, m, s: (0, n))
    return x_spec, w_spec, st_spec


def _w4a8_idots_or_acc(qa, zp, packed: PackedInt4Weight, cfg: Config, interpret: bool, fused: bool):
    M, K = qa.shape
    N, g, G = packed.out_features, packed.groupsize, packed.num_groups
    if cfg.block_k < 2 * MIN_INT8_DOT_K:
        raise ValueError(
            f"config.block_k={cfg.block_k} must be >= {2 * MIN_INT8_DOT_K} for W4A8: each nibble plane "
            f"is an int8 dot over block_k / 2 k, and Triton needs >= {MIN_INT8_DOT_K}"
        )
    if cfg.byte_planes and g * 2**14 >= 2**31:
        raise ValueError(
            f"config.byte_planes keeps a group's 16-fold int8 sums in int32: groupsize must be < 2**17, got {g}"
        )
    split = 1 if fused else cfg.split_k
    if G % split:
        raise ValueError(f"config.split_k={split} must divide the number of groups {G}")
    gpp = G // split
    ae, ao = _prepare(qa.astype(jnp.int8))
    w = packed.weight
    pad = cfg.block_k // 2 - K // 2
    if pad > 0:  # K < block_k (small channel-wise rows): one window must fit; q = 0 bytes add nothing
        ae, ao = (jnp.pad(a, ((0, 0), (0, pad))) for a in (ae, ao))
        w = jnp.pad(w, ((0, 0), (0, pad)), constant_values=0x88)
    Kh = ae.shape[1]
    x_spec, w_spec, st_spec = _specs(cfg, Kh, G)
    grid = (pl.cdiv(N, cfg.block_n), pl.cdiv(M, cfg.block_m), split)
    (ae, ao, zp, w, st), vma = _varying(ae, ao, zp, w, packed.scales.T)
    if fused:
        out_shape = jax.ShapeDtypeStruct((M, N), jnp.float32, manual_axis_type=vma)
        out_spec = pl.BlockSpec((cfg.block_m, cfg.block_n), lambda n, m, s: (m, n))
    else:
        out_shape = jax.ShapeDtypeStruct((G, M, N), jnp.int32, manual_axis_type=vma)
        out_spec = pl.BlockSpec((gpp, cfg.block_m, cfg.block_n), lambda n, m, s: (s, m, n))
    kernel = functools.partial(
        _w4a8_kernel,
        M=M,
        N=N,
        groupsize=g,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        block_k=cfg.block_k,
        groups_per_prog=gpp,
        fused=fused,
        swap_ab=cfg.swap_ab,
        byte_planes=cfg.byte_planes,
    )
    # gpu.triton_call: lowers inside a multi-platform (cpu + cuda) export as well
    return gpu.triton_call(
        lambda interp: pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=(x_spec, x_spec, pl.BlockSpec((cfg.block_m,), lambda n, m, s: (m,)), w_spec, st_spec),
            out_specs=out_spec,
            out_shape=out_shape,
            compiler_params=triton_backend.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=interp,
            name="jb_int4_w4a8_fused" if fused else "jb_int4_w4a8_group_dots",
        ),
        (ae, ao, zp, w, st),
        interpret=interpret,
    )


def dyn_quant_matmul(
    x: jax.Array, packed: PackedInt4Weight, *, config: Config | None = None, interpret: bool = False
) -> jax.Array:
    """W4A8 with torch's dyn-quant numerics (bit-exact with `base.dyn_quant_matmul`).

    Args:
      x: float32 or bfloat16 ``[..., K]``.
      packed: the packed weight.
      config: tiles; ``Config.heuristics`` when None.
      interpret: run in the Pallas interpreter (CPU tests).

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = base.quantize_4bit(jnp.ones((16, 64)), 32)
      >>> p = base.PackedInt4Weight(q, s, None, 32, 64, 16)
      >>> dyn_quant_matmul(jnp.ones((2, 64)), p, interpret=True).shape
      (2, 16)
    """
    base.check_packed(packed)
    x = base.check_input(x, packed)
    if why := unsupported(base.Int4Call.of("dyn_quant", x, packed), None):
        raise NotImplementedError("; ".join(why))
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    cfg = config or Config.heuristics(base.Int4Call.of("dyn_quant", x, packed))
    if cfg.scale_after_dot or not cfg.mma:
        raise ValueError(
            "config.scale_after_dot and config.mma=False are W4A16 options: the W4A8 kernel runs integer "
            "MMAs per group"
        )
    qa, zp, recip = base.quantize_activations(x2, packed.channelwise)
    if M == 0:
        out = jnp.zeros((0, packed.out_features), jnp.float32)
    elif M <= DECODE_M:
        idots = _w4a8_idots_or_acc(qa, zp, packed, cfg, interpret, fused=False)
        out = base.accumulate_groups(
            jnp.moveaxis(idots, 0, -1), packed.scales, recip, zp, packed.bias, packed.channelwise
        )
    else:
        acc = _w4a8_idots_or_acc(qa, zp, packed, cfg, interpret, fused=True)
        out = _finish(acc, recip, zp, packed.bias)
    out = out.reshape(*x.shape[:-1], packed.out_features)
    return base.truncate_to_bfloat16(out) if x.dtype == jnp.bfloat16 else out


def _finish(acc, recip, zp, bias):
    """``acc * recip (+ bias)`` clamped, as `base.accumulate_groups` ends."""
    if bias is None:
        out = acc * recip[:, None]
    else:
        out = base.rounded_mul(acc, recip[:, None], jnp.broadcast_to(zp[:, None], acc.shape)) + bias[None]
    fmax = jnp.finfo(jnp.float32).max
    return jnp.clip(out, -fmax, fmax)


def weight_only_matmul(
    x: jax.Array,
    packed: PackedInt4Weight,
    *,
    compute_dtype=None,
    config: Config | None = None,
    interpret: bool = False,
) -> jax.Array:
    """W4A16 / W4A32: ``x @ dequantize(w).T + bias`` with fp32 accumulation.

    Args:
      x: ``[..., K]`` float32 / bfloat16 / float16.
      packed: the packed weight.
      compute_dtype: MMA operand dtype (default: x.dtype; float32 uses IEEE
        dots).
      config: tiles; ``Config.heuristics`` when None.
      interpret: run in the Pallas interpreter (CPU tests).

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = base.quantize_4bit(jnp.ones((16, 64)), 32)
      >>> p = base.PackedInt4Weight(q, s, None, 32, 64, 16)
      >>> weight_only_matmul(jnp.ones((2, 64)), p, interpret=True).shape
      (2, 16)
    """
    base.check_packed(packed)
    x = base.check_input(x, packed, allowed=(jnp.float32, jnp.bfloat16, jnp.float16), name="x")
    if why := unsupported(base.Int4Call.of("weight_only", x, packed), None):
        raise NotImplementedError("; ".join(why))
    cd = jnp.dtype(compute_dtype or x.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N, g = packed.out_features, packed.groupsize
    cfg = config or Config.heuristics(base.Int4Call.of("weight_only", x, packed))
    if cfg.byte_planes:
        raise ValueError("config.byte_planes is a W4A8 option: the W4A16 kernel dequantizes to floats")
    if g % cfg.block_k:
        raise ValueError(f"config.block_k={cfg.block_k} must divide groupsize={g}")
    steps = K // cfg.block_k
    if steps % cfg.split_k:
        raise ValueError(f"config.split_k={cfg.split_k} must divide K // block_k = {steps}")
    if M == 0:
        out = jnp.zeros((0, N), jnp.float32)
    else:
        xe, xo = _prepare(x2)
        (xe, xo, w, st), vma = _varying(xe, xo, packed.weight, packed.scales.T)
        x_spec, w_spec, st_spec = _specs(cfg, K // 2, packed.num_groups)
        kernel = functools.partial(
            _w4a16_kernel,
            c=_W4A16(
                M,
                N,
                g,
                cfg.block_m,
                cfg.block_n,
                cfg.block_k,
                steps // cfg.split_k,
                cd,
                cfg.scale_after_dot,
                cfg.mma,
                cfg.swap_ab,
            ),
        )
        parts = gpu.triton_call(  # lowers inside a multi-platform (cpu + cuda) export as well
            lambda interp: pl.pallas_call(
                kernel,
                grid=(pl.cdiv(N, cfg.block_n), pl.cdiv(M, cfg.block_m), cfg.split_k),
                in_specs=(x_spec, x_spec, w_spec, st_spec),
                out_specs=pl.BlockSpec((None, cfg.block_m, cfg.block_n), lambda n, m, s: (s, m, n)),
                out_shape=jax.ShapeDtypeStruct((cfg.split_k, M, N), jnp.float32, manual_axis_type=vma),
                compiler_params=triton_backend.CompilerParams(
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages
                ),
                interpret=interp,
                name="jb_int4_w4a16",
            ),
            (xe, xo, w, st),
            interpret=interpret,
        )
        out = jnp.sum(parts, axis=0)
    if packed.bias is not None:
        out = out + packed.bias[None]
    return out.reshape(*x.shape[:-1], N).astype(x.dtype)
