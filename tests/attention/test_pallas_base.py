"""The shared attention test base on the Pallas Triton kernels, in interpret mode (CPU, no GPU).

Interpret mode is slow, so each kernel runs a shrunk slice of the shared grid that still covers
every dtype, both causal alignments, T > S and T < S, GQA 2 / 4, bool and additive masks, dropout,
lengths, segment ids and jit on / off; ``test_pallas_parity.py`` covers the remaining features
(window, softcap, head dims up to 256, every bias broadcast pattern, decode) case by case.
"""
import functools

from pallas_kernels.attention import flash, flash_vjp, mem_efficient
from tests.attention.attention_base import GRID, AttentionTestBase

# Blocks of 16 so the grid's 29..64-long sequences span several ragged blocks.
CFG = flash.Config(block_q=16, block_k=16)
BWD = flash_vjp.Config(block_q=16, block_k=16)

_FLASH_CASES = {GRID[2].id, GRID[4].id, GRID[11].id, GRID[17].id}
_MEM_CASES = {GRID[5].id, GRID[10].id, GRID[18].id}


class TestPallasFlashInterpret(AttentionTestBase):
  impl = staticmethod(functools.partial(flash.attention, config=CFG, bwd_config=BWD,
                                        interpret=True))
  supports_bias = False
  supports_mask = False
  grid_filter = staticmethod(lambda c: c.id in _FLASH_CASES)


class TestPallasMemEfficientInterpret(AttentionTestBase):
  impl = staticmethod(functools.partial(mem_efficient.attention, config=CFG, bwd_config=BWD,
                                        interpret=True))
  grid_filter = staticmethod(lambda c: c.id in _MEM_CASES)
