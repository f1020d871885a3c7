"""The MATH backend (the reference) on the shared grid, its low-precision mode and the dropout hash."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import base
from tests.attention.attention_base import AttentionTestBase, Case, assert_close, make_case


class TestMath(AttentionTestBase):
    impl = staticmethod(base.attention)


def test_low_precision_reduction_is_close_but_not_f32():
    args = make_case(Case("bfloat16", "top_left", 64, 64, 64, 2))
    lo, _ = base.attention(args, low_precision=True)
    hi, _ = base.attention(args)
    assert lo.dtype == jnp.bfloat16
    assert_close(lo, hi, 5e-2, "low precision")
    assert not np.array_equal(np.asarray(lo), np.asarray(hi))  # it really reduced in bf16
    # and the flag drives it through the public dispatch (math only)
    import jbackends as jb
    from jbackends.attention import SDPBackend

    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (args.q, args.k, args.v))
    call = lambda: jb.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    with jb.sdpa_kernel(SDPBackend.MATH):
        plain = call()
        with jb.with_backends(allow_fp16_bf16_reduction_math_sdp=True):
            reduced = call()
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(plain, 1, 2)), np.asarray(hi))
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(reduced, 1, 2)), np.asarray(lo))


def test_dropout_keep_mask_rate_and_statelessness():
    key = jax.random.key(3)
    i = jnp.arange(256)[:, None]
    j = jnp.arange(256)[None, :]
    keep = base.dropout_keep_mask(key, 1, 2, i, j, 0.3)
    assert abs(float(keep.mean()) - 0.7) < 0.01
    again = base.dropout_keep_mask(jax.random.key_data(key), 1, 2, i, j, 0.3)  # raw key words
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(again))
    other_head = base.dropout_keep_mask(key, 1, 3, i, j, 0.3)
    assert float((keep != other_head).mean()) > 0.3
    seed = base.dropout_seed(key)
    kernel_form = base.dropout_keep_from_seed(seed[0], seed[1], 1, 2, i, j, base.dropout_threshold(0.3))
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(kernel_form))


def test_reference_matches_jax_nn():
    args = make_case(Case("float32", "top_left", 33, 33, 32, 2, "additive"))
    ours, _ = base.reference(args)
    theirs = jax.nn.dot_product_attention(args.q, args.k, args.v, bias=args.bias, is_causal=True)
    assert_close(ours, theirs, 1e-5, "vs jax.nn")
