"""Tiles of the Pallas Triton int4 kernels (`pallas`): `Config`, with the tuning protocol every
kernel config here has (``Config.heuristics(call, device)``: the default for an `base.Int4Call` on a
device; ``Config.search_space(call)``: the candidates an autotuner may time), and the shape rule
`heuristics` behind it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from . import base

__all__ = ["Config", "heuristics", "DECODE_M", "MIN_INT8_DOT_K"]

DECODE_M = 16
"""Rows up to which the decode configs (split-K) are used."""

MIN_INT8_DOT_K = 32
"""The narrowest int8 dot Triton compiles correctly on NVIDIA GPUs (its ``min_dot_size`` for 8-bit
operands; the int8 MMA instructions are k32). Pallas does not check it: a narrower dot compiles and
returns wrong sums."""


def _mode(call: base.Int4Call) -> str:
    return "w4a8" if call.op == "dyn_quant" else "w4a16"


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one launch.

    Attributes:
      block_m: rows of x per program (>= 16: the MMA minimum).
      block_n: output features per program.
      block_k: k per inner step, a power of two: W4A16 >= 32 and dividing
        groupsize; W4A8 >= 64 (each nibble plane of a step is an int8 dot
        over block_k / 2 >= `MIN_INT8_DOT_K` k), dividing groupsize where it
        can (otherwise the steps of a group overlap and are masked).
      split_k: programs along K (W4A16: k-steps, W4A8 decode: groups); it
        divides the number of steps (groups).
      num_warps: Triton warps per program.
      num_stages: software-pipelining depth.
      scale_after_dot: W4A16 only. Dequantize each nibble to the exact
        integer ``u - 8`` in the compute dtype and multiply each step's dot
        (its k lie in one group) by the group scales, instead of scaling
        every weight before the dot: no multiply and no float32 round trip
        per weight, and no rounding of ``(u - 8) * scale`` to bf16 / f16.
        Off in the heuristics until measured on a GPU; in the search space
        with ``options=True``.
      mma: W4A16 only. False: no MMA; each of the program's rows
        (``min(block_m, M)``, unrolled: ``block_m`` at most 16) is a float32
        multiply and sum over k against the dequantized tile in the layout it
        was loaded in (a GEMV: no operand layout conversion, no padding of one
        row to 16). For decode; True in the heuristics until measured on a
        GPU; both in the decode search space with ``options=True``.
      swap_ab: compute the transposed product, ``out^T = w x^T``: the
        dequantized weight tile is the MMA's A operand and the activations
        its B operand. On sm90 a warpgroup MMA takes A from registers and B
        only from shared memory, so the weights, dequantized in registers,
        feed the MMA from there instead of being stored to shared memory
        after their dequantization (their packed bytes still pass through
        shared memory once, for their layout; more registers: 230 against
        182 at 128 x 128 x 64, 8 warps); the weight tile's ``block_n`` rows
        fill the MMA's 64-row side and the activation rows its narrow side
        (8 to 256): at decode the 16-row ``mma.sync`` becomes a 64 x 16
        warpgroup MMA. Off in the heuristics until
        measured on a GPU; in the search space with ``options=True``.
      byte_planes: W4A8 only. The weights enter the int8 MMAs as the bytes
        ``16 (u - 8)``, made by logic ops on the packed bytes (no widening,
        subtracting and narrowing of each nibble), and the weight sums the
        zero point needs come from an int8 MMA with a tile of ones instead
        of a sum over every weight; exact for groupsizes below 2**17. In the
        sm90 SASS a decode step takes 287 instructions instead of 518 (the
        fused prefill kernel more: 1056 against 916 per group). Off in the
        heuristics until run on a GPU; in the search space with
        ``options=True``.
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    scale_after_dot: bool = False
    mma: bool = True
    swap_ab: bool = False
    byte_planes: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Config.{name} must be a power of two >= 16, got {name}={v}")
        if self.block_k < 32:
            raise ValueError(
                f"Config.block_k must be >= 32 (two nibble planes of >= 16 k; W4A8 needs >= 64), "
                f"got block_k={self.block_k}"
            )
        if self.split_k < 1:
            raise ValueError(f"Config.split_k must be >= 1, got split_k={self.split_k}")
        for name in ("scale_after_dot", "mma", "swap_ab", "byte_planes"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        if not self.mma and self.block_m > DECODE_M:
            raise ValueError(
                f"Config.mma=False unrolls one multiply-and-sum per row: block_m must be <= {DECODE_M}, "
                f"got block_m={self.block_m}"
            )
        if self.swap_ab and not self.mma:
            raise ValueError("Config.swap_ab transposes the MMA: it needs mma=True")

    @classmethod
    def heuristics(cls, call: base.Int4Call, device: Mapping[str, Any] | None = None) -> "Config":
        """:func:`heuristics` for ``call`` (``"dyn_quant"``: W4A8, ``"weight_only"``: W4A16) on
        ``device`` (its ``num_sms`` when given; an H100's 132 otherwise)."""
        p = call.packed
        num_sms = int((device or {}).get("num_sms", 132))
        return heuristics(
            call.rows, p.out_features, p.in_features, p.groupsize, mode=_mode(call), num_sms=num_sms
        )

    @classmethod
    def search_space(cls, call: base.Int4Call, *, options: bool = False) -> list:
        """The configs the kernel of ``call`` accepts among: decode (``M <= 16``) 16-row tiles x
        32 / 64 / 128 features with split-K 1 / 2 / 4 / 8 / 16, prefill 32 / 64 / 128 rows x 64 / 128
        features; ``block_k`` every power of two from the kernel's minimum up to 256 (decode) / 128
        (prefill) that fits the group; 4 / 8 warps, 2 / 3 stages. ``options=True`` adds the options
        not yet measured (``swap_ab``; for W4A8 also ``byte_planes``, for W4A16 ``scale_after_dot``
        and at decode ``mma=False``: four times the W4A8 configs, six times (decode) or four times
        (prefill) the W4A16 ones; ``benchmarks/tune_gpu.py`` walks them), which the autotuner leaves
        out."""
        p, mode = call.packed, _mode(call)
        M, K, g = call.rows, p.in_features, p.groupsize
        decode = M <= DECODE_M
        lo = 2 * MIN_INT8_DOT_K if mode == "w4a8" else 32
        ks = [bk for bk in (32, 64, 128, 256) if lo <= bk <= (256 if decode else 128)]
        if mode == "w4a16":
            ks = [bk for bk in ks if g % bk == 0]
        out = []
        for bm in (16,) if decode else (32, 64, 128):
            for bn in (32, 64, 128) if decode else (64, 128):
                for bk in ks:
                    steps = K // bk if mode == "w4a16" else K // g
                    for split in (1, 2, 4, 8, 16) if decode else (1,):
                        if steps % split:
                            continue
                        for warps in (4, 8):
                            for stages in (2, 3):
                                out += [
                                    cls(bm, bn, bk, split, warps, stages, *opts)
                                    for opts in _options(mode, decode, options, g)
                                ]
        return out


def _options(mode: str, decode: bool, options: bool, groupsize: int) -> list:
    """(scale_after_dot, mma, swap_ab, byte_planes) of the search space: the measured kernel alone, or with
    ``options`` every combination its mode accepts (``byte_planes`` for groupsizes below 2**17)."""
    if not options:
        return [(False, True, False, False)]
    if mode == "w4a8":
        planes = (False, True) if groupsize < 2**17 else (False,)
        return [(False, True, swap, bp) for swap in (False, True) for bp in planes]
    out = [(after, True, swap, False) for after in (False, True) for swap in (False, True)]
    return out + ([(after, False, False, False) for after in (False, True)] if decode else [])


def _pow2_divisor(groupsize: int, cap: int) -> int:
    b = 32
    while b * 2 <= cap and groupsize % (b * 2) == 0:
        b *= 2
    return b


def _largest_divisor(n: int, cap: int) -> int:
    for d in range(max(1, min(n, cap)), 0, -1):
        if n % d == 0:
            return d
    return 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def heuristics(M: int, N: int, K: int, groupsize: int, *, mode: str = "w4a16", num_sms: int = 132) -> Config:
    """Tiles by M: decode (``M <= 16``: thin tiles + split-K) vs prefill.

    Args:
      M: rows of x (all leading dims flattened).
      N: out_features.
      K: in_features.
      groupsize: quantization group.
      mode: "w4a16" or "w4a8".
      num_sms: streaming multiprocessors to fill (H100: 132).

    Example:
      >>> heuristics(1, 11008, 4096, 128).split_k > 1
      True
    """
    if mode not in ("w4a16", "w4a8"):
        raise ValueError(f"mode must be 'w4a16' or 'w4a8', got {mode=}")
    if M <= DECODE_M:
        block_m, block_n, cap_k, warps, stages = 16, 64, 256, 4, 3
    else:
        block_m = min(128, max(32, _next_pow2(M)))
        block_n, cap_k, warps, stages = 128, 64, 8 if block_m >= 128 else 4, 3
    block_k = _pow2_divisor(groupsize, cap_k)
    if mode == "w4a8":
        block_k = max(block_k, 2 * MIN_INT8_DOT_K)
    split = 1
    if M <= DECODE_M:
        tiles = -(-N // block_n)
        want = max(1, -(-2 * num_sms // tiles))
        steps = K // block_k if mode == "w4a16" else K // groupsize
        split = _largest_divisor(steps, min(want, 32))
    return Config(block_m, block_n, block_k, split, warps, stages)
