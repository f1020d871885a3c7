"""Pallas Triton attention kernels (flash, mem_efficient, decode) vs the reference, in interpret mode.

There is no GPU in CI: every kernel runs with ``interpret=True`` on CPU. Interpret mode is slow, so
the grid is shrunk (tiny ragged shapes, blocks of 16 so that every case spans several ragged
blocks) but complete in features: causal top-left / lower-right, window, softcap, lengths (with
empty rows and empty batches), segment ids, GQA / MQA, dropout, head dims 20..256 (padded), f32 /
bf16 / f16, bias / mask tiles with every broadcast pattern and the bias gradient (jitted; the
shared base in test_pallas_base.py adds eager runs).
Forward outputs, LSE and ``jax.vjp`` gradients w.r.t. q, k, v (and bias) are compared.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import base, triton_decode, triton_flash, triton_flash_vjp, triton_mem_efficient
from tests.attention.attention_base import rand, seeds

CFG = triton_flash.Config(block_q=16, block_k=16, num_warps=4, num_stages=2)
BWD = triton_flash_vjp.Config(block_q=16, block_k=16, num_warps=4, num_stages=2)
DEC = triton_decode.Config(block_k=16, num_splits=3)

# (forward atol, gradient tolerance relative to the largest reference gradient)
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (3e-2, 3e-2), jnp.float16: (4e-3, 4e-3)}

IMPLS = {
    "flash": functools.partial(triton_flash.attention, config=CFG, bwd_config=BWD, interpret=True),
    "mem_efficient": functools.partial(
        triton_mem_efficient.attention, config=CFG, bwd_config=BWD, interpret=True
    ),
    "decode": functools.partial(triton_decode.attention, config=DEC, bwd_config=BWD, interpret=True),
}


def make(B, T, S, N, K, H, Hv=None, dtype=jnp.float32, seed=0, **kw):
    Hv = H if Hv is None else Hv
    kq, kk, kv = seeds(seed, 3)
    q, k, v = rand((B, T, N, H), kq, dtype), rand((B, S, K, H), kk, dtype), rand((B, S, K, Hv), kv, dtype)
    return base.make_args(q, k, v, **kw)


def _out_and_grads(impl, args, with_grads, q, k, v, bias):
    """``(out, lse)`` and, via one ``jax.vjp``, the gradients of a fixed random projection of both."""

    def f(q, k, v, bias):
        return impl(args.replace(q=q, k=k, v=v, bias=bias))

    if not with_grads:
        return f(q, k, v, bias), None
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape).astype(out.dtype)
    wl = jnp.sin(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape)
    wl = jnp.where(jnp.isfinite(lse), wl, 0.0)  # no lse cotangent on fully masked rows
    return (out, lse), vjp((w, wl))


def check(name, args, *, grads=True, jit=True):
    """Runs backend ``name`` on ``args`` and compares out, lse and dq/dk/dv(/dbias) to the reference."""
    impl = IMPLS[name]
    atol, gtol = TOL[args.dtype.type]
    run = functools.partial(_out_and_grads, impl, args, grads)
    run = jax.jit(run) if jit else run
    (out, lse), got = run(args.q, args.k, args.v, args.bias)
    (ref_out, ref_lse), want = jax.jit(functools.partial(_out_and_grads, base.reference, args, grads))(
        args.q, args.k, args.v, args.bias
    )
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=atol, rtol=atol
    )
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=atol, rtol=atol)
    if not grads:
        return out, lse, None
    got, want = got[: 4 if args.bias is not None else 3], want[: 4 if args.bias is not None else 3]
    for name_, a, b in zip("q k v bias".split(), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name_
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name_
        scale = max(np.abs(b).max(), 1e-3)
        np.testing.assert_allclose(a / scale, b / scale, atol=gtol, rtol=0, err_msg=f"d{name_}")
    return out, lse, got


# ---------------------------------------------------------------------------------------------
# flash
# ---------------------------------------------------------------------------------------------

FLASH_CASES = {
    "plain_gqa2_hv24": dict(shape=(2, 23, 30, 4, 2, 20, 24)),
    "causal_top_left_segments_t_gt_s": dict(
        shape=(2, 30, 23, 2, 2, 32),
        is_causal=True,
        q_segment_ids=np.repeat([[0, 1, 2], [0, 0, 1]], 10, axis=1),
        kv_segment_ids=np.array([[0] * 9 + [1] * 9 + [2] * 5, [0] * 12 + [1] * 11]),
    ),
    "causal_lower_right_mqa_lengths": dict(
        shape=(3, 17, 40, 4, 1, 32),
        is_causal=True,
        diag_offset=23,
        q_seq_lengths=np.array([17, 5, 0]),
        kv_seq_lengths=np.array([40, 0, 29]),
    ),
    "window_offset_softcap_bf16": dict(
        shape=(1, 19, 45, 4, 2, 64), window=(7, 2), diag_offset=26, logits_soft_cap=3.0, dtype=jnp.bfloat16
    ),
    "window_causal_hd80_f16_gqa4": dict(
        shape=(1, 37, 37, 4, 1, 80), window=(5, 3), is_causal=True, dtype=jnp.float16
    ),
    "dropout_causal_lower_right": dict(
        shape=(2, 20, 35, 4, 2, 16), dropout_rate=0.6, is_causal=True, diag_offset=15
    ),
    "hd256": dict(shape=(1, 17, 19, 1, 1, 256)),
    "single_query": dict(shape=(2, 1, 50, 2, 1, 32), is_causal=True, diag_offset=49),
}


def _build(case):
    case = dict(case)
    shape = case.pop("shape")
    dtype = case.pop("dtype", jnp.float32)
    if case.get("dropout_rate"):
        case["dropout_rng"] = jax.random.key(7)
    for key in ("q_seq_lengths", "kv_seq_lengths", "q_segment_ids", "kv_segment_ids"):
        if key in case:
            case[key] = jnp.asarray(case[key], jnp.int32)
    return make(*shape, dtype=dtype, **case)


# Segment ids, T > S eager, determinism and fully masked rows also run in test_pallas_base.py
# (the shared base); dropout's forward is checked below.
@pytest.mark.parametrize("case", [c for c in FLASH_CASES if c != "dropout_causal_lower_right"])
def test_flash(case):
    check("flash", _build(FLASH_CASES[case]))


def test_dropout_matches_reference_keep_mask_and_differs_by_key():
    args = _build(FLASH_CASES["dropout_causal_lower_right"])
    out_a, _, _ = check("flash", args, grads=False)
    out_b, _ = jax.jit(IMPLS["flash"])(args.replace(dropout_rng=jax.random.key(8)))
    assert not np.allclose(np.asarray(out_a), np.asarray(out_b))


# ---------------------------------------------------------------------------------------------
# mem_efficient: bias / mask tiles and the bias gradient
# ---------------------------------------------------------------------------------------------


def _bias(shape, seed=1, dtype=jnp.float32):
    return rand(shape, seed, dtype)


MEM_CASES = {
    "bias_full": dict(shape=(2, 23, 30, 4, 2, 16), bias=(2, 4, 23, 30)),
    "bias_shared_causal": dict(shape=(2, 21, 21, 2, 1, 16), bias=(1, 1, 21, 21), is_causal=True),
    "bias_key_row_key_padding_mask": dict(
        shape=(2, 19, 37, 2, 2, 16), bias=(2, 1, 1, 37), mask=(2, 1, 1, 37)
    ),
    "bias_query_col": dict(shape=(1, 33, 18, 4, 2, 16), bias=(1, 4, 33, 1)),
    "bias_scalar_mask_window": dict(
        shape=(2, 26, 31, 2, 1, 16), bias=(1, 1, 1, 1), mask=(2, 1, 26, 31), window=(9, 9)
    ),
    "everything_bf16": dict(
        shape=(2, 22, 29, 4, 2, 32),
        bias=(1, 4, 22, 29),
        mask=(2, 1, 22, 29),
        dropout_rate=0.2,
        logits_soft_cap=5.0,
        is_causal=True,
        diag_offset=7,
        dtype=jnp.bfloat16,
    ),
}


def _build_mem(case):
    case = dict(case)
    dtype = case.get("dtype", jnp.float32)
    if "bias" in case:
        case["bias"] = _bias(case["bias"], dtype=dtype)
    if "mask" in case:
        m = jax.random.bernoulli(jax.random.key(2), 0.7, case["mask"])
        case["mask"] = m.at[..., 0].set(True) if case["mask"][-1] != 1 else m
    return _build(case)


@pytest.mark.parametrize("case", list(MEM_CASES))
def test_mem_efficient(case):
    check("mem_efficient", _build_mem(MEM_CASES[case]))


def test_mem_efficient_minus_inf_bias_rows_and_no_bias_grad():
    args = _build_mem(MEM_CASES["bias_full"])
    args = args.replace(bias=args.bias.at[:, :, 3].set(-jnp.inf))  # query row 3 masked by the bias
    impl = IMPLS["mem_efficient"]

    @jax.jit
    def run(q, bias):
        def f(q):  # differentiates q only: the bias gradient is skipped (symbolic zeros)
            out, lse = impl(args.replace(q=q, bias=bias))
            return (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum(), (out, lse)

        return jax.grad(f, has_aux=True)(q)

    dq, (out, lse) = run(args.q, args.bias)
    assert np.all(np.asarray(out)[:, 3] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, 3]))
    assert np.all(np.asarray(dq)[:, 3] == 0)
    ref_out, _ = base.reference(args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)


# ---------------------------------------------------------------------------------------------
# decode: split-K for short queries
# ---------------------------------------------------------------------------------------------

DECODE_CASES = {
    "t1_gqa4": dict(shape=(2, 1, 70, 4, 1, 32)),
    "t5_causal_lower_right_lengths": dict(
        shape=(2, 5, 70, 4, 2, 16), is_causal=True, diag_offset=65, kv_seq_lengths=np.array([70, 9])
    ),
    "t3_window_softcap_segments": dict(
        shape=(1, 3, 66, 2, 2, 16),
        is_causal=True,
        diag_offset=63,
        window=(20, 0),
        logits_soft_cap=4.0,
        q_segment_ids=np.array([[0, 1, 1]]),
        kv_segment_ids=np.array([[0] * 40 + [1] * 26]),
    ),
    "t16_dropout_bf16": dict(shape=(1, 16, 40, 2, 1, 48), dropout_rate=0.25, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode(case):
    check("decode", _build(DECODE_CASES[case]))


@pytest.mark.parametrize("splits", [1, 5])
def test_decode_split_counts_agree(splits):
    args = _build(DECODE_CASES["t1_gqa4"])
    out, lse = triton_decode.forward(
        args, config=triton_decode.Config(block_k=16, num_splits=splits), interpret=True
    )
    ref_out, ref_lse = base.reference(args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5)
