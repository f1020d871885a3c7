"""The blockwise XLA flash code (FLASH off CUDA where the C++ kernel cannot run) on the shared grid,
plus its own tiling tests. (The C++ kernel is a separate implementation: tests/attention/test_cpp_flash.py.)"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import base, xla_flash
from tests.attention.attention_base import AttentionTestBase, Case, assert_close, grads_of, make_case

# Small, unequal tiles so every grid case spans several ragged blocks (forward and backward differ).
CFG = xla_flash.Config(block_q=16, block_k=8, block_q_bwd=8, block_k_bwd=16)


class TestXlaFlash(AttentionTestBase):
    impl = staticmethod(functools.partial(xla_flash.attention, config=CFG))
    supports_bias = False
    supports_mask = False


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True),
        dict(is_causal=True, diag_offset=-20),  # T > S lower-right: whole query blocks empty
        dict(window=(0, 0)),  # one key per query
        dict(window=(9, 2), is_causal=True, diag_offset=5),
    ],
)
def test_block_skipping_matches_reference(kw):
    """The visited key range per query block (and query range per key block) is exact."""
    args = make_case(Case("float32", "none", 53, 33, 32, 2))
    args = args.replace(
        **{k: v for k, v in kw.items() if k != "is_causal"}, causal=kw.get("is_causal", False)
    )
    cfg = xla_flash.Config(block_q=16, block_k=8, block_q_bwd=8, block_k_bwd=32)
    out, lse = xla_flash.attention(args, config=cfg)
    ref, ref_lse = base.reference(args)
    assert_close(out, ref, 2e-5, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    g = grads_of(functools.partial(xla_flash.attention, config=cfg), args, jit=True)
    r = grads_of(base.reference, args, jit=True)
    for a, b in zip(g, r):
        assert_close(a, b, 5e-5 * float(jnp.abs(b).max() + 1), "grad")


def test_default_heuristics_and_config_validation():
    args = make_case(Case("float32", "top_left", 40, 40, 32, 2))
    cfg = xla_flash.Config.heuristics(args)
    assert cfg.block_q == 40 and cfg.block_k == 40  # shrunk to the 8-rounded length
    long = base.make_args(*(jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32),) * 3)
    assert xla_flash.Config.heuristics(long) == xla_flash.Config(1024, 1024, 256, 1024)
    assert xla_flash.Config.heuristics(long.replace(causal=True)).block_q == 512
    out, _ = xla_flash.attention(args)
    assert_close(out, base.reference(args)[0], 2e-5, "out")
    with pytest.raises(ValueError, match="block_q"):
        xla_flash.Config(block_q=0)


def test_refuses_bias_and_mask_with_reasons():
    args = make_case(Case("float32", "none", 8, 8, 32, 1, "additive"))
    assert any("bias" in r for r in xla_flash.unsupported(args, "cpu"))
    with pytest.raises(NotImplementedError, match="bias"):
        xla_flash.attention(args)


def test_peak_memory_is_linear_in_length():
    """Compiled temp memory of fwd+bwd at L=4096 stays far below one L x L score matrix."""
    L, N, D = 4096, 2, 32
    x = jax.ShapeDtypeStruct((1, L, N, D), jnp.float32)

    def loss(q, k, v):
        args = base.make_args(q, k, v, is_causal=True)
        cfg = dataclasses.replace(xla_flash.Config.heuristics(args))
        return xla_flash.attention(args, config=cfg)[0].sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < L * L * N * 4 / 8, temp  # < 1/8 of one f32 [N, L, L] logits array
