"""The public SDPA API: flags decide the backend (under jit, on retrace), errors, layouts, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jbackends as jb
from jbackends import attention as A
from pallas_kernels.attention import base, cpp_flash
from tests.attention.attention_base import assert_close, rand, vjp_of

B = A.SDPBackend


@pytest.fixture
def chosen(monkeypatch):
    """Records the backend of every dispatch decision (one per trace)."""
    from jbackends._src import verbose

    log = []
    monkeypatch.setattr(
        verbose, "report_dispatch", lambda op, c, reasons, shapes=(), dtypes=(): log.append(c.split("@")[0])
    )
    return log


def test_sdpbackend_values_match_torch():
    assert {m.name: m.value for m in B} == {
        "ERROR": -1,
        "MATH": 0,
        "FLASH_ATTENTION": 1,
        "EFFICIENT_ATTENTION": 2,
        "CUDNN_ATTENTION": 3,
        "OVERRIDEABLE": 4,
    }


def test_flags_decide_backend_under_jit_and_retrace(chosen):
    q = rand((1, 24, 2, 16))
    f = jax.jit(lambda q: A.dot_product_attention(q, q, q, is_causal=True))
    with A.sdpa_kernel(B.MATH):
        a = f(q)
    with A.sdpa_kernel(B.FLASH_ATTENTION):
        b = f(q)
        f(q)  # cached: no new trace
    with A.sdpa_kernel(B.MATH):
        f(q)  # cached again under MATH
    assert chosen == ["MATH", "FLASH_ATTENTION"]
    assert_close(a, b, 2e-5, "math vs flash")


def test_set_priority_is_honoured_under_jit(chosen):
    q = rand((1, 16, 2, 16))
    f = jax.jit(lambda q: A.dot_product_attention(q, q, q))
    with A.sdpa_kernel([B.MATH, B.FLASH_ATTENTION], set_priority=True):
        f(q)
        assert A.explain(q, q, q).chosen == B.MATH
    with A.sdpa_kernel([B.MATH, B.FLASH_ATTENTION]):
        f(q)
    assert chosen == ["MATH", "FLASH_ATTENTION"]


def test_nested_set_priority_appends_the_priority_in_force_like_torch():
    """torch appends its previous priority order to the listed backends; an outer
    ``set_priority=True`` scope therefore orders the backends an inner one leaves out."""
    with A.sdpa_kernel([B.MATH, B.CUDNN_ATTENTION], set_priority=True):
        assert jb.current_flags().sdpa_priority[:2] == (int(B.MATH), int(B.CUDNN_ATTENTION))
        with A.sdpa_kernel([B.FLASH_ATTENTION], set_priority=True):
            assert jb.current_flags().sdpa_priority == (
                int(B.FLASH_ATTENTION),
                int(B.MATH),
                int(B.CUDNN_ATTENTION),
                int(B.EFFICIENT_ATTENTION),
            )  # torch 2.13: [1, 0, 3, 2, 4] (4: OVERRIDEABLE, which JAX has not)


def test_vjp_fn_keeps_the_forward_backend(chosen):
    q, k = rand((1, 20, 2, 16), 1), rand((1, 20, 2, 16), 2)
    f = lambda q, k: A.dot_product_attention(q, k, k, is_causal=True)  # noqa: E731
    with A.sdpa_kernel(B.FLASH_ATTENTION):
        out, vjp_fn = jax.vjp(f, q, k)
        expected = vjp_fn(jnp.ones_like(out))
    with A.sdpa_kernel(B.MATH):
        got = vjp_fn(jnp.ones_like(out))
    assert chosen == ["FLASH_ATTENTION"]
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_no_enabled_backend_error_names_every_enabled_backend():
    q = rand((1, 8, 2, 16))
    bias = jnp.zeros((1, 2, 8, 8))
    # (the blockwise XLA FLASH: on CPU the C++ kernel takes a bias)
    with A.sdpa_kernel([B.FLASH_ATTENTION, B.CUDNN_ATTENTION]), jb.with_backends(flash_cpu_kernel="xla"):
        with pytest.raises(A.NoAvailableBackendError) as e:
            A.dot_product_attention(q, q, q, bias=bias)
    msg = str(e.value)
    assert "FLASH_ATTENTION: FLASH takes no additive bias" in msg
    assert "CUDNN_ATTENTION: no CUDNN_ATTENTION implementation for platform 'cpu'" in msg
    assert "Disabled by the flags" in msg and "MATH" in msg and "EFFICIENT_ATTENTION" in msg


def test_explain_is_a_value_and_explains_gpu_from_cpu():
    q = jax.ShapeDtypeStruct((2, 1024, 8, 64), jnp.bfloat16)
    e = A.explain(q, q, q, is_causal=True, platform="cuda", compute_capability=9.0)
    assert e.platform == "cuda" and e.chosen == B.CUDNN_ATTENTION  # measured faster there
    assert "measured faster here" in e.reasons[B.FLASH_ATTENTION]
    with jb.with_backends(sdpa_prefer_faster=False):  # the priority order alone
        e = A.explain(q, q, q, is_causal=True, platform="cuda", compute_capability=9.0)
    assert e.chosen == B.FLASH_ATTENTION and e.implementation == "mosaic_flash"  # sm90, bf16
    assert e.reasons[B.CUDNN_ATTENTION] == "lower priority than FLASH_ATTENTION"
    with A.sdpa_kernel(B.CUDNN_ATTENTION):
        e = A.explain(q, q, q, is_causal=True, platform="cuda", compute_capability=9.0)
        assert e.chosen == B.CUDNN_ATTENTION
        e = A.explain(q, q, q, logits_soft_cap=5.0, platform="cuda")
        assert e.chosen is None and "soft cap" in e.reasons[B.CUDNN_ATTENTION]
        assert "disabled" in e.reasons[B.MATH]
        with jb.cudnn.flags(enabled=False):  # torch.backends.cudnn.enabled also rules out cuDNN SDPA
            e = A.explain(q, q, q, is_causal=True, platform="cuda", compute_capability=9.0)
            assert e.chosen is None and "cudnn_enabled=False" in e.reasons[B.CUDNN_ATTENTION]
    e = A.explain(q, q, q, local_window_size=(4, 4))
    assert e.platform == "cpu" and e.chosen == B.FLASH_ATTENTION
    assert "only on NVIDIA GPUs" in e.reasons[B.CUDNN_ATTENTION] or "no CUDNN" in e.reasons[B.CUDNN_ATTENTION]
    assert "FLASH_ATTENTION" in str(e)
    et = A.explain(
        jnp.ones((2, 4, 8, 16)),
        jnp.ones((2, 4, 8, 16)),
        jnp.ones((2, 4, 8, 16)),
        api="sdpa",
        attn_mask=jnp.ones((8, 8), bool),
    )
    if cpp_flash.available():  # the C++ kernel takes it (optional: CI builds it)
        assert et.chosen == B.FLASH_ATTENTION and et.implementation == "cpp_flash"
    else:  # without it the masked call goes to EFFICIENT, and explain says why not FLASH
        assert et.chosen == B.EFFICIENT_ATTENTION and "cpp_flash" in et.reasons[B.FLASH_ATTENTION]
    with jb.with_backends(flash_cpu_kernel="xla"):  # the blockwise XLA FLASH does not
        et = A.explain(
            jnp.ones((2, 4, 8, 16)),
            jnp.ones((2, 4, 8, 16)),
            jnp.ones((2, 4, 8, 16)),
            api="sdpa",
            attn_mask=jnp.ones((8, 8), bool),
        )
    assert et.chosen == B.EFFICIENT_ATTENTION


def test_cudnn_window_bug_does_not_leak():
    """cuDNN is refused for right windows; left windows are passed with is_causal (jax PR 39576)."""
    from pallas_kernels.attention import cudnn

    x = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
    assert any("left windows" in r for r in cudnn.unsupported(base.make_args(x, x, x, window=(4, 2)), "cuda"))
    assert cudnn.unsupported(base.make_args(x, x, x, window=(4, 0)), "cuda", compute_capability=9.0) == []


def test_sdpa_torch_layout_gqa_masks_and_causal_biases():
    q = rand((2, 3, 4, 10, 16), 1)  # extra leading batch dim
    k = rand((2, 3, 2, 13, 16), 2)
    v = rand((2, 3, 2, 13, 8), 3)
    mask = jnp.asarray(np.random.default_rng(0).random((10, 13)) > 0.3)
    out = A.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.shape == (2, 3, 4, 10, 8)
    ref = A.scaled_dot_product_attention(q, k, v, attn_mask=jnp.where(mask, 0.0, -jnp.inf), enable_gqa=True)
    assert_close(out, ref, 2e-5, "bool vs additive mask")
    lr = A.scaled_dot_product_attention(q, k, v, attn_mask=A.causal_lower_right(10, 13), enable_gqa=True)
    lr_ref = A.scaled_dot_product_attention(
        q, k, v, attn_mask=A.causal_lower_right(10, 13).materialize(), enable_gqa=True
    )
    assert_close(lr, lr_ref, 2e-5, "lower right")
    with pytest.raises(ValueError, match="enable_gqa"):
        A.scaled_dot_product_attention(q, k, v)


def test_sdpa_matches_torch_cpu():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 4, 19, 16)).astype(np.float32) for _ in range(3))
    m = rng.random((2, 1, 19, 19)) > 0.3
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for kw, jkw in [
        (dict(is_causal=True), dict(is_causal=True)),
        (dict(attn_mask=torch.from_numpy(m)), dict(attn_mask=jnp.asarray(m))),
        (dict(scale=0.3), dict(scale=0.3)),
    ]:
        want = F.scaled_dot_product_attention(tq, tk, tv, **kw).numpy()
        got = A.scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **jkw)
        assert_close(got, want, 1e-5, str(kw))


def _broadcast_sdpa_reference(q, k, v, is_causal=False, dropout_p=0.0):
    """torch's math path: matmuls that broadcast every leading dim (numpy's rules), in float32 at
    the highest precision (differentiable, so gradients have a reference too)."""
    hi = jax.lax.Precision.HIGHEST
    s = jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision=hi) / np.sqrt(q.shape[-1])
    if is_causal:
        L, S = s.shape[-2:]
        s = jnp.where(np.tril(np.ones((L, S), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.matmul(p * 0 if dropout_p == 1 else p, v, precision=hi)


@pytest.mark.parametrize(
    "shapes, kw",
    [
        (((2, 4, 5, 6), (1, 4, 7, 6), (1, 4, 7, 6)), {}),  # key / value batch 1
        (((1, 4, 5, 6), (2, 4, 7, 6), (2, 4, 7, 6)), {"is_causal": True}),  # query batch 1
        (((5, 6), (7, 6), (7, 3)), {}),  # 2-D (L, E)
        (((2, 4, 5, 6), (2, 4, 7, 6), (4, 7, 6)), {}),  # a rank-3 value
        (((2, 4, 5, 6), (2, 1, 7, 6), (2, 1, 7, 6)), {}),  # one kv head without enable_gqa
        (((2, 1, 5, 6), (2, 4, 7, 6), (2, 4, 7, 6)), {}),  # one query head
        (((3, 2, 4, 5, 6), (2, 2, 7, 6), (1, 1, 2, 7, 6)), {"enable_gqa": True, "is_causal": True}),
        (((2, 8, 5, 6), (1, 2, 7, 6), (2, 4, 7, 6)), {"enable_gqa": True}),  # key and value heads differ
        (((5, 6), (7, 6), (7, 3)), {"enable_gqa": True}),  # 2-D stays 2-D
        (((2, 4, 5, 6), (2, 4, 7, 6), (2, 4, 7, 6)), {"dropout_p": 1.0}),  # every weight dropped: 0
    ],
    ids=[
        "kv_batch_1",
        "q_batch_1",
        "2d",
        "value_rank_3",
        "kv_heads_1",
        "q_heads_1",
        "gqa_5d",
        "gqa_kv_heads_differ",
        "2d_gqa",
        "p1",
    ],
)
def test_sdpa_broadcasts_leading_dims_like_torch(shapes, kw):
    """What torch's math path accepts (its matmuls broadcast the batch and head dims) runs on every
    CPU backend, with the broadcast reference's values and gradients (and torch's, where installed)."""
    q, k, v = (rand(s, i) for i, s in enumerate(shapes))
    ref_kw = {n: kw[n] for n in ("is_causal", "dropout_p") if n in kw}
    if (
        kw.get("enable_gqa") and q.ndim > 2
    ):  # grouped: query head n reads key head n // (Hq // Hk), value n // (Hq // Hv)
        Gk, Gv = q.shape[-3] // k.shape[-3], q.shape[-3] // v.shape[-3]
        ref = lambda q, k, v: _broadcast_sdpa_reference(  # noqa: E731
            q, jnp.repeat(k, Gk, axis=-3), jnp.repeat(v, Gv, axis=-3), **ref_kw
        )
    else:
        ref = lambda q, k, v: _broadcast_sdpa_reference(q, k, v, **ref_kw)  # noqa: E731
    want, ref_vjp = jax.vjp(ref, q, k, v)
    g = rand(want.shape, 9)
    want_grads = ref_vjp(g)
    for backends in (
        None,
        [jb.SDPBackend.FLASH_ATTENTION],
        [jb.SDPBackend.EFFICIENT_ATTENTION],
        [jb.SDPBackend.MATH],
    ):

        def f(q, k, v):
            if backends is None:
                return A.scaled_dot_product_attention(q, k, v, **kw)
            with A.sdpa_kernel(backends):
                return A.scaled_dot_product_attention(q, k, v, **kw)

        # under jit: eager, each op of a backend's vjp compiles on its own (3-5 s a case; the eager
        # path has its own tests)
        got, grads = vjp_of(f, (q, k, v), g)
        assert got.shape == want.shape, (backends, got.shape, want.shape)
        assert_close(got, want, 2e-5, f"{backends} out")
        for name, a, b in zip("qkv", grads, want_grads):
            assert a.shape == b.shape
            assert_close(a, b, 2e-5, f"{backends} d{name}")
    if q.ndim == 2 and kw.get("enable_gqa"):
        return  # torch's enable_gqa path indexes a heads dim that 2-D inputs lack (IndexError)
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(np.asarray(x)) for x in (q, k, v))
    t = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw).numpy()
    assert t.shape == want.shape
    assert_close(jnp.asarray(t), want, 2e-5, "torch")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lengths_outside_their_range_mean_what_they_mean_in_jax_nn(jit):
    """A key length past S masks no key, a negative one every key (jax.nn's ``arange < length``);
    eager and traced alike, on every CPU backend, values and gradients."""
    q, k, v = rand((3, 6, 2, 8), 1), rand((3, 9, 2, 8), 2), rand((3, 9, 2, 8), 3)
    kw = dict(key_value_seq_lengths=jnp.asarray([12, -1, 4]), query_seq_lengths=jnp.asarray([7, 6, 100]))

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

    ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)  # noqa: E731
    want, want_grads = ref(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)
    for impl in (None, "xla", "flash", "mem_efficient", B.MATH):
        f = lambda q, k, v: A.dot_product_attention(q, k, v, implementation=impl, **kw)  # noqa: E731
        f = jax.jit(f) if jit else f
        assert_close(f(q, k, v), want, 2e-5, f"{impl} out")
        if not jit and impl is not None:
            continue  # eager gradients: the default path's (eager autodiff of each is slow; jit covers all)
        for name, a, b in zip("qkv", jax.grad(loss(f), (0, 1, 2))(q, k, v), want_grads):
            assert_close(a, b, 2e-5, f"{impl} d{name}")


def test_dot_product_attention_drop_in_for_jax_nn():
    q, k = rand((2, 21, 4, 16), 1), rand((2, 27, 2, 16), 2)
    ql, kl = jnp.asarray([21, 9]), jnp.asarray([27, 13])
    kw = dict(is_causal=False, query_seq_lengths=ql, key_value_seq_lengths=kl, local_window_size=(5, 2))
    want = jax.nn.dot_product_attention(q, k, k, **kw)
    want = want * (jnp.arange(21)[None, :, None, None] < ql[:, None, None, None])
    for impl in (None, "xla", "flash", "mem_efficient", B.MATH):
        got, lse = A.dot_product_attention(q, k, k, implementation=impl, return_residual=True, **kw)
        assert lse.shape == (2, 21, 4)
        assert_close(got, want, 2e-5, str(impl))
    with pytest.raises(ValueError, match="implementation"):
        A.dot_product_attention(q, k, k, implementation="triton")
    # unbatched [T, N, H] like jax.nn
    assert A.dot_product_attention(q[0], k[0], k[0]).shape == (21, 4, 16)


@pytest.mark.parametrize("rate", [0.3, 0.5, 0.9])  # >= 0.5: thresholds >= 2**31 (uint32, not int32)
def test_dropout_same_output_in_every_backend_and_rng_required(rate):
    q = rand((2, 17, 4, 16))
    key = jax.random.key(11)
    outs = [
        A.dot_product_attention(q, q, q, dropout_rate=rate, dropout_rng=key, implementation=i)
        for i in ("math", "flash", "mem_efficient")
    ]
    for o in outs[1:]:
        assert_close(o, outs[0], 2e-5 / (1 - rate), "dropout parity")
    plain = A.dot_product_attention(q, q, q, implementation="math")
    assert float(jnp.abs(outs[0] - plain).max()) > 0.1  # dropout did something
    with pytest.raises(ValueError, match="dropout_rng"):
        A.dot_product_attention(q, q, q, dropout_rate=0.3)
    with pytest.raises(ValueError, match="dropout_p"):
        A.scaled_dot_product_attention(q, q, q, dropout_p=-0.1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: A.dot_product_attention(jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3))), "rank"),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 6)), jnp.ones((1, 4, 2, 8))
            ),
            "head dims",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 3, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8))
            ),
            "multiple of key/value heads",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8)),
                jnp.ones((1, 4, 2, 8)),
                jnp.ones((1, 4, 2, 8)),
                mask=jnp.ones((1, 1, 3, 4), bool),
            ),
            "not broadcastable",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8), jnp.int32), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8))
            ),
            "dtype",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), dropout_rate=-0.5
            ),
            "dropout_rate",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)), scale=float("nan")
            ),
            "scale",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8)),
                jnp.ones((1, 4, 2, 8)),
                jnp.ones((1, 4, 2, 8)),
                query_seq_lengths=jnp.asarray([3, 4]),  # B is 1 (out-of-range values are clamped)
            ),
            "`query_seq_lengths`",
        ),
        (
            lambda: A.dot_product_attention(
                jnp.ones((1, 4, 2, 8)),
                jnp.ones((1, 4, 2, 8)),
                jnp.ones((1, 4, 2, 8)),
                mask=jnp.ones((1, 1, 4, 4)),
            ),
            "bool",
        ),
        (lambda: A.sdpa_kernel([]), "at least one"),
        (lambda: A.sdpa_kernel("FLASHY"), "SDPBackend"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_can_use_and_availability_are_truthful_on_cpu():
    x = jnp.ones((1, 2, 8, 16))
    p = A.SDPAParams(x, x, x, None, 0.0, True, False)
    assert A.can_use_flash_attention(p) and A.can_use_efficient_attention(p)
    with pytest.warns(UserWarning, match="CUDNN_ATTENTION cannot be used"):
        assert not A.can_use_cudnn_attention(p, debug=True)
    pm = A.SDPAParams(x, x, x, jnp.ones((8, 8), bool), 0.0, False, False)
    # On CPU the C++ flash kernel takes a boolean mask (the blockwise XLA FLASH does not; flags are
    # not consulted, as in torch).
    assert A.can_use_flash_attention(pm) == cpp_flash.available() and A.can_use_efficient_attention(pm)
    assert A.is_flash_attention_available()


def test_sdp_kernel_shim_warns_and_scopes():
    with pytest.warns(FutureWarning, match="sdpa_kernel"):
        with A.sdp_kernel(enable_flash=False, enable_mem_efficient=False):
            f = jb.current_flags()
            assert not f.flash and not f.mem_efficient and f.math
    assert jb.current_flags().flash


def test_shard_map_batch_and_head_sharding():
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("b", "h"))
    q, k = rand((4, 32, 4, 16), 1), rand((4, 32, 2, 16), 2)
    spec = P("b", None, "h", None)

    def local(q, k, v):
        return A.dot_product_attention(q, k, v, is_causal=True, implementation="flash")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    got = f(q, k, k)
    want = base.reference(base.make_args(q, k, k, is_causal=True))[0]
    assert_close(got, want, 2e-5, "shard_map")
    # sharded inputs through plain jit (GSPMD partitions the XLA flash loops; the C++ CPU kernel,
    # a custom call, runs on the gathered inputs)
    sq = jax.device_put(q, NamedSharding(mesh, spec))
    sk = jax.device_put(k, NamedSharding(mesh, spec))
    g = jax.jit(jax.grad(lambda q: A.dot_product_attention(q, sk, sk, is_causal=True).sum()))(sq)
    gr = jax.grad(lambda q: base.reference(base.make_args(q, k, k, is_causal=True))[0].sum())(q)
    assert_close(g, gr, 5e-5, "sharded grad")


def test_shard_map_dropout_masks_differ_per_shard_and_backends_agree():
    """Shards see local batch indices; the mesh position is mixed into the seed so they do not repeat."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("b",))
    row = rand((1, 24, 2, 16), 3)
    q = jnp.concatenate([row, row])  # two identical batch rows, one per shard
    spec = P("b", None, None, None)
    key = jax.random.key(5)

    def run(impl):
        local = lambda q: A.dot_product_attention(
            q,
            q,
            q,
            dropout_rate=0.4,
            dropout_rng=key,  # noqa: E731
            implementation=impl,
        )
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))(q)

    outs = {impl: run(impl) for impl in ("math", "flash", "mem_efficient")}
    assert float(jnp.abs(outs["flash"][0] - outs["flash"][1]).max()) > 0.1
    for impl in ("flash", "mem_efficient"):
        assert_close(outs[impl], outs["math"], 3e-5, f"{impl} vs math under shard_map")


@pytest.mark.parametrize("T, S", [(5, 0), (0, 7), (1, 1)])
def test_empty_and_single_lengths_fwd_and_grad_under_jit(T, S):
    q, k = rand((1, T, 2, 8), 1), rand((1, S, 2, 8), 2)
    f = lambda q, k: A.dot_product_attention(q, k, k, is_causal=False).sum()  # noqa: E731
    val, (gq, gk) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(q, k)
    if S == 0:  # no key at all: every row is fully masked, so output 0 and zero gradients (documented)
        want, wq, wk = jnp.float32(0), jnp.zeros_like(q), jnp.zeros_like(k)
    else:
        want, (wq, wk) = jax.value_and_grad(
            lambda q, k: base.reference(base.make_args(q, k, k))[0].sum(), argnums=(0, 1)
        )(q, k)
    assert_close(val, want, 1e-5, "value")
    assert_close(gq, wq, 1e-5, "dq")
    assert_close(gk, wk, 1e-5, "dk")
    if 0 in (T, S):  # the Pallas kernels say so at choice time; the XLA path serves it
        e = A.explain(q, k, k, platform="cuda", compute_capability=9.0)
        assert "empty dimension" in e.reasons[B.FLASH_ATTENTION]


@pytest.mark.parametrize("platform", ["tpu", "rocm"])
def test_export_for_other_platforms_lowers_the_xla_path(platform):
    q = rand((1, 16, 2, 8))
    f = jax.jit(lambda q: A.dot_product_attention(q, q, q, is_causal=True))
    exp = jax.export.export(f, platforms=[platform])(q)
    # No Triton kernel (its custom call); a location may still name a function traced elsewhere.
    assert "__gpu$xla.gpu.triton" not in exp.mlir_module()
    assert "stablehlo.custom_call" not in exp.mlir_module()


@settings(max_examples=5, deadline=None)
@given(
    T=st.integers(1, 40),
    S=st.integers(1, 40),
    K=st.sampled_from([1, 2]),
    G=st.sampled_from([1, 3]),
    H=st.sampled_from([8, 24]),
    causal=st.booleans(),
    lower_right=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes_match_reference(T, S, K, G, H, causal, lower_right, seed):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, T, K * G, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, S, K, H)), jnp.float32)
    mask = A.causal_lower_right(T, S) if (causal and lower_right) else None
    args = base.make_args(q, k, k, is_causal=causal, diag_offset=(S - T) if lower_right else 0)
    want, want_lse = base.reference(args)
    got, lse = A.dot_product_attention(
        q,
        k,
        k,
        is_causal=causal and not lower_right,
        mask=mask,
        implementation="flash",
        return_residual=True,
        fully_masked_rows="zero",
    )
    assert_close(got, want, 3e-5, "out")
    np.testing.assert_array_equal(np.isneginf(np.swapaxes(lse, 1, 2)), np.isneginf(want_lse))


def test_forward_mode_autodiff_runs_math_and_a_forced_fast_backend_says_why():
    """jax.jvp / jacfwd / hessian through the default path (FLASH first on CPU, a custom_vjp) run MATH
    and match jax.nn's tangents; an nnx layer's jacfwd matches flax's; a forced FLASH names the reason."""
    from flax import nnx

    rng = np.random.default_rng(7)
    q, k, v, t = (jnp.asarray(rng.normal(size=(1, 6, 2, 8)), jnp.float32) for _ in range(4))
    for causal in (False, True):
        f = lambda q: A.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        ref = lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        (out, tan), (ref_out, ref_tan) = jax.jvp(f, (q,), (t,)), jax.jvp(ref, (q,), (t,))
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(tan), np.asarray(ref_tan), rtol=1e-5, atol=1e-5)
        # jvp inside a jit: the jit's jaxpr holds the jvp, so the choice may follow it
        got = jax.jit(lambda q: jax.jvp(f, (q,), (t,))[1])(q)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref_tan), rtol=1e-5, atol=1e-5)
    small = q[:, :3, :, :4]
    # (jitted: eager, a hessian dispatches thousands of small ops)
    h = jax.jit(jax.hessian(lambda q: A.dot_product_attention(q, q, q).sum()))(small)
    h_ref = jax.jit(jax.hessian(lambda q: jax.nn.dot_product_attention(q, q, q).sum()))(small)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-4, atol=1e-5)
    x = jnp.asarray(rng.normal(size=(1, 4, 16)), jnp.float32)
    kw = dict(num_heads=2, in_features=16, decode=False)
    layer, flax_layer = (
        jb.nn.MultiHeadAttention(**kw, rngs=nnx.Rngs(0)),
        nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0)),
    )
    np.testing.assert_allclose(
        np.asarray(nnx.jit(jax.jacfwd(layer))(x)),
        np.asarray(nnx.jit(jax.jacfwd(flax_layer))(x)),
        rtol=1e-5,
        atol=1e-6,
    )
    with A.sdpa_kernel(B.FLASH_ATTENTION):
        with pytest.raises(A.NoAvailableBackendError, match="forward-mode autodiff"):
            jax.jvp(lambda q: A.dot_product_attention(q, k, v), (q,), (t,))
        out = A.dot_product_attention(q, k, v)  # outside forward mode FLASH runs as asked
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(jax.nn.dot_product_attention(q, k, v)), rtol=1e-5, atol=1e-6
    )
