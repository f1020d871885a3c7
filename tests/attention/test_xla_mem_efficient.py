"""XLA memory-efficient attention (CPU EFFICIENT_ATTENTION) on the shared grid, plus bias tiling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import base, xla_mem_efficient
from tests.attention.attention_base import GRID, AttentionTestBase, assert_close, grads_of

CFG = xla_mem_efficient.Config(block_q=16, block_k=8, block_q_bwd=8, block_k_bwd=16)


class TestXlaMemEfficient(AttentionTestBase):
    impl = staticmethod(functools.partial(xla_mem_efficient.attention, config=CFG))
    # The engine is xla_flash's (tested on the full grid there); here every bias / mask case runs.
    grid_filter = staticmethod(lambda c: c.mask != "none" or c.id == GRID[0].id)


@pytest.mark.parametrize(
    "bias_shape", [(2, 4, 27, 35), (1, 1, 27, 35), (2, 1, 1, 35), (1, 4, 27, 1), (1, 1, 1, 1)]
)
def test_bias_broadcast_patterns_and_bias_grad(bias_shape):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 27, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 35, 2, 16)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
    mask = jnp.asarray(rng.random((1, 4, 27, 35)) > 0.2)
    args = base.make_args(q, k, k, bias=bias, mask=mask, is_causal=True, diag_offset=8)
    impl = functools.partial(xla_mem_efficient.attention, config=CFG)
    out, _ = impl(args)
    assert_close(out, base.reference(args)[0], 2e-5, "out")
    g = grads_of(impl, args, jit=True)
    r = grads_of(base.reference, args, jit=True)
    assert g[3].shape == bias_shape
    for a, b in zip(g, r):
        assert_close(a / float(jnp.abs(b).max()), b / float(jnp.abs(b).max()), 5e-5, "grad")
