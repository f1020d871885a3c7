"""Shared int4 test base: one grid, one reference, one short subclass per implementation.

Every implementation must equal `base.dyn_quant_matmul` **bit for bit** for float32 (and for the
truncated bfloat16 output) over a shrunk but feature-complete grid: M in {0, 1, 3, 16, 128}, K / N
including non-powers of two, groupsize {32, 64, 128, K (channel-wise)}, bias / none, all-zero and
constant input rows, q = -8 nibbles, batch dims, transposed and strided inputs, jit and vmap.
Weight-only mode is compared with ``x @ dequantize(w).T`` at float tolerance.

Not collected itself (no ``test_`` prefix); the ``test_*.py`` files subclass `Int4Suite`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int4_matmul import base

_quantize = jax.jit(base.quantize_4bit, static_argnums=1)
reference = jax.jit(base.dyn_quant_matmul)

# (M, K, N, groupsize, bias): every feature of the full grid, shrunk.
GRID = [
    (0, 64, 16, 32, False),
    (1, 256, 48, 32, True),
    (1, 192, 40, 64, False),  # K, N not powers of two
    (3, 384, 24, 128, True),
    (3, 96, 20, 96, False),  # channel-wise, K = 3 * 32
    (16, 320, 33, 64, True),  # odd N
    (16, 128, 16, 128, False),  # channel-wise, power of two
    (17, 256, 40, 128, True),  # 16-row blocks plus a one-row tail
    (128, 160, 24, 32, True),  # prefill
]
CHANNELWISE_ODD_K = (2, 48, 8, 48, True)  # channel-wise K not a multiple of 32


def make_case(M, K, N, g, bias, *, seed=0, lead=()):
    """Random weights and inputs with the edge cases planted."""
    rng = np.random.default_rng(seed + 1000 * M + K + N + g)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w[0, :] = 0.0  # an all-zero weight row (scale 0)
    packed, scales = _quantize(jnp.asarray(w), g)
    packed = np.array(packed)
    packed[1 % N, 0] &= 0xF0  # q = -8 in a low nibble
    packed[2 % N, 1] &= 0x0F  # q = -8 in a high nibble
    b = jnp.asarray(rng.standard_normal(N).astype(np.float32)) if bias else None
    p = base.PackedInt4Weight(jnp.asarray(packed), scales, b, g, K, N)
    x = (rng.standard_normal(lead + (M, K)) * 2.5 + 0.3).astype(np.float32)
    if M >= 4:  # row 0 stays an ordinary mixed-sign row; small M (decode) cases are all ordinary rows
        x[..., 1, :] = 0.0  # all-zero row
        x[..., 2, :] = 1.7  # constant row
        x[..., 3, :] = -np.abs(x[..., 3, :])  # all-negative row
    return jnp.asarray(x), p


class Int4Suite:
    """Subclasses set `impl` (``(x, packed) -> y``), `weight_only` and the `supports_*` switches."""

    impl = staticmethod(lambda x, p: reference(x, p))
    weight_only = staticmethod(lambda x, p: base.weight_only_matmul(x, p))
    grid = GRID
    supports_odd_channelwise = True
    supports_bf16 = True
    weight_only_tol = 2e-5

    @pytest.fixture(
        params=range(len(GRID)), ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-g{c[3]}-b{int(c[4])}" for c in GRID]
    )
    def case(self, request):
        if request.param >= len(self.grid):
            pytest.skip("not in this implementation's grid")
        return self.grid[request.param]

    def test_bit_exact(self, case):
        x, p = make_case(*case)
        want = reference(x, p)
        got = jax.jit(self.impl)(x, p)
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    @pytest.mark.parametrize("row", ["zero", "constant", "negative", "positive"])
    def test_special_single_rows(self, row):
        """The decode (M=1) paths on the input rows with a degenerate quantization range."""
        x, p = make_case(1, 192, 24, 64, True)
        x = {
            "zero": jnp.zeros_like(x),
            "constant": jnp.full_like(x, -0.6),
            "negative": -jnp.abs(x),
            "positive": jnp.abs(x),
        }[row]
        np.testing.assert_array_equal(np.asarray(jax.jit(self.impl)(x, p)), np.asarray(reference(x, p)))

    def test_batch_dims_and_layouts(self):
        M, K, N, g, bias = 5, 192, 24, 64, True
        x, p = make_case(M, K, N, g, bias, lead=(2,))
        want = np.asarray(reference(x, p))
        np.testing.assert_array_equal(np.asarray(jax.jit(self.impl)(x, p)), want)
        # transposed: the kernel sees x through a transpose inside the jit
        xt = jnp.swapaxes(x, -1, -2)
        got = jax.jit(lambda a, p: self.impl(jnp.swapaxes(a, -1, -2), p))(xt, p)
        np.testing.assert_array_equal(np.asarray(got), want)
        # strided: every other column of a wider array
        wide = jnp.stack([x, -x], axis=-1).reshape(2, M, 2 * K)
        got = jax.jit(lambda a, p: self.impl(a[..., ::2], p))(wide, p)
        np.testing.assert_array_equal(np.asarray(got), want)
        # vmap over a batch of inputs with one weight
        got = jax.vmap(self.impl, in_axes=(0, None))(x, p)
        np.testing.assert_array_equal(np.asarray(got), want)
        # two leading dims, and an empty batch
        x4, _ = make_case(5, K, N, g, bias, lead=(2, 3))
        np.testing.assert_array_equal(np.asarray(jax.jit(self.impl)(x4, p)), np.asarray(reference(x4, p)))
        empty = jax.jit(self.impl)(jnp.zeros((2, 0, K), jnp.float32), p)
        assert empty.shape == (2, 0, N)

    def test_channelwise_odd_k(self):
        if not self.supports_odd_channelwise:
            pytest.skip("channel-wise K % 32 != 0 not supported here")
        x, p = make_case(*CHANNELWISE_ODD_K)
        np.testing.assert_array_equal(np.asarray(jax.jit(self.impl)(x, p)), np.asarray(reference(x, p)))

    def test_bfloat16_truncated(self):
        if not self.supports_bf16:
            pytest.skip("bfloat16 input not supported here")
        x, p = make_case(3, 128, 16, 128, True)
        xb = x.astype(jnp.bfloat16)
        got = jax.jit(self.impl)(xb, p)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(got.astype(jnp.float32)), np.asarray(reference(xb, p).astype(jnp.float32))
        )

    @pytest.mark.parametrize("M,K,N,g", [(1, 256, 40, 32), (5, 192, 24, 64), (40, 128, 16, 128)])
    def test_weight_only(self, M, K, N, g):
        x, p = make_case(M, K, N, g, True, lead=(2,))
        w = np.asarray(base.dequantize(p.weight, p.scales, g), np.float64)
        want = np.asarray(x, np.float64) @ w.T + np.asarray(p.bias, np.float64)
        got = np.asarray(jax.jit(self.weight_only)(x, p), np.float64)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=self.weight_only_tol * np.abs(want).max())
