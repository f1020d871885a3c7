"""What a new user hits (the attention findings): each answered like torch / jax.nn, or by a
clear error naming the argument, the same on every backend.

b: a non-bool ``is_causal``; g: ``scale`` 0 / negative; h: ``dropout_rng`` that is not a PRNG key;
m: ``explain`` with a bad platform / keyword; e: FLASH with an ``attn_mask``; t: ``jax.export`` of the
C++ kernel; f: empty dimensions; n: the verbose log's shapes; o: no other-platform branch traced
outside ``jax.export``; l: length and segment-id errors name the jax.nn API's arguments.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends import attention as A
from pallas_kernels.attention import base, cpp_flash
from tests.attention.attention_base import rand

SB = A.SDPBackend
IMPLS = ("math", "flash", "mem_efficient")


# ---- b: is_causal ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["False", None, 1, "yes", 0.0, jnp.asarray(True)])
def test_is_causal_must_be_a_bool_in_both_apis(bad):
    q = rand((1, 2, 8, 4))
    with pytest.raises(TypeError, match="is_causal"):
        A.scaled_dot_product_attention(q, q, q, is_causal=bad)
    with pytest.raises(TypeError, match="is_causal"):
        A.dot_product_attention(q, q, q, is_causal=bad)
    # numpy bools are bools
    out = A.scaled_dot_product_attention(q, q, q, is_causal=np.bool_(True))
    want = A.scaled_dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_enable_gqa_must_be_a_bool(bad):
    q, kv = rand((1, 4, 8, 4)), rand((1, 2, 8, 4), seed=1)
    with pytest.raises(TypeError, match="enable_gqa"):  # bool("no") would have enabled it
        A.scaled_dot_product_attention(q, kv, kv, enable_gqa=bad)


@pytest.mark.parametrize("hq, hk, hv", [(1, 2, 2), (2, 4, 4), (4, 4, 3), (6, 4, 2)])
def test_enable_gqa_refuses_kv_heads_that_do_not_divide_the_querys(hq, hk, hv):
    """torch: "Number of heads in key and value must divide the number of heads in query", even where
    the heads would broadcast (one query head against two kv heads); without enable_gqa that one
    broadcasts, as torch's math path does."""
    q, k, v = rand((2, hq, 5, 8), 0), rand((2, hk, 7, 8), 1), rand((2, hv, 7, 8), 2)
    with pytest.raises(ValueError, match=f"enable_gqa=True.*query {hq}, key {hk} and value {hv} heads"):
        A.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if hq == 1:
        out = A.scaled_dot_product_attention(q, k, v)
        want = A.scaled_dot_product_attention(jnp.broadcast_to(q, (2, hk, 5, 8)), k, v)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_dropout_p_takes_a_number_or_a_concrete_0d_array():
    """Like ``scale``: a 0-d numpy or jax array is a number; a traced one, another type, NaN or a value
    outside [0, 1] is refused naming the argument."""
    q = rand((1, 2, 8, 4))
    key = jax.random.key(3)
    want = np.asarray(A.scaled_dot_product_attention(q, q, q, dropout_p=0.25, dropout_rng=key))
    for p in (np.float32(0.25), np.array(0.25), jnp.float32(0.25), jnp.asarray(0.25)):
        got = A.scaled_dot_product_attention(q, q, q, dropout_p=p, dropout_rng=key)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=repr(p))
    zeros = A.scaled_dot_product_attention(q, q, q, dropout_p=jnp.asarray(1.0))
    np.testing.assert_array_equal(np.asarray(zeros), 0)  # every weight dropped: torch's zeros
    with pytest.raises(TypeError, match="dropout_p.*traced"):
        jax.jit(lambda p: A.scaled_dot_product_attention(q, q, q, dropout_p=p, dropout_rng=key))(0.25)
    for bad in ("0.1", None, [0.1], np.zeros(2), 1j):
        with pytest.raises(TypeError, match="dropout_p"):
            A.scaled_dot_product_attention(q, q, q, dropout_p=bad, dropout_rng=key)
    for bad in (-0.1, 1.5, float("nan"), jnp.asarray(2.0)):
        with pytest.raises(ValueError, match="dropout_p"):
            A.scaled_dot_product_attention(q, q, q, dropout_p=bad, dropout_rng=key)


def test_masks_and_float64_under_x64():
    """Under jax_enable_x64: the blockwise XLA code with a mask (EFFICIENT, and the default path with
    dropout) runs (its tile offsets were int64 next to int32 loop indices); float64 inputs run on MATH
    at float64 precision (the kernels compute in float32), and a forced EFFICIENT says so."""
    with jax.enable_x64(True):
        q = rand((1, 2, 9, 4))
        mask = jnp.asarray(np.random.default_rng(0).random((9, 9)) > 0.3).at[:, 0].set(True)
        with A.sdpa_kernel(A.SDPBackend.EFFICIENT_ATTENTION):
            got = A.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            bias64 = jnp.where(mask, 0.0, -1e9)  # float64 under x64, with float32 inputs: still runs
            assert bias64.dtype == jnp.float64
            np.testing.assert_allclose(
                np.asarray(A.scaled_dot_product_attention(q, q, q, attn_mask=bias64)),
                np.asarray(got),
                atol=1e-6,
            )
            with pytest.raises(RuntimeError, match="float64 inputs run on MATH"):
                A.scaled_dot_product_attention(*[q.astype(jnp.float64)] * 3)
        with A.sdpa_kernel(A.SDPBackend.MATH):
            want = A.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
        out = A.scaled_dot_product_attention(
            q, q, q, attn_mask=mask, dropout_p=0.1, dropout_rng=jax.random.key(0)
        )
        assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
        q64 = q.astype(jnp.float64) + 1e-9 * rand((1, 2, 9, 4), seed=2).astype(jnp.float64)
        got64 = jax.jit(lambda q: A.scaled_dot_product_attention(q, q, q, is_causal=True))(q64)
        qn = np.asarray(q64)[0]  # float64 numpy reference
        s = np.einsum("hld,hsd->hls", qn, qn) / 2.0 + np.triu(np.full((9, 9), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("hls,hsd->hld", p / p.sum(-1, keepdims=True), qn)
        assert got64.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got64)[0], ref, atol=1e-12, rtol=1e-12)


# ---- g: scale ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [0.0, -0.4, 3])
def test_any_finite_scale_is_accepted_like_torch(impl, scale):
    q, k, v = rand((2, 11, 2, 8), 1), rand((2, 13, 2, 8), 2), rand((2, 13, 2, 8), 3)
    f = lambda q, k, v: A.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=True,  # noqa: E731
        implementation=impl,
    )
    out, vjp = jax.vjp(f, q, k, v)
    args = base.make_args(q, k, v, scale=scale, is_causal=True)
    ref, vjp_ref = jax.vjp(lambda q, k, v: base.reference(args.replace(q=q, k=k, v=v))[0], q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-5)
    ct = rand(out.shape, 4)
    for g, r in zip(vjp(ct), vjp_ref(ct)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5)
    if scale == 0.0:  # uniform weights over the causal keys: a running mean of V
        cum = np.cumsum(np.asarray(v), axis=1)[:, :11] / np.arange(1, 12)[None, :, None, None]
        np.testing.assert_allclose(np.asarray(out), cum, atol=3e-5)
    t = A.scaled_dot_product_attention(
        q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), scale=scale, is_causal=True
    )
    np.testing.assert_allclose(np.asarray(t.swapaxes(1, 2)), np.asarray(ref), atol=3e-5)


@pytest.mark.parametrize(
    "bad, err",
    [(float("nan"), ValueError), (float("inf"), ValueError), ("0.5", TypeError), (True, TypeError)],
)
def test_non_finite_or_non_number_scale_is_refused(bad, err):
    q = rand((1, 4, 1, 8))
    with pytest.raises(err, match="scale"):
        A.dot_product_attention(q, q, q, scale=bad)


# ---- h: dropout_rng ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        0,
        "key",
        jnp.asarray([0.3, 0.7]),
        jnp.asarray([1, 2], jnp.int32),
        jnp.arange(6, dtype=jnp.uint32),
        jax.random.split(jax.random.key(0)),
    ],
)
def test_dropout_rng_must_be_one_prng_key(bad):
    q = rand((1, 8, 2, 4))
    for call in (
        lambda: A.dot_product_attention(q, q, q, dropout_rate=0.2, dropout_rng=bad),
        lambda: A.scaled_dot_product_attention(q, q, q, dropout_p=0.2, dropout_rng=bad),
    ):
        with pytest.raises(TypeError, match="dropout_rng must be a PRNG key|dropout_rng. must be"):
            call()


def test_typed_and_legacy_keys_both_work_and_agree():
    """jax.random and flax take both forms; the legacy uint32[2] key is the typed key's data."""
    q = rand((1, 16, 2, 8))
    typed = A.dot_product_attention(q, q, q, dropout_rate=0.3, dropout_rng=jax.random.key(5))
    legacy = A.dot_product_attention(q, q, q, dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(5))
    np.testing.assert_array_equal(np.asarray(typed), np.asarray(legacy))
    other = A.dot_product_attention(q, q, q, dropout_rate=0.3, dropout_rng=jax.random.key(6))
    assert float(jnp.abs(other - typed).max()) > 0.1


# ---- l: lengths and segment ids --------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_shape, kv_shape, kwargs, err, name",
    [
        (
            (2, 8, 2, 4),
            (2, 8, 2, 4),
            dict(query_seq_lengths=np.array([1, 2, 3])),
            ValueError,
            "query_seq_lengths",
        ),
        (
            (2, 8, 2, 4),
            (2, 6, 2, 4),
            dict(key_value_seq_lengths=np.array([1.0, 2.0])),
            TypeError,
            "key_value_seq_lengths",
        ),
        ((8, 2, 4), (8, 2, 4), dict(query_seq_lengths=np.array([1, 2])), ValueError, "query_seq_lengths"),
        (
            (8, 2, 4),
            (6, 2, 4),
            dict(key_value_seq_lengths=np.array([[1, 2]])),
            ValueError,
            "key_value_seq_lengths",
        ),
        ((2, 8, 2, 4), (2, 6, 2, 4), dict(segment_ids=np.zeros((2, 8), int)), ValueError, "segment_ids"),
        ((2, 8, 2, 4), (2, 8, 2, 4), dict(segment_ids=np.zeros((2, 7), int)), ValueError, "segment_ids"),
        (
            (2, 8, 2, 4),
            (2, 6, 2, 4),
            dict(segment_ids=(np.zeros((2, 8), int),) * 2),
            ValueError,
            r"segment_ids\[1\]",
        ),
    ],
)
def test_length_and_segment_errors_name_the_callers_argument(q_shape, kv_shape, kwargs, err, name):
    """The jax.nn API's errors name its own arguments (``query_seq_lengths``, ``segment_ids``), not the
    kernels' (``q_seq_lengths``, ``kv_segment_ids``); a wrong length shape of unbatched inputs is a
    ValueError, not a reshape error."""
    q, kv = rand(q_shape), rand(kv_shape, seed=1)
    with pytest.raises(err, match=rf"`{name}`") as info:
        A.dot_product_attention(q, kv, kv, **kwargs)
    assert "q_seq" not in str(info.value) and "kv_seq" not in str(info.value)
    assert "q_segment_ids`" not in str(info.value) and "kv_segment_ids`" not in str(info.value)


def test_unbatched_lengths_take_a_scalar_or_one_value():
    q, kv = rand((8, 2, 4)), rand((6, 2, 4), seed=1)
    want = A.dot_product_attention(q[None], kv[None], kv[None], key_value_seq_lengths=jnp.asarray([3]))[0]
    ref = jax.nn.dot_product_attention(q, kv, kv, key_value_seq_lengths=jnp.asarray([3]))
    np.testing.assert_allclose(np.asarray(want), np.asarray(ref), rtol=1e-5, atol=1e-6)
    for lengths in (3, jnp.asarray(3), jnp.asarray([3])):
        got = A.dot_product_attention(q, kv, kv, key_value_seq_lengths=lengths)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- m: explain --------------------------------------------------------------------------------------


def test_explain_refuses_unknown_platforms_and_keywords():
    q = jax.ShapeDtypeStruct((1, 16, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"platform.*\['cpu', 'cuda', 'gpu', 'rocm', 'tpu'\]"):
        A.explain(q, q, q, platform="bogus")
    with pytest.raises(TypeError, match="is_casual.*is_causal"):
        A.explain(q, q, q, is_casual=True)
    with pytest.raises(TypeError, match="attn_mask.*keywords of dot_product_attention"):
        A.explain(q, q, q, attn_mask=None)  # a torch keyword on the jax.nn API
    assert A.explain(q, q, q, api="sdpa", attn_mask=None, is_causal=True).chosen is not None
    assert A.explain(q, q, q, platform="TPU").platform == "tpu"


# ---- e: FLASH with a mask ------------------------------------------------------------------------------


def test_flash_with_an_attn_mask_says_why_and_the_way_out():
    q = rand((1, 2, 8, 4))
    mask = jnp.tril(jnp.ones((8, 8), bool))
    causal = A.scaled_dot_product_attention(q, q, q, is_causal=True)
    # On CPU the C++ flash kernel takes a mask (as torch's CPU flash does); the blockwise XLA one
    # (every other platform, or flash_cpu_kernel="xla") refuses it and names the way out.
    with A.sdpa_kernel([SB.FLASH_ATTENTION]):
        if cpp_flash.available():  # optional (CI builds it)
            out = A.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            np.testing.assert_allclose(np.asarray(out), np.asarray(causal), atol=3e-5)
        else:  # refused, and the message says why the C++ kernel cannot take it
            with pytest.raises(A.NoAvailableBackendError, match="cpp_flash: the C\\+\\+ flash kernel"):
                A.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with A.sdpa_kernel([SB.FLASH_ATTENTION]), jb.with_backends(flash_cpu_kernel="xla"):
        with pytest.raises(
            A.NoAvailableBackendError, match="no arbitrary boolean attn_mask yet.*EFFICIENT_ATTENTION"
        ):
            A.scaled_dot_product_attention(q, q, q, attn_mask=jnp.ones((8, 8), bool))
    with A.sdpa_kernel([SB.FLASH_ATTENTION, SB.EFFICIENT_ATTENTION]):  # the way out it names
        with jb.with_backends(flash_cpu_kernel="xla"):
            out = A.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(causal), atol=3e-5)


# ---- t: jax.export of the C++ kernel --------------------------------------------------------------------


def test_default_export_error_names_the_portable_flag():

    if not cpp_flash.available():
        pytest.skip("the C++ kernel is not built here")
    q = rand((1, 32, 2, 16))
    f = jax.jit(lambda q: A.dot_product_attention(q, q, q, is_causal=True))
    with pytest.raises(ValueError, match=r"flash_cpu_kernel=xla"):
        jax.export.export(f, platforms=["cpu"])(q)
    with jb.with_backends(flash_cpu_kernel="xla"):  # the way out: portable, and the same numbers
        exp = jax.export.export(
            jax.jit(lambda q: A.dot_product_attention(q, q, q, is_causal=True)), platforms=["cpu"]
        )(q)
    np.testing.assert_allclose(np.asarray(exp.call(q)), np.asarray(f(q)), atol=2e-5)


# ---- f: empty dimensions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "B, T, S, H, Hv",
    [(0, 8, 8, 4, 4), (2, 0, 8, 4, 4), (2, 8, 0, 4, 3), (2, 8, 8, 0, 3), (2, 8, 8, 4, 0), (2, 7, 9, 0, 0)],
)
def test_empty_dimensions_give_torchs_result_on_every_backend(impl, B, T, S, H, Hv):
    q, k, v = rand((B, T, 2, H), 1), rand((B, S, 2, H), 2), rand((B, S, 2, Hv), 3)
    for causal in (False, True):
        f = lambda q, k, v: A.dot_product_attention(
            q,
            k,
            v,
            is_causal=causal,  # noqa: E731
            implementation=impl,
        )
        out, vjp = jax.vjp(f, q, k, v)
        assert out.shape == (B, T, 2, Hv) and out.dtype == q.dtype
        if S == 0:  # an empty sum (torch and jax.nn: 0)
            want = np.zeros(out.shape)
        elif H == 0:  # every logit is the empty sum 0: uniform weights (torch), mean of the seen keys
            n = np.minimum(np.arange(1, T + 1), S) if causal else np.full(T, S)
            cum = np.cumsum(np.asarray(v, np.float64), axis=1)
            want = np.stack([cum[:, c - 1] for c in n], axis=1) / n[None, :, None, None]
        else:
            want = np.asarray(base.reference(base.make_args(q, k, v, is_causal=causal))[0])
        np.testing.assert_allclose(np.asarray(out), want, atol=3e-5)
        gq, gk, gv = vjp(jnp.ones_like(out))
        assert gq.shape == q.shape and gk.shape == k.shape and gv.shape == v.shape
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in (gq, gk, gv))
    # the torch API too (layout (B, heads, L, E))
    t = A.scaled_dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2))
    assert t.shape == (B, 2, T, Hv)


# ---- n: verbose logs the caller's shapes --------------------------------------------------------------------


def test_verbose_logs_the_callers_shapes(caplog):
    q = rand((2, 4, 10, 8))  # torch layout (B, heads, L, E)
    k = rand((2, 4, 12, 8))
    with caplog.at_level(logging.INFO, logger="jbackends"), jb.verbose(1):
        jax.jit(A.scaled_dot_product_attention)(q, k, k)
        jax.jit(A.dot_product_attention)(q[0], q[0], q[0])  # jax.nn's unbatched [T, N, H]
    text = caplog.text
    assert "2x4x10x8,2x4x12x8,2x4x12x8" in text
    assert "2x10x4x8" not in text  # not the internal BTNH layout
    assert "4x10x8,4x10x8,4x10x8" in text


# ---- o: one platform's branch outside jax.export ---------------------------------------------------------------


def test_plain_calls_trace_only_their_platform_and_export_traces_both(monkeypatch):
    from jbackends._src import attention_dispatch as D

    seen = []
    real = D.decide
    monkeypatch.setattr(
        D, "decide", lambda args, flags, p, **kw: seen.append(p) or real(args, flags, p, **kw)
    )
    q = rand((1, 16, 2, 8))
    jax.jit(lambda q: A.dot_product_attention(q, q, q, is_causal=True)).lower(q)
    assert seen == ["cpu"]
    seen.clear()
    with jb.with_backends(flash_cpu_kernel="xla"):
        jax.export.export(
            jax.jit(lambda q: A.dot_product_attention(q, q, q, is_causal=True)), platforms=["cpu"]
        )(q)
    assert seen == ["cpu", "cuda"]  # the export's platforms are not known at trace time
    seen.clear()
    A.dot_product_attention(q, q, q, platforms=("cpu", "cuda"))
    assert seen == ["cpu", "cuda"]


def test_platforms_are_checked_like_explains_platform():
    """A misspelt lowering platform raised nothing (or Pallas' "Only interpret mode" error) before."""
    q = rand((1, 8, 2, 16))
    for fn in (A.dot_product_attention, A.scaled_dot_product_attention):
        for bad, what in ((["cdua"], "'cdua' unknown"), (("cpu", "tpuu"), "'tpuu' unknown"), ([], "(empty)")):
            with pytest.raises(
                ValueError, match=r"^`platforms` must name lowering platforms .*" + re.escape(what)
            ):
                fn(q, q, q, platforms=bad)
        with pytest.raises(TypeError, match="^`platforms` must be a sequence"):
            fn(q, q, q, platforms=3)
    want = A.dot_product_attention(q, q, q)
    for ok in ("cpu", ("CPU",), ["cpu", "cuda"]):
        np.testing.assert_allclose(A.dot_product_attention(q, q, q, platforms=ok), want, rtol=1e-6, atol=1e-6)


def test_shape_polymorphic_export_runs_math_like_jax_nn():
    """Symbolic batch and lengths (``jax.export.symbolic_shape``): the kernels' shape checks cannot
    decide, so they are refused with a reason and MATH traces the call (it raised
    InconclusiveDimensionOperation before, in both APIs); the artifact matches jax.nn at any size,
    forward and gradients."""
    from jax import export

    b, t = export.symbolic_shape("b, t")
    qs, ks = (jax.ShapeDtypeStruct((b, t, n, 16), jnp.float32) for n in (4, 2))

    def f(q, k, v):
        return A.dot_product_attention(q, k, v, is_causal=True)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    grad = lambda fn: jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2))  # noqa: E731
    exp_f = export.export(jax.jit(f), platforms=["cpu"])(qs, ks, ks)
    exp_g = export.export(jax.jit(grad(f)), platforms=["cpu"])(qs, ks, ks)
    exp_t = export.export(
        jax.jit(lambda q: A.scaled_dot_product_attention(q, q, q, is_causal=True)), platforms=["cpu"]
    )(jax.ShapeDtypeStruct((b, 4, t, 16), jnp.float32))
    lens = jax.ShapeDtypeStruct((b,), jnp.int32)
    exp_l = export.export(
        jax.jit(lambda q, n: A.dot_product_attention(q, q, q, key_value_seq_lengths=n)), platforms=["cpu"]
    )(jax.ShapeDtypeStruct((b, 8, 2, 16), jnp.float32), lens)
    for B, T in ((1, 5), (3, 17)):
        q, k, v = rand((B, T, 4, 16), 1), rand((B, T, 2, 16), 2), rand((B, T, 2, 16), 3)
        np.testing.assert_allclose(exp_f.call(q, k, v), ref(q, k, v), rtol=1e-5, atol=1e-5)
        for got, want in zip(exp_g.call(q, k, v), grad(ref)(q, k, v)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        x = jnp.swapaxes(q, 1, 2)
        want = jnp.swapaxes(ref(q, q, q), 1, 2)
        np.testing.assert_allclose(exp_t.call(x), want, rtol=1e-5, atol=1e-5)
    x, n = rand((3, 8, 2, 16), 4), jnp.asarray([8, 3, 5], jnp.int32)
    np.testing.assert_allclose(
        exp_l.call(x, n), jax.nn.dot_product_attention(x, x, x, key_value_seq_lengths=n), rtol=1e-5, atol=1e-5
    )
    assert "jb_flash" not in exp_f.mlir_module()  # MATH: no custom call, nothing to opt in to
    # a local window, and torch's lower-right causal mask built from symbolic sizes
    exp_w = export.export(
        jax.jit(lambda q: A.dot_product_attention(q, q, q, local_window_size=(3, 2))), platforms=["cpu"]
    )(qs)
    (s,) = export.symbolic_shape("s", scope=b.scope)

    def lower_right(q, k):
        return A.scaled_dot_product_attention(q, k, k, attn_mask=A.causal_lower_right(q.shape[2], k.shape[2]))

    exp_c = export.export(jax.jit(lower_right), platforms=["cpu"])(
        jax.ShapeDtypeStruct((b, 2, t, 16), jnp.float32), jax.ShapeDtypeStruct((b, 2, s, 16), jnp.float32)
    )
    x, y = rand((2, 11, 4, 16), 5), rand((2, 2, 9, 16), 6)
    want = jax.nn.dot_product_attention(x, x, x, local_window_size=(3, 2))
    np.testing.assert_allclose(exp_w.call(x), want, rtol=1e-5, atol=1e-5)
    x = jnp.swapaxes(x[:, :5, :2], 1, 2)
    np.testing.assert_allclose(exp_c.call(x, y), lower_right(x, y), rtol=1e-5, atol=1e-5)
