"""The MATH backend (the reference): against float64 NumPy on the shared grid, its low-precision mode and
the dropout hash. (`TestMath` runs the shared base on it, which compares it with itself: only in
--extended runs.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import base
from tests.attention.attention_base import GRID, AttentionTestBase, Case, assert_close, make_case, upcast


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


def test_structure_empties_rows_matches_the_full_mask():
    """The static (numpy) answer equals the traced one: some row of the full causal / window mask has
    no key. Random lengths, alignments and windows, rows empty and not."""
    rng = np.random.default_rng(11)
    seen, checked = set(), []
    for _ in range(120):
        T, S = (int(x) for x in rng.integers(1, 24, size=2))
        causal = bool(rng.integers(2))
        window = None if rng.integers(3) == 0 else tuple(int(x) for x in rng.integers(0, 12, size=2))
        if not causal and window is None:
            causal = True
        x = jnp.zeros((1, T, 1, 4))
        kv = jnp.zeros((1, S, 1, 4))
        for offset in {0, S - T, int(rng.integers(-5, 6))}:
            args = base.make_args(x, kv, kv, is_causal=causal, window=window, diag_offset=offset)
            i, j = np.arange(T)[:, None], np.arange(S)[None, :]  # the mask from its definition
            m = np.ones((T, S), bool)
            if causal:
                m &= j <= i + offset
            if window is not None:
                m &= (j >= i + offset - window[0]) & (j <= i + offset + window[1])
            want = bool(np.any(~np.any(m, axis=-1)))
            if len(checked) < 12:  # and now and then the library's own full mask
                full = np.broadcast_to(np.asarray(base.full_mask(args)), (1, 1, T, S))[0, 0]
                np.testing.assert_array_equal(full, m)
                checked.append(1)
            assert base.structure_empties_rows(args) is want, (T, S, causal, window, offset)
            assert (base.rows_without_keys(args) is None) is (not want)
            seen.add(want)
    assert seen == {True, False}


def test_no_key_at_all_empties_every_row():
    """S = 0: every row is empty, with or without causal structure (the cuDNN bridge relies on it)."""
    x, none = jnp.zeros((1, 5, 1, 4)), jnp.zeros((1, 0, 1, 4))
    for kw in ({}, {"is_causal": True}):
        args = base.make_args(x, none, none, **kw)
        assert base.structure_empties_rows(args) is True
        np.testing.assert_array_equal(np.asarray(base.rows_without_keys(args)), np.ones((1, 1, 5), bool))


def test_top_left_causal_call_has_no_pass_over_the_output():
    """jax.nn's top-left causal mask leaves every row a key: the fully-masked-row fix returns the
    kernel's output untouched (no select over the output: the default causal bf16 forward at 4k ran at
    0.93x cuDNN on an H200 while it had two; that they were the whole gap is a guess, not re-measured).
    A window that leaves rows without keys keeps jax.nn's substitution."""
    from jbackends._src import fully_masked  # noqa: PLC0415

    q, kv = jnp.ones((1, 64, 2, 16)), jnp.ones((1, 16, 2, 16))
    out, lse = jnp.ones((1, 64, 2, 16)), jnp.zeros((1, 2, 64))
    causal = base.make_args(q, q, q, is_causal=True)
    assert fully_masked.fix_fully_masked_rows(causal, out, lse, "jax") == (out, lse)
    # rows 18.. see no key of 16 through a (2, 2) window
    window = base.make_args(q, kv, kv, window=(2, 2))
    lse = lse.at[:, :, 18:].set(-jnp.inf)
    fixed, _ = fully_masked.fix_fully_masked_rows(window, out, lse, "jax")
    np.testing.assert_allclose(np.asarray(fixed[:, 18:]), 1.0)  # the mean of V (ones), from the fix
    assert fixed is not out


@pytest.mark.parametrize(
    "kw, same_as",
    [
        (dict(is_causal=True, diag_offset=2**40), dict()),  # every key on or below the diagonal
        (dict(is_causal=True, diag_offset=-(2**40)), dict(is_causal=True, diag_offset=-6)),  # none
        (dict(diag_offset=2**40, window=(2**40 + 2, 0)), dict(window=(2, 6))),  # j - i >= -2
        (dict(is_causal=True, diag_offset=2**35, window=(2**35 + 1, 7)), dict(window=(1, 6))),  # j - i >= -1
    ],
)
def test_a_diagonal_past_the_sequences_is_clamped_to_the_same_mask(kw, same_as):
    """A diag_offset beyond every key - query distance (alone or with a window that brings the band
    back) is clamped to one that masks the same: no int32 wrap in the kernels' index arithmetic."""
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32) for _ in range(3))
    args = base.make_args(q, k, v, **kw)
    assert -6 <= args.diag_offset <= 6 and all(0 <= w <= 12 for w in args.window or ())

    def dense(a):
        m = base.full_mask(a)
        return np.broadcast_to(np.asarray(True if m is None else m), (1, 1, 6, 6))

    np.testing.assert_array_equal(dense(args), dense(base.make_args(q, k, v, **same_as)))


def test_a_window_wider_than_the_sequences_is_clamped_and_masks_nothing_more():
    """A window side past every query-key distance is clamped (the kernels' int32 index arithmetic
    would wrap at 2**31 - 1 and empty rows), and the result equals no window at all."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32) for _ in range(3))
    args = base.make_args(q, k, v, window=(2**31 - 1, 2**31 - 1), diag_offset=3)
    assert args.window == (9, 3)  # key - query distances from -6 to 6 around the diagonal at 3
    assert base.rows_without_keys(args) is None
    out, lse = base.reference(args)
    want, want_lse = base.reference(base.make_args(q, k, v))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)


def _float64_attention(args):
    """Attention in float64 NumPy, written from the contract of `base.make_args` (not from the
    reference's code): scaled logits, soft cap ``cap * tanh(s / cap)``, additive bias, then every mask
    (causal ``j <= i + diag_offset``; window ``i + off - left <= j <= i + off + right``; ``i < q_len``,
    ``j < kv_len`` per batch row; equal segment ids; the bool mask), softmax, dropout's kept weights
    scaled by ``1 / (1 - rate)``. Query head ``n`` reads key / value head ``n // groups``. Returns
    ``(out [B, T, N, Hv], lse [B, N, T])``; a row with no key has output 0 and LSE -inf."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731 - exact upcast
    q, k, v = f64(args.q), f64(args.k), f64(args.v)
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * args.scale
    if args.logits_soft_cap is not None:
        s = args.logits_soft_cap * np.tanh(s / args.logits_soft_cap)
    if args.bias is not None:
        s = s + f64(args.bias)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    allow = np.ones((B, N, T, S), bool)
    off = args.diag_offset
    if args.causal:
        allow &= j <= i + off
    if args.window is not None:
        left, right = args.window
        allow &= (j >= i + off - left) & (j <= i + off + right)
    for b in range(B):
        if args.q_seq_lengths is not None:
            allow[b] &= i < int(args.q_seq_lengths[b])
        if args.kv_seq_lengths is not None:
            allow[b] &= j < int(args.kv_seq_lengths[b])
        if args.q_segment_ids is not None:
            qs, ks = np.asarray(args.q_segment_ids[b]), np.asarray(args.kv_segment_ids[b])
            allow[b] &= qs[:, None] == ks[None, :]
    if args.mask is not None:
        allow &= np.asarray(args.mask)
    s = np.where(allow, s, -np.inf)
    empty = ~allow.any(-1)
    m = np.where(empty, 0.0, s.max(-1))
    p = np.exp(s - m[..., None])
    denom = p.sum(-1)
    lse = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, denom)) + m)
    w = p / np.where(empty, 1.0, denom)[..., None]
    if args.dropout_rate:
        bnij = np.ix_(np.arange(B), np.arange(N), np.arange(T), np.arange(S))
        keep = np.asarray(base.dropout_keep_mask(args.dropout_rng, *bnij, args.dropout_rate))
        w = np.where(keep, w / (1.0 - args.dropout_rate), 0.0)
    return np.einsum("bnts,bsnh->btnh", w, v), lse


@pytest.mark.parametrize("case", GRID, ids=lambda c: c.id)
def test_reference_matches_float64_numpy_written_from_the_contract(case):
    """The MATH backend is every other backend's reference: here it is checked on the whole grid (masks,
    windows, soft cap, lengths, segment ids, dropout, GQA) against an independent float64 version. Its
    gradients are JAX's autodiff of this forward."""
    args = make_case(case)
    out, lse = jax.jit(base.reference)(upcast(args))  # float32 inputs, same values (jit: eager is op by op)
    want_out, want_lse = _float64_attention(args)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    scale = max(1.0, float(np.abs(want_out).max()))
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=1e-5, atol=2e-6 * scale)
