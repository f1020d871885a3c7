"""`jb.dot_product_attention` as an exact drop-in for `jax.nn.dot_product_attention`.

Every backend, through the public jax.nn-shaped API: MATH, FLASH (the C++ kernel and the blockwise
XLA code), EFFICIENT (blockwise XLA), the Pallas Triton kernels in interpret mode and the cuDNN
bridge (both routed in for CPU by swapping the registry entry, so the whole API path runs;
the bridge's jax.nn cuDNN call is faked with jax.nn's XLA path plus garbage in the padded rows).

The three differences the issue found, each with its repro: (1) the LSE residual comes back in the
input dtype and a vjp with such a cotangent works; (2) the residual has jax.nn's zero gradient
(`residual_gradient=True` gives the true one); (3) fully masked query rows give jax.nn's answer
(mean of V, with its gradients, and jax.nn's residual) by default, 0 with `fully_masked_rows="zero"`,
and always 0 through the torch API. Then the checks of jax's own attention tests (GQA with and
without vmap and an LSE cotangent, every mask mode with bias gradients, float64 under debug_infs,
the bias gradient under vmap, a window without a mask), written for every backend here.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends import attention as A
from jbackends._src import attention_dispatch as D
from jbackends._src import sdpa_registry as R
from jbackends._src.dispatch import Implementation
from pallas_kernels.attention import (
    base,
    cpp_flash,
    cudnn,
    triton_flash,
    triton_flash_vjp,
    triton_mem_efficient,
)
from tests.attention.attention_base import normal, rand, seeds, vjp_of

SB = A.SDPBackend
LARGE_NEG = float(np.asarray(-0.7 * np.finfo(np.float32).max, np.float32))


# ---- routing every backend through the public API on CPU ------------------------------------------

_CFG = triton_flash.Config(block_q=16, block_k=16)
_BWD = triton_flash_vjp.Config(block_q=16, block_k=16)


def _shim(name, unsupported, attention):
    """A CPU implementation entry for the registry that runs ``attention`` (a GPU kernel interpreted,
    or the cuDNN bridge over a fake)."""
    return Implementation(
        name, "test shim", ("cpu",), lambda a, p, device: unsupported(a, p), lambda a, **o: attention(a)
    )


def _fake_cudnn_jaxnn(real):
    """jax.nn's cuDNN call faked on CPU: the XLA path, with garbage where cuDNN's padded rows are."""

    def fake(
        q,
        k,
        v,
        bias=None,
        mask=None,
        *,
        implementation=None,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        return_residual=False,
        **kw,
    ):
        assert implementation == "cudnn" and return_residual
        out, lse = real(
            q,
            k,
            v,
            bias,
            mask,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            return_residual=True,
            **kw,
        )
        T = q.shape[1]
        if query_seq_lengths is not None:
            pad = jnp.arange(T)[None, :] >= query_seq_lengths[:, None]
            out = jnp.where(pad[:, :, None, None], jnp.asarray(7.0, out.dtype), out)
            lse = jnp.where(pad[:, :, None], jnp.asarray(3.0, lse.dtype), lse)
        return out, lse

    return fake


@contextlib.contextmanager
def backend(name):
    """A scope in which ``jb.dot_product_attention`` runs backend ``name`` on CPU."""
    mp = pytest.MonkeyPatch()
    try:
        if name == "math":
            scope = A.sdpa_kernel(SB.MATH)
        elif name == "flash_cpp":
            if not cpp_flash.available():  # optional: no compiler at install time, or JBACKENDS_NO_CPP
                pytest.skip("the C++ flash kernel is not built or not loaded here")
            scope = jb.with_backends(
                flash=True, mem_efficient=False, math=False, cudnn=False, flash_cpu_kernel="cpp"
            )
        elif name == "flash_xla":
            scope = jb.with_backends(
                flash=True, mem_efficient=False, math=False, cudnn=False, flash_cpu_kernel="xla"
            )
        elif name == "efficient":
            scope = A.sdpa_kernel(SB.EFFICIENT_ATTENTION)
        elif name in ("pallas_flash", "pallas_efficient"):
            mod = triton_flash if name == "pallas_flash" else triton_mem_efficient
            shim = _shim(
                f"_jb_test_{name}",
                lambda a, p, mod=mod: mod.unsupported(a, "cuda"),
                lambda a, mod=mod, **o: mod.attention(a, config=_CFG, bwd_config=_BWD, interpret=True),
            )
            which = D.FLASH if name == "pallas_flash" else D.EFFICIENT
            mp.setitem(R.IMPLEMENTATIONS, SB(which), {"cpu": (shim,)})
            scope = A.sdpa_kernel(SB(which))
        elif name == "cudnn":
            shim = _shim(
                "_jb_test_cudnn",
                lambda a, p, **kw: cudnn.unsupported(a, "cuda", compute_capability=9.0),
                cudnn.attention,
            )
            mp.setitem(R.IMPLEMENTATIONS, SB.CUDNN_ATTENTION, {"cpu": (shim,)})
            mp.setattr(jax.nn, "dot_product_attention", _fake_cudnn_jaxnn(jax.nn.dot_product_attention))
            scope = A.sdpa_kernel(SB.CUDNN_ATTENTION)
        else:
            raise ValueError(name)
        with scope:
            yield
    finally:
        mp.undo()


CPU_BACKENDS = ["math", "flash_cpp", "flash_xla", "efficient"]
ALL_BACKENDS = CPU_BACKENDS + ["pallas_flash", "pallas_efficient", "cudnn"]
MASK_BACKENDS = ["math", "efficient", "pallas_efficient"]  # the ones that take a bool mask / bias


def jaxnn(*a, **kw):
    return jax.nn.dot_product_attention(*a, **kw)


def _jit_vjp(f, primals, cotangent):
    """:func:`vjp_of` under jit (the eager path has tests of its own)."""
    return vjp_of(f, primals, cotangent)


def _jaxnn_vjp(f, primals, cotangent):
    """:func:`vjp_of` for a jax.nn reference, eager for float16: jax.nn's backward under jit fails on
    CPU there ("The precision 'F16_F16_F32' is not supported by dot_general on CPU", jax 0.10.2 and
    0.12.0.1), where jb's runs; the cuDNN bridge's CPU stand-in here is jax.nn."""
    eager = any(getattr(x, "dtype", None) == jnp.float16 for x in primals)
    return vjp_of(f, primals, cotangent, jit=not eager)


# ---- (1) the residual's dtype ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_residual_in_input_dtype_and_vjp_with_that_cotangent(name, dtype):
    q = normal(0, (1, 16, 2, 8), dtype)  # the repro
    f = lambda q: jb.dot_product_attention(q, q, q, return_residual=True)  # noqa: E731
    with backend(name):
        out, lse = f(q)
        assert lse.dtype == q.dtype and out.dtype == q.dtype
        ct = (jnp.ones_like(out), jnp.ones(lse.shape, q.dtype))
        (out, lse), (g,) = (_jaxnn_vjp if name == "cudnn" else _jit_vjp)(f, (q,), ct)
    (want_out, want_lse), (g_ref,) = _jaxnn_vjp(lambda q: jaxnn(q, q, q, return_residual=True), (q,), ct)
    assert want_lse.dtype == lse.dtype
    np.testing.assert_allclose(np.float32(lse), np.float32(want_lse), atol=2e-2, rtol=1e-2)
    assert g.dtype == g_ref.dtype
    np.testing.assert_allclose(np.float32(g), np.float32(g_ref), atol=3e-2, rtol=3e-2)


def test_residual_dtype_option_gives_the_float32_lse():
    q = rand((1, 16, 2, 8), 1, jnp.bfloat16)
    _, lse = jb.dot_product_attention(q, q, q, return_residual=True, residual_dtype=jnp.float32)
    assert lse.dtype == jnp.float32
    _, ref = base.reference(base.make_args(q.astype(jnp.float32), *(q.astype(jnp.float32),) * 2))
    np.testing.assert_allclose(np.asarray(lse), np.swapaxes(np.asarray(ref), 1, 2), atol=1e-5)


# ---- (2) the residual's gradient --------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_residual_gradient_is_jaxnn_zero_and_true_on_request(name):
    dtype = jnp.bfloat16 if name == "cudnn" else jnp.float32
    q, k = rand((1, 19, 2, 8), 1, dtype), rand((1, 19, 2, 8), 2, dtype)
    w = rand((1, 19, 2), 3)

    def loss(q, k, **kw):
        return (
            jb.dot_product_attention(q, k, k, is_causal=True, return_residual=True, **kw)[1].astype(
                jnp.float32
            )
            * w
        ).sum()

    with backend(name):
        g = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)
        assert all(float(jnp.abs(x).max()) == 0.0 for x in g)  # jax.nn's stop_gradient
        if name == "cudnn":  # cuDNN's statistic has no gradient: a stop_gradient there too
            return
        gt = jax.jit(jax.grad(functools.partial(loss, residual_gradient=True), argnums=(0, 1)))(q, k)
    want = jax.jit(
        jax.grad(
            lambda q, k: (
                jnp.swapaxes(base.reference(base.make_args(q, k, k, is_causal=True))[1], 1, 2) * w
            ).sum(),
            argnums=(0, 1),
        )
    )(q, k)
    assert (
        jax.jit(jax.grad(lambda q: (jaxnn(q, k, k, is_causal=True, return_residual=True)[1] * w).sum()))(
            q
        ).max()
        == 0.0
    )  # what jax.nn does
    for a, b in zip(gt, want):
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=5e-5)


# ---- (3) fully masked rows ----------------------------------------------------------------------------


def _mean_v_rows(out_zero, v, empty_btn, groups):
    """``out_zero`` with rows ``empty_btn [B, T, N]`` replaced by the mean of V (numpy, float64)."""
    vm = np.repeat(np.asarray(v, np.float64).mean(axis=1), groups, axis=1)  # [B, N, Hv]
    return np.where(empty_btn[..., None], vm[:, None], np.asarray(out_zero, np.float64))


@pytest.mark.parametrize("name", CPU_BACKENDS + ["pallas_efficient"])
def test_bool_mask_fully_masked_rows_match_jaxnn_with_grads(name):
    q, k, v = rand((2, 12, 4, 8), 1), rand((2, 17, 2, 8), 2), rand((2, 17, 2, 8), 3)
    mask = np.random.default_rng(4).random((2, 1, 12, 17)) > 0.4
    mask[0, 0, 3] = False
    mask[1, 0, 7:9] = False
    mask = jnp.asarray(mask)
    ct = rand((2, 12, 4, 8), 5)

    def f(impl, q, k, v, **kw):
        out, lse = impl(q, k, v, mask=mask, return_residual=True, **kw)
        return (out * ct).sum(), (out, lse)

    want_g, (want, want_lse) = jax.jit(
        jax.grad(functools.partial(f, jaxnn), argnums=(0, 1, 2), has_aux=True)
    )(q, k, v)
    if name == "flash_xla":  # the blockwise XLA FLASH takes no boolean mask: a clear error
        with backend(name), pytest.raises(A.NoAvailableBackendError, match="boolean attn_mask"):
            jb.dot_product_attention(q, k, v, mask=mask)
        return
    with backend(name):
        got_g, (got, lse) = jax.jit(
            jax.grad(functools.partial(f, jb.dot_product_attention), argnums=(0, 1, 2), has_aux=True)
        )(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=3e-5, rtol=1e-6)
    assert float(lse[0, 3, 0]) == LARGE_NEG == float(want_lse[0, 3, 0])
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_lengths_and_structural_masks_fully_masked_rows_match_jaxnn(name):
    """kv lengths 0, rows beyond the query length (0 in jax.nn too), windows that leave no key."""
    dtype = jnp.bfloat16 if name == "cudnn" else jnp.float32
    q, k, v = rand((3, 16, 4, 8), 1, dtype), rand((3, 16, 2, 8), 2, dtype), rand((3, 16, 2, 8), 3, dtype)
    ql, kl = jnp.asarray([16, 9, 5], jnp.int32), jnp.asarray([0, 11, 16], jnp.int32)
    kw = dict(query_seq_lengths=ql, key_value_seq_lengths=kl)
    if name == "cudnn":
        kw["is_causal"] = True
    ct = rand((3, 16, 4, 8), 5)

    def f(impl, q, k, v):
        out, lse = impl(q, k, v, return_residual=True, **kw)
        return (out.astype(jnp.float32) * ct).sum(), (out, lse)

    want_g, (want, want_lse) = jax.jit(
        jax.grad(functools.partial(f, jaxnn), argnums=(0, 1, 2), has_aux=True)
    )(q, k, v)
    with backend(name):
        got_g, (got, lse) = jax.jit(
            jax.grad(functools.partial(f, jb.dot_product_attention), argnums=(0, 1, 2), has_aux=True)
        )(q, k, v)
    tol = 2e-2 if dtype == jnp.bfloat16 else 3e-5
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=tol, rtol=tol)
    assert np.float32(got[0]).std() > 0.1  # batch 0 has no key: the mean of V, not zeros
    np.testing.assert_array_equal(np.float32(got[1, 9:]), 0.0)  # beyond the query length
    np.testing.assert_allclose(np.float32(lse), np.float32(want_lse), atol=tol, rtol=tol)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol * 3, rtol=tol)


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_extensions_fully_masked_rows_give_mean_of_v(name):
    """Masks jax.nn has no argument for (lower-right causal with T > S, segment ids, a window past
    the keys): the same rule, the mean of V with its gradient 1 / S per key."""
    dtype = jnp.bfloat16 if name == "cudnn" else jnp.float32
    q, k, v = rand((2, 20, 2, 8), 1, dtype), rand((2, 12, 2, 8), 2, dtype), rand((2, 12, 2, 8), 3, dtype)
    seg_q = jnp.asarray(np.repeat([[0, 1, 2, 3]], 5, axis=1).reshape(1, 20).repeat(2, 0), jnp.int32)
    seg_k = jnp.asarray(np.repeat([[0, 1, 3]], 4, axis=1).reshape(1, 12).repeat(2, 0), jnp.int32)
    calls = {
        "lower_right": dict(mask=A.causal_lower_right(20, 12)),
        "window": dict(local_window_size=(2, 0)),
        "segments": dict(segment_ids=(seg_q, seg_k)),
    }
    for what, kw in calls.items():
        args = base.make_args(
            q,
            k,
            v,
            is_causal=what == "lower_right",
            diag_offset=-8 * (what == "lower_right"),
            window=(2, 0) if what == "window" else None,
            q_segment_ids=seg_q if what == "segments" else None,
            kv_segment_ids=seg_k if what == "segments" else None,
        )
        up = args.replace(
            q=args.q.astype(jnp.float32), k=args.k.astype(jnp.float32), v=args.v.astype(jnp.float32)
        )
        ref_zero, ref_lse = jax.jit(base.reference)(up)
        empty = np.swapaxes(np.isneginf(np.asarray(ref_lse)), 1, 2)
        assert empty.any() and not empty.all(), what
        want = _mean_v_rows(ref_zero, up.v, empty, 1)
        with backend(name):
            try:
                f = lambda v: jb.dot_product_attention(q, k, v, **kw)  # noqa: E731
                got, (gv,) = _jit_vjp(f, (v,), jnp.ones((2, 20, 2, 8), dtype))
            except A.NoAvailableBackendError:
                assert name == "cudnn"  # cuDNN takes neither an offset diagonal nor segment ids
                continue
            _, lse = jb.dot_product_attention(q, k, v, return_residual=True, **kw)
        tol = 2e-2 if dtype == jnp.bfloat16 else 3e-5
        np.testing.assert_allclose(np.float32(got), want, atol=tol, rtol=tol, err_msg=what)
        np.testing.assert_array_equal(
            np.float32(lse) == np.float32(jnp.asarray(LARGE_NEG, dtype)), empty, err_msg=what
        )
        # dV: every fully masked row adds 1 / S to each key (the rest is the reference's gradient).
        n_empty = empty.sum(axis=1)  # [B, N] rows without a key, per head (K == N here)
        gv_ref = (
            np.asarray(jax.jit(jax.grad(lambda v: base.reference(up.replace(v=v))[0].sum()))(up.v))
            + (n_empty / 12.0)[:, None, :, None]
        )
        np.testing.assert_allclose(np.float32(gv), gv_ref, atol=tol * 4, rtol=tol, err_msg=what)


@pytest.mark.parametrize("name", CPU_BACKENDS + ["pallas_flash"])
def test_zero_option_and_torch_api_give_zeros(name):
    q, k = rand((1, 20, 2, 8), 1), rand((1, 12, 2, 8), 2)
    kw = dict(mask=A.causal_lower_right(20, 12))
    with backend(name):
        out, lse = jb.dot_product_attention(q, k, k, return_residual=True, fully_masked_rows="zero", **kw)
        g = jax.jit(
            jax.grad(lambda k: jb.dot_product_attention(q, k, k, fully_masked_rows="zero", **kw)[:, :8].sum())
        )(k)
        t = jb.scaled_dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), k.swapaxes(1, 2), attn_mask=A.causal_lower_right(20, 12)
        )
    np.testing.assert_array_equal(np.asarray(out[:, :8]), 0.0)
    assert bool(jnp.all(jnp.isneginf(lse[:, :8])))
    assert float(jnp.abs(g).max()) == 0.0
    np.testing.assert_array_equal(np.asarray(t[:, :, :8]), 0.0)  # torch >= 2.5: 0 (_safe_softmax)
    np.testing.assert_allclose(np.asarray(t.swapaxes(1, 2)), np.asarray(out), atol=3e-5)
    with pytest.raises(ValueError, match="fully_masked_rows"):
        jb.dot_product_attention(q, k, k, fully_masked_rows="nan")


def test_torch_api_fully_masked_bool_rows_are_zero_on_every_backend():
    q = rand((2, 2, 9, 8))
    m = np.ones((2, 1, 9, 9), bool)
    m[1, 0, 4] = False
    for b in (SB.MATH, SB.EFFICIENT_ATTENTION):
        with A.sdpa_kernel(b):
            out = jb.scaled_dot_product_attention(q, q, q, attn_mask=jnp.asarray(m))
        np.testing.assert_array_equal(np.asarray(out[1, :, 4]), 0.0)
        assert float(jnp.abs(out[0]).min()) >= 0 and bool(jnp.all(jnp.isfinite(out)))


def test_bias_only_rows_of_minus_inf_give_jaxnn_nan():
    q = rand((1, 6, 1, 8))
    bias = jnp.zeros((1, 1, 6, 6)).at[0, 0, 2].set(-jnp.inf)
    want = jaxnn(q, q, q, bias=bias)
    for impl in ("math", "mem_efficient"):
        got = jb.dot_product_attention(q, q, q, bias=bias, implementation=impl)
        np.testing.assert_array_equal(np.isnan(np.asarray(got)), np.isnan(np.asarray(want)))
        np.testing.assert_allclose(
            np.asarray(got[:, [0, 1, 3, 4, 5]]), np.asarray(want[:, [0, 1, 3, 4, 5]]), atol=3e-5
        )


def test_flax_causal_mask_equivalence_reaches_us():
    """flax's ``test_causal_mask_equivalence`` shape: a mask with fully masked rows, jax.nn's answer."""
    from flax import nnx

    x = rand((2, 7, 3, 8), 4)
    mask = nnx.make_causal_mask(jnp.ones((2, 7))).astype(bool)
    mask = mask & (jnp.arange(7)[None, None, :, None] >= 2)  # rows 0, 1 fully masked
    want = jaxnn(x, x, x, mask=mask)
    got = jb.dot_product_attention(x, x, x, mask=mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-5)


# ---- the checks of jax's own attention tests, on every backend ---------------------------------------

# Each backend with each dtype; GQA groups and vmap alternate over them (a covering design).
_GQA_CASES = [
    (name, dtype, groups, use_vmap)
    for i, name in enumerate(CPU_BACKENDS)
    for dtype, groups, use_vmap in [
        ("bfloat16", (1, 4)[i % 2], bool(i % 2)),
        ("float16", (4, 1)[i % 2], not i % 2),
    ]
]


@pytest.mark.parametrize("name, dtype, groups, use_vmap", _GQA_CASES)
def test_upstream_gqa_vmap_and_lse_cotangent(name, dtype, groups, use_vmap):
    B, S, T, N, H = 2, 64, 64, 4, 16
    keys = seeds(0, 5)
    Q = normal(keys[0], (B, T, N, H), dtype)
    K = normal(keys[1], (B, S, N // groups, H), dtype)
    V = normal(keys[2], (B, S, N // groups, H), dtype)
    grad = normal(keys[3], (B, T, N, H), dtype)
    lse_grad = normal(keys[4], (B, T, N), dtype)
    K_ref, V_ref = jnp.repeat(K, groups, axis=2), jnp.repeat(V, groups, axis=2)
    ans = functools.partial(jb.dot_product_attention, return_residual=True)
    if use_vmap:
        ans = jax.vmap(ans)
    with backend(name):
        out, (dq, dk, dv) = (_jaxnn_vjp if name == "cudnn" else _jit_vjp)(ans, (Q, K, V), (grad, lse_grad))
    ref, (rq, rk, rv) = _jaxnn_vjp(
        lambda q, k, v: jaxnn(q, k, v, return_residual=True), (Q, K_ref, V_ref), (grad, lse_grad)
    )
    rk = rk.reshape(B, S, N // groups, groups, H).sum(axis=3)
    rv = rv.reshape(B, S, N // groups, groups, H).sum(axis=3)
    for a, b in zip((out[0], out[1], dq, dk, dv), (ref[0], ref[1], rq, rk, rv)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=2e-2, rtol=2e-2)


MASK_MODES = [
    ("bias",),
    ("causal",),
    ("padding",),
    ("custom",),
    ("causal", "padding"),
    ("custom", "padding"),
    ("bias", "causal"),
    ("causal", "sliding_window"),
]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MASK_MODES, ids=["-".join(m) for m in MASK_MODES])
def test_upstream_mask_modes_with_gradients(name, mode):
    B, S, T, N, H = 2, 64, 64, 2, 16
    keys = seeds(0, 5)
    Q, K, V, grad = (normal(kk, (B, T, N, H), jnp.bfloat16) for kk in keys[:4])
    kw = dict(is_causal="causal" in mode)
    bias = mask = None
    if "padding" in mode:
        kw.update(
            query_seq_lengths=jnp.asarray([T // 2, T // 4], jnp.int32),
            key_value_seq_lengths=jnp.asarray([S // 4, S // 2], jnp.int32),
        )
    if "custom" in mode:
        mask = jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None]
    if "bias" in mode:
        bias = normal(keys[4], (1, N, T, S), jnp.bfloat16)
    if "sliding_window" in mode:
        kw["local_window_size"] = (3, 2)
    ref, want = _jaxnn_vjp(lambda q, k, v, b: jaxnn(q, k, v, b, mask, **kw), (Q, K, V, bias), grad)
    takes = name in ("math", "efficient", "flash_cpp") or (bias is None and mask is None)
    if not takes:
        with backend(name), pytest.raises(A.NoAvailableBackendError):
            jb.dot_product_attention(Q, K, V, bias, mask, **kw)
        return
    with backend(name):
        f = lambda q, k, v, b: jb.dot_product_attention(q, k, v, b, mask, **kw)  # noqa: E731
        out, got = _jit_vjp(f, (Q, K, V, bias), grad)
    np.testing.assert_allclose(np.float32(out), np.float32(ref), atol=1e-2, rtol=1e-2)
    for a, b, tol in zip(got, want, (2e-2, 2e-2, 1e-2, 2e-2)):
        if b is None:
            continue
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["math", "efficient"])
def test_upstream_float64_mask_under_debug_infs(name):
    with jax.enable_x64(True):
        T, S, K, N, H = 5, 7, 3, 6, 11
        mask = jnp.arange(S) <= S // 2
        call = functools.partial(
            jb.dot_product_attention,
            jnp.zeros((T, N, H), jnp.float64),
            jnp.zeros((S, K, H), jnp.float64),
            jnp.zeros((S, K, H), jnp.float64),
            mask=mask,
        )
        if name == "efficient":  # it computes in float32: float64 runs on MATH, a forced one says why
            with backend(name), pytest.raises(RuntimeError, match="float64 inputs run on MATH"):
                call()
            name = "math"
        with backend(name), jax.debug_infs(True):
            out = call()
            out.block_until_ready()
        assert out.dtype == jnp.float64 and out.shape == (T, N, H)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_traced_scale_like_jaxnn(name):
    """jax.nn takes a traced ``scale`` (``1 / jnp.sqrt(...)`` under jit, a learned temperature): so does
    jb (folded into the queries), with the same output and the same gradient in the scale."""
    ks = seeds(3, 3)
    q = normal(ks[0], (2, 9, 4, 8))
    k = normal(ks[1], (2, 11, 2, 8))
    v = normal(ks[2], (2, 11, 2, 8))

    def loss(f):
        return lambda t, q: jnp.sum(jnp.sin(f(q, k, v, scale=t, is_causal=True)))

    want = jax.jit(jax.grad(loss(jaxnn), argnums=(0, 1)))(jnp.float32(0.4), q)
    with backend(name):
        got = jax.jit(jax.grad(loss(jb.dot_product_attention), argnums=(0, 1)))(jnp.float32(0.4), q)
        out = jax.jit(lambda q: jb.dot_product_attention(q, k, v, scale=1.0 / jnp.sqrt(q.shape[-1])))(q)
        with pytest.raises(TypeError, match="scale"):
            jax.jit(lambda t: jb.dot_product_attention(q, k, v, scale=t))(jnp.ones(2))
    np.testing.assert_allclose(np.asarray(out), np.asarray(jaxnn(q, k, v)), atol=2e-6, rtol=2e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["math", "flash_cpp", "efficient", "pallas_efficient"])
@pytest.mark.parametrize("bias_dtype", [jnp.float32, jnp.bfloat16])
def test_finfo_min_padding_bias_like_jaxnn(name, bias_dtype):
    """The usual additive padding mask, ``finfo.min`` on the padded keys: a padded query row (every key
    at finfo.min) is the mean of V as in jax.nn, not NaN (finfo.min * log2(e) overflowed to -inf in
    the base-2 kernels, and such a row looked fully masked); a row mixing finfo.min and -inf attends to
    the finfo.min keys only. Gradients where the padded rows' cotangent is 0 (a loss that ignores
    them), as in training."""
    B, T, S, N, H = 2, 37, 29, 2, 16
    ks = seeds(7, 4)
    q = normal(ks[0], (B, T, N, H))
    k = normal(ks[1], (B, S, N, H))
    v = normal(ks[2], (B, S, N, H))
    q_ok = jnp.arange(T)[None, :] < jnp.array([30, T])[:, None]
    k_ok = jnp.arange(S)[None, :] < jnp.array([20, S])[:, None]
    low = jnp.finfo(bias_dtype).min
    bias = jnp.where(q_ok[:, :, None] & k_ok[:, None, :], 0.0, low)[:, None].astype(bias_dtype)
    bias = bias.at[0, 0, 33, :3].set(-jnp.inf)  # a padded row mixing -inf and finfo.min
    ct = jnp.where(q_ok[:, :, None, None], normal(ks[3], (B, T, N, H)), 0.0)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, bias=bias) * ct)

    want = jax.jit(lambda q, k, v: jaxnn(q, k, v, bias=bias))(q, k, v)
    want_g = jax.jit(jax.grad(loss(jaxnn), argnums=(0, 1, 2)))(q, k, v)
    with backend(name):
        got = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, bias=bias))(q, k, v)
        got_g = jax.jit(jax.grad(loss(jb.dot_product_attention), argnums=(0, 1, 2)))(q, k, v)
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    for a, b in zip(got_g, want_g):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)


_GPU_KERNELS_KEEP_LSE = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known limit: the Pallas (GPU) backward still rebuilds P from the float32 LSE alone, as "
    "cuDNN and FlashAttention do (docs/attention.md)",
)


@pytest.mark.parametrize(
    "name", ["flash_cpp", "efficient", pytest.param("pallas_efficient", marks=_GPU_KERNELS_KEEP_LSE)]
)
@pytest.mark.parametrize("low", [-1e9, "finfo.min"])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_padded_rows_gradients_like_jaxnn(name, low, use_vmap):
    """``jnp.where(mask, 0, -1e9)`` padding, and a loss that does not ignore the padded query rows
    (their outputs are the mean of V): the fused kernels' gradients match jax.nn's, dbias included.
    Their backward's ``2^(s - lse)`` lost log(S) in an lse of -1e9 and gave those rows S times the
    gradient. Under vmap the exact-statistics recompute of :mod:`xla_blockwise` runs as a select."""
    B, T, S, N, H = 2, 21, 29, 2, 16
    ks = seeds(9, 4)
    q = normal(ks[0], (B, T, N, H))
    k = normal(ks[1], (B, S, N, H))
    v = normal(ks[2], (B, S, N, H))
    ct = normal(ks[3], (B, T, N, H))
    ok = jnp.arange(T)[None, :] < jnp.array([15, T])[:, None]
    bias = jnp.where(ok[:, None, :, None], 0.0, jnp.finfo(jnp.float32).min if low == "finfo.min" else low)
    bias = jnp.broadcast_to(bias, (B, 1, T, S))

    def loss(f):
        g = lambda q, k, v, b: f(q, k, v, bias=b)  # noqa: E731
        g = jax.vmap(g, in_axes=(0, 0, 0, 0)) if use_vmap else g
        x = (q, k, v, bias)
        x = tuple(a[:, None] for a in x) if use_vmap else x
        return jax.grad(lambda *x: jnp.sum(g(*x).reshape(ct.shape) * ct), argnums=(0, 1, 2, 3))(*x)

    want = jax.jit(lambda: loss(jaxnn))()
    with backend(name):
        got = jax.jit(lambda: loss(jb.dot_product_attention))()
    for a, b, what in zip(got, want, ("dq", "dk", "dv", "dbias")):
        a, b = np.asarray(a).reshape(b.shape), np.asarray(b)
        assert np.isfinite(a).all(), what
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=what)


@pytest.mark.parametrize("name", ["math", "efficient"])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_upstream_bias_gradient(name, use_vmap):
    B, S, N, H = 4, 32, 2, 16
    keys = seeds(0, 2)
    x = normal(keys[0], (B, S, N, H), jnp.bfloat16)
    bias = normal(keys[1], (B, N, S, S), jnp.bfloat16)
    mask = jnp.ones((1, 1, S), jnp.bool_)

    def attn(impl, x, bias, mask):
        return impl(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    ref, ans = functools.partial(attn, jaxnn), functools.partial(attn, jb.dot_product_attention)
    if use_vmap:
        ref, ans = jax.vmap(ref, in_axes=(0, 0, None)), jax.vmap(ans, in_axes=(0, 0, None))
    with backend(name):
        y = jax.jit(ans)(x, bias, mask)
        _, db, _ = jax.jit(lambda x, b, m: jax.vjp(ans, x, b, m)[1](x))(x, bias, mask)
    _, db_ref, _ = jax.jit(lambda x, b, m: jax.vjp(ref, x, b, m)[1](x))(x, bias, mask)
    np.testing.assert_allclose(np.float32(y), np.float32(jax.jit(ref)(x, bias, mask)), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.float32(db), np.float32(db_ref), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_upstream_local_window_without_mask(name):
    q, k, v = rand((2, 64, 2, 16), 1), rand((2, 64, 2, 16), 2), rand((2, 64, 2, 16), 3)
    with backend(name):
        wide = jb.dot_product_attention(q, k, v, local_window_size=(32, 32))
        narrow = jb.dot_product_attention(q, k, v, local_window_size=(1, 1))
    assert not np.allclose(np.asarray(wide), np.asarray(narrow))
    np.testing.assert_allclose(
        np.asarray(narrow), np.asarray(jaxnn(q, k, v, local_window_size=(1, 1))), atol=3e-5
    )


# ---- second order ---------------------------------------------------------------------------------

SECOND_ORDER_CALLS = {
    "causal": dict(is_causal=True),
    "lengths_window": dict(key_value_seq_lengths=jnp.asarray([13, 24]), local_window_size=(5, 3)),
    "softcap_dropout": dict(logits_soft_cap=2.0, dropout_rate=0.3, dropout_rng=jax.random.key(1)),
    "bias_mask": dict(
        bias=rand((1, 4, 20, 24), 5) * 0.3,
        mask=jnp.asarray(np.random.default_rng(6).random((2, 1, 20, 24)) > 0.2),
    ),
}


# cuDNN's LSE has no gradient to test here; MATH is the reference
@pytest.mark.parametrize("name", [b for b in ALL_BACKENDS[:-1] if b != "math"])
@pytest.mark.parametrize("call", list(SECOND_ORDER_CALLS))
def test_grad_of_grad_matches_math_on_every_backend(name, call):
    """Reverse over reverse (Hessian-vector products): the fast backends' backward passes are
    differentiable (their derivative is the reference's), so every backend agrees with MATH."""
    kw = SECOND_ORDER_CALLS[call]
    if "mask" in kw and name not in MASK_BACKENDS:
        pytest.skip("this backend takes no mask / bias")
    if name == "flash_cpp" and "logits_soft_cap" in kw:
        pytest.skip("the C++ kernel has no soft cap / dropout (flash_cpu_kernel='cpp' refuses them)")
    if name.startswith("pallas") and "dropout_rate" in kw:
        kw = {k: v for k, v in kw.items() if not k.startswith("dropout")}
    q, k, v = rand((2, 20, 4, 8), 1), rand((2, 24, 2, 8), 2), rand((2, 24, 2, 8), 3)
    tangents = (rand(q.shape, 7), rand(k.shape, 8), rand(v.shape, 9))

    def loss(q, k, v):
        out, lse = jb.dot_product_attention(
            q, k, v, return_residual=True, residual_gradient=True, residual_dtype=jnp.float32, **kw
        )
        return (jnp.sin(out) ** 2).sum() + 0.1 * lse.sum()

    def hvp(q, k, v):
        g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return sum((a * t).sum() for a, t in zip(g, tangents))

    with backend(name):
        got = jax.jit(jax.grad(hvp, argnums=(0, 1, 2)))(q, k, v)
    with backend("math"):
        want = jax.jit(jax.grad(hvp, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        scale = float(jnp.abs(b).max())
        assert scale > 0
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=2e-5)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(bias=True), dict(query_seq_lengths=True)])
def test_cudnn_second_order_matches_math(kw):
    """The cuDNN bridge (faked on CPU): its gradient is cuDNN's (here jax.nn's), and the derivative of
    that gradient is the reference's, so reverse over reverse (Hessian-vector products) agrees with
    MATH, with a bias and with padded rows too."""
    bf16 = jnp.bfloat16  # cuDNN takes half precision only
    q, k, v = (rand((2, 16, 2, 8), i).astype(bf16) for i in (1, 2, 3))
    tangents = (rand(q.shape, 7).astype(bf16), rand(k.shape, 8).astype(bf16), rand(v.shape, 9).astype(bf16))
    if kw.get("bias"):
        kw = dict(bias=rand((1, 2, 16, 16), 4).astype(bf16))
    if kw.get("query_seq_lengths"):
        kw = dict(query_seq_lengths=jnp.array([16, 11]), key_value_seq_lengths=jnp.array([9, 16]))

    def loss(q, k, v):
        return (jnp.sin(jb.dot_product_attention(q, k, v, **kw).astype(jnp.float32)) ** 2).sum()

    def hvp(q, k, v):
        g = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return sum((a.astype(jnp.float32) * t).sum() for a, t in zip(g, tangents))

    with backend("cudnn"):
        assert jb.attention.explain(q, k, v, **kw).chosen == SB.CUDNN_ATTENTION
        first = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        got = jax.jit(jax.grad(hvp, argnums=(0, 1, 2)))(q, k, v)
    with backend("math"):
        want_first = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.grad(hvp, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(first + got, want_first + want):  # bf16 inputs: compare relative to the largest
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = float(np.abs(b).max())
        assert scale > 0
        np.testing.assert_allclose(a / scale, b / scale, atol=3e-2)
