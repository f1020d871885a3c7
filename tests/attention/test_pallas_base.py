"""The shared attention test base on the Pallas Triton kernels, in interpret mode (CPU, no GPU).

Interpret mode is slow, so each kernel runs a shrunk slice of the shared grid that still covers
every dtype, both causal alignments, T > S and T < S, GQA 2 / 4, bool and additive masks, dropout,
lengths, segment ids and jit on / off; ``test_pallas_parity.py`` covers the remaining features
(window, softcap, head dims up to 256, every bias broadcast pattern) case by case. The decode kernel
(queries of at most 16 rows) runs grid cases shortened to such queries.
"""

import dataclasses
import functools

import pytest

from pallas_kernels.attention import triton_decode, triton_flash, triton_flash_vjp, triton_mem_efficient
from tests.attention.attention_base import GRID, AttentionTestBase, DecodeTestBase

# Blocks of 16 so the grid's 29..64-long sequences span several ragged blocks.
CFG = triton_flash.Config(block_q=16, block_k=16)
BWD = triton_flash_vjp.Config(block_q=16, block_k=16)

_FLASH_CASES = {GRID[2].id, GRID[4].id, GRID[11].id, GRID[17].id}
_MEM_CASES = {GRID[5].id, GRID[10].id, GRID[18].id}


class TestPallasFlashInterpret(AttentionTestBase):
    impl = staticmethod(functools.partial(triton_flash.attention, config=CFG, bwd_config=BWD, interpret=True))
    supports_bias = False
    supports_mask = False
    grid_filter = staticmethod(lambda c: c.id in _FLASH_CASES)


class TestPallasMemEfficientInterpret(AttentionTestBase):
    impl = staticmethod(
        functools.partial(triton_mem_efficient.attention, config=CFG, bwd_config=BWD, interpret=True)
    )
    grid_filter = staticmethod(lambda c: c.id in _MEM_CASES)


# The decode kernel serves T <= 16: grid cases with their query shortened (causal alignments, GQA 4,
# dropout, lengths, segment ids, window, f16 / bf16, T = 1 included); its backward is the flash one.
_DECODE_GRID = [
    dataclasses.replace(GRID[i], T=t)
    for i, t in ((2, 5), (4, 16), (11, 3), (12, 1), (16, 7), (17, 9), (18, 12))
]
DEC = triton_decode.Config(block_k=16, num_splits=3)


class TestPallasDecodeInterpret(DecodeTestBase):
    impl = staticmethod(
        functools.partial(triton_decode.attention, config=DEC, bwd_config=BWD, interpret=True)
    )

    @pytest.mark.parametrize("case", _DECODE_GRID, ids=[c.id for c in _DECODE_GRID])
    def test_grid(self, case):
        super().test_grid(case)
