"""The one dispatcher and its two registries (SDPA, int4): order, filters, the ranking hook, explain."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends._src import attention_dispatch as D
from jbackends._src import dispatch, int4_registry, sdpa_registry
from jbackends._src.sdp_backends import SDPBackend
from pallas_kernels.attention import base


def _impl(name, reasons=(), platforms=None):
    return dispatch.Implementation(
        name, "test", platforms, lambda c, p, d: list(reasons), lambda c, **o: name
    )


def test_choose_takes_the_first_that_can_and_says_why_not_the_others():
    a, b, c = _impl("a", ["too big"]), _impl("b"), _impl("c")
    ch = dispatch.choose("test", (a, b, c), None, "cpu")
    assert ch.chosen is b
    assert ch.reasons == {"a": "too big", "c": "lower priority than b"}
    ch = dispatch.choose("test", (a, b, c), None, "cpu", excluded={"b": "flag says no"})
    assert ch.chosen is c and ch.reasons == {"a": "too big", "b": "flag says no"}
    gpu_only = _impl("g", platforms=("cuda",))
    ch = dispatch.choose("test", (gpu_only,), None, "cpu")
    assert ch.chosen is None and "cuda only (lowering for cpu)" in ch.reasons["g"]


def test_a_ranker_reorders_only_runnable_candidates_and_must_permute_them():
    a, b, c = _impl("a"), _impl("b", ["no"]), _impl("c")
    previous = dispatch.set_ranker("test", lambda impls, call, platform, device: tuple(reversed(impls)))
    try:
        ch = dispatch.choose("test", (a, b, c), None, "cpu")
        assert ch.chosen is c and ch.reasons == {"b": "no", "a": "lower priority than c"}
        dispatch.set_ranker("test", lambda impls, call, platform, device: impls[:1])
        with pytest.raises(ValueError, match="permutation"):
            dispatch.choose("test", (a, b, c), None, "cpu")
        with pytest.raises(TypeError, match="callable"):
            dispatch.set_ranker("test", 3)
        assert dispatch.ranker("test") is not None  # a bad ranker leaves the installed one in place
    finally:
        dispatch.set_ranker("test", previous)
    assert dispatch.ranker("test") is previous


def test_sdpa_ranker_changes_what_runs_and_the_result_still_matches():
    """The cost-model hook: a ranker preferring the XLA flash on CPU makes it run (and it is correct)."""
    q = jax.random.normal(jax.random.key(0), (1, 32, 2, 16))
    args = base.make_args(q, q, q, is_causal=True)
    prefer_xla = lambda impls, call, platform, device: sorted(impls, key=lambda i: i.name != "xla_flash")
    previous = dispatch.set_ranker("sdpa", prefer_xla)
    try:
        d = D.decide(args, jb.current_flags(), "cpu")
        assert d.implementation.name == "xla_flash"
        assert d.implementation_reasons.get("cpp_flash", "lower priority than xla_flash").startswith(
            ("lower priority", "the C++")
        )
        out = jb.dot_product_attention(q, q, q, is_causal=True)
    finally:
        dispatch.set_ranker("sdpa", previous)
    ref = base.reference(args)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


def test_every_backend_has_an_implementation_list_and_names_are_unique():
    names = [
        i.name for table in sdpa_registry.IMPLEMENTATIONS.values() for impls in table.values() for i in impls
    ]
    assert set(names) == set(sdpa_registry.BY_NAME)
    assert set(sdpa_registry.IMPLEMENTATIONS) == {
        SDPBackend.MATH,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
    }
    assert [i.name for i in sdpa_registry.implementations(SDPBackend.FLASH_ATTENTION, "cuda")] == [
        "triton_decode",
        "mosaic_flash",
        "triton_flash",
    ]
    assert [i.name for i in sdpa_registry.implementations(SDPBackend.FLASH_ATTENTION, "cpu")] == [
        "cpp_flash",
        "xla_flash",
    ]
    assert [i.name for i in sdpa_registry.implementations(SDPBackend.FLASH_ATTENTION, "tpu")] == ["xla_flash"]
    assert sdpa_registry.implementations(SDPBackend.CUDNN_ATTENTION, "cpu") == ()


def test_flash_cpu_kernel_filters_the_cpu_list():
    q = jnp.ones((1, 16, 2, 16))
    with jb.with_backends(flash_cpu_kernel="xla"):
        e = jb.explain(q, q, q, platform="cpu")
    assert e.implementation == "xla_flash" and "flash_cpu_kernel='xla'" in e.kernel
    with jb.with_backends(flash_cpu_kernel="cpp"):
        # dropout: the one feature the C++ kernel lacks
        e = jb.explain(q, q, q, platform="cpu", dropout_rate=0.1, dropout_rng=jax.random.key(0))
    assert e.chosen == SDPBackend.EFFICIENT_ATTENTION
    assert "flash_cpu_kernel='cpp'" in e.reasons[SDPBackend.FLASH_ATTENTION]
    # Other platforms are not filtered: a multi-platform export still lowers XLA there.
    with jb.with_backends(flash_cpu_kernel="cpp"):
        e = jb.explain(q, q, q, platform="tpu")
    assert e.implementation == "xla_flash"


# ------------------------------------------------------------------------------------------- int4


def _packed(n=64, k=128, g=32):
    w = jax.random.normal(jax.random.key(1), (n, k))
    q, s = jb.quantized.quantize_4bit(w, g)
    return jb.quantized.dyn_quant_pack_4bit_weight(q, s, None, g, k, n)


@pytest.mark.parametrize(
    "engine, platform, rows, op, want",
    [
        ("auto", "cuda", 1, "int4_matmul", "pallas"),
        ("auto", "cpu", 1, "int4_matmul", "cpp"),
        ("auto", "cpu", 2048, "int4_matmul", "xla"),  # weight-only above the C++ crossover: XLA's GEMM
        ("auto", "cpu", 64, "dyn_quant_matmul_4bit", "cpp"),
        ("auto", "tpu", 1, "int4_matmul", "xla"),
        ("xla", "cuda", 1, "int4_matmul", "xla"),
        ("xla", "cpu", 1, "dyn_quant_matmul_4bit", "cpp"),  # 'xla' = no Pallas; the C++ kernel stays
        ("pallas", "cpu", 1, "int4_matmul", "pallas_interpret"),
        ("pallas", "cuda", 1, "int4_matmul", "pallas"),
    ],
)
def test_int4_explain(engine, platform, rows, op, want):
    from pallas_kernels.int4_matmul import cpp as cpp_int4

    if want == "cpp" and not cpp_int4.available():
        pytest.skip("C++ int4 kernel not built")
    p = _packed()
    x = jax.ShapeDtypeStruct((rows, 128), jnp.float32)
    with jb.with_backends(quantized_engine=engine):
        e = jb.quantized.explain(x, p, op=op, platform=platform)
    assert e.implementation == want, str(e)
    assert e.platform == platform and want not in e.reasons
    assert all(isinstance(v, str) and v for v in e.reasons.values())
    assert str(e).startswith(f"{op} on {platform}: {want}")


def test_int4_explain_matches_what_runs(caplog):
    """explain's answer is the dispatcher's: the verbose log of a real call names the same engine."""
    import logging

    p = _packed()
    x = jnp.ones((2, 128))
    e = jb.quantized.explain(x, p)
    with caplog.at_level(logging.INFO, logger="jbackends"), jb.verbose(1):
        jax.jit(lambda a: jb.quantized.int4_matmul(a, p)).lower(x)
    assert f"chosen={e.implementation}@cpu" in caplog.text


def test_int4_explain_bad_inputs():
    p = _packed()
    x = jax.ShapeDtypeStruct((1, 128), jnp.float32)
    with pytest.raises(ValueError, match="`op`"):
        jb.quantized.explain(x, p, op="matmul")
    with pytest.raises(ValueError, match="in_features=128"):
        jb.quantized.explain(jax.ShapeDtypeStruct((1, 64), jnp.float32), p)
    with pytest.raises(TypeError, match="`x`"):
        jb.quantized.explain([1.0], p)
    with pytest.raises(TypeError, match="`platform`"):
        jb.quantized.explain(x, p, platform=3)
    with pytest.raises(ValueError, match="`platform`"):
        jb.quantized.explain(x, p, platform="cdua")
    assert int4_registry.BY_NAME.keys() == set(jb.quantized.IMPLEMENTATIONS)


def test_a_jax_without_pallas_triton_routes_around_the_triton_kernels(monkeypatch):
    """The Triton backend is deprecated: once a JAX drops it, dispatch says so and picks cuDNN / XLA, or
    the Mosaic GPU kernel where FLASH must run (it needs no Triton below head dim 256)."""
    from pallas_kernels import triton_backend

    monkeypatch.setattr(triton_backend, "available", lambda: False)
    q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.bfloat16)
    e = jb.explain(q, q, q, is_causal=True, platform="cuda", compute_capability=9.0)
    assert e.implementation == "mosaic_flash"  # FLASH still runs on sm90: its Mosaic GPU kernel
    assert "not triton_flash: the installed JAX has no Pallas Triton backend" in e.kernel
    assert "no Pallas Triton backend" in e.reasons[SDPBackend.EFFICIENT_ATTENTION]
    e = jb.explain(q, q, q, is_causal=True, platform="cuda", compute_capability=8.0)
    assert e.chosen == SDPBackend.CUDNN_ATTENTION
    assert "no Pallas Triton backend" in e.reasons[SDPBackend.FLASH_ATTENTION]
    assert "needs sm90" in e.reasons[SDPBackend.FLASH_ATTENTION]
    assert "no Pallas Triton backend" in e.reasons[SDPBackend.EFFICIENT_ATTENTION]
    with jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        e = jb.explain(q, q, q, is_causal=True, platform="cuda")
    assert e.chosen == SDPBackend.MATH
    p = _packed()
    e4 = jb.quantized.explain(jax.ShapeDtypeStruct((1, 128), jnp.bfloat16), p, platform="cuda")
    assert e4.implementation == "xla" and "no Pallas Triton backend" in e4.reasons["pallas"]


def test_cuda_calls_see_the_target_compute_capability():
    """At run time the CUDA decision knows the target GPU (local, or `gpu.cuda_target`): routing by
    compute capability (cuDNN's limits, a Mosaic GPU kernel for sm90+) uses it."""
    from pallas_kernels import gpu

    assert D.local_device_info("cpu") is None
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        assert D.local_device_info("cuda") == {"compute_capability": 9.0}
    with gpu.cuda_target("NVIDIA A100-SXM4-80GB"):
        assert D.local_device_info("cuda") == {"compute_capability": 8.0}


def test_sdpa_kernel_accepts_and_ignores_overrideable():
    """torch's SDPBackend.OVERRIDEABLE is accepted by sdpa_kernel and ignored (as documented)."""
    q = jnp.ones((1, 8, 2, 16))
    with jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.OVERRIDEABLE]):
        assert jb.current_flags().flash and not jb.current_flags().math
        out = jb.dot_product_attention(q, q, q)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="backends"):
        with jb.sdpa_kernel(["FLASHY"]):
            pass


# ---- the measured order between backends (sdpa_speed) ----------------------------------------------

from jbackends._src import sdpa_speed  # noqa: E402


def _cuda(shape=(1, 2048, 4, 128), dtype=jnp.bfloat16, cc=9.0, **kw):
    x = jnp.zeros(shape, dtype)
    return jb.attention.explain(x, x, x, platform="cuda", compute_capability=cc, **kw)


def test_cudnn_runs_first_where_it_was_measured_faster_and_says_so():
    e = _cuda()
    assert e.chosen == SDPBackend.CUDNN_ATTENTION
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        assert e.reasons[b].startswith("CUDNN_ATTENTION runs first, measured faster here")
        assert "H100" in e.reasons[b]
    assert e.reasons[SDPBackend.MATH] == "lower priority than CUDNN_ATTENTION"
    assert (
        _cuda(shape=(2, 1024, 8, 64), dtype=jnp.float16, is_causal=True).chosen == SDPBackend.CUDNN_ATTENTION
    )


@pytest.mark.parametrize(
    "call",
    [
        dict(cc=8.0),  # not measured on sm80
        dict(dtype=jnp.float32),  # cuDNN takes no float32
        dict(shape=(1, 512, 4, 128)),  # shorter than measured
        dict(shape=(1, 2048, 4, 256)),  # head dim not measured
        dict(shape=(1, 2048, 4, 32)),
    ],
)
def test_outside_the_measured_envelope_the_priority_order_holds(call):
    e = _cuda(**call)
    assert e.chosen == SDPBackend.FLASH_ATTENTION
    assert "measured" not in str(e)


@pytest.mark.parametrize(
    "T, S, dtype, chosen",
    [
        (1, 131072, jnp.bfloat16, SDPBackend.CUDNN_ATTENTION),  # measured: cuDNN 573 us, ours 626
        (1, 262144, jnp.bfloat16, SDPBackend.CUDNN_ATTENTION),
        (2, 131072, jnp.bfloat16, SDPBackend.FLASH_ATTENTION),  # only one query row was measured
        (1, 16384, jnp.bfloat16, SDPBackend.FLASH_ATTENTION),  # a tie at 16k: nothing moves
        (1, 131072, jnp.float16, SDPBackend.FLASH_ATTENTION),  # f16 decode not measured
        (17, 131072, jnp.bfloat16, SDPBackend.FLASH_ATTENTION),  # not a decode row, shorter than 1k
    ],
)
def test_decode_envelope_bounds_the_query_and_key_lengths(T, S, dtype, chosen):
    q = jax.ShapeDtypeStruct((4, T, 32, 128), dtype)
    kv = jax.ShapeDtypeStruct((4, S, 8, 128), dtype)
    e = jb.attention.explain(q, kv, kv, platform="cuda", compute_capability=9.0)
    assert e.chosen == chosen
    if chosen == SDPBackend.CUDNN_ATTENTION:
        assert (
            "at decode" in e.reasons[SDPBackend.FLASH_ATTENTION]
            and "H200" in e.reasons[SDPBackend.FLASH_ATTENTION]
        )
    else:
        assert "measured" not in str(e)


def test_a_user_priority_or_the_flag_keeps_the_users_order():
    SB = SDPBackend
    default = [SB.FLASH_ATTENTION, SB.EFFICIENT_ATTENTION, SB.CUDNN_ATTENTION, SB.MATH]
    with jb.attention.sdpa_kernel(default, set_priority=True):  # the default order, asked for
        e = _cuda()
    assert (
        e.chosen == SB.FLASH_ATTENTION
        and e.reasons[SB.CUDNN_ATTENTION] == "lower priority than FLASH_ATTENTION"
    )
    with jb.with_backends(sdpa_prefer_faster=False):
        assert _cuda().chosen == SB.FLASH_ATTENTION
    with jb.with_backends(sdpa_priority=[SB.FLASH_ATTENTION]):  # canonicalised to the default order
        assert _cuda().chosen == SB.FLASH_ATTENTION
    # a bias was not measured: the priority order holds (FLASH's Mosaic GPU kernel takes a bias in the
    # inputs' dtype on sm90; elsewhere EFFICIENT takes it)
    bias = jnp.zeros((1, 4, 2048, 2048), jnp.bfloat16)
    e = _cuda(bias=bias)
    assert e.chosen == SB.FLASH_ATTENTION and e.implementation == "mosaic_flash"
    assert "measured" not in str(e)
    assert _cuda(bias=bias, cc=8.0).chosen == SB.EFFICIENT_ATTENTION
    with jb.with_backends(sdpa_priority=[SB.EFFICIENT_ATTENTION]):
        assert _cuda().chosen == SB.EFFICIENT_ATTENTION
    with jb.attention.sdpa_kernel([SB.FLASH_ATTENTION, SB.CUDNN_ATTENTION]):  # a set, no priority
        assert _cuda().chosen == SB.CUDNN_ATTENTION
    with jb.with_backends(cudnn=False):
        assert _cuda().chosen == SB.FLASH_ATTENTION


def test_where_cudnn_cannot_run_the_call_flash_runs_with_the_usual_reasons():
    e = _cuda(logits_soft_cap=30.0)
    assert e.chosen == SDPBackend.FLASH_ATTENTION
    assert "soft cap" in e.reasons[SDPBackend.CUDNN_ATTENTION]
    assert "measured" not in e.reasons[SDPBackend.EFFICIENT_ATTENTION]


def test_measured_order_is_part_of_the_jit_key():
    """The flag is traced: flipping it retraces (a stale executable would keep the old choice)."""
    traced = []

    @jax.jit
    def f(x):
        traced.append(jb.current_flags().sdpa_prefer_faster)
        return x + 1

    f(jnp.zeros(3))
    with jb.with_backends(sdpa_prefer_faster=False):
        f(jnp.zeros(3))
    f(jnp.zeros(3))
    assert traced == [True, False]


def test_measurements_are_validated():
    with pytest.raises(TypeError, match="SDPBackend"):
        sdpa_speed.Measurement("cudnn", (), "cuda", 9.0, ("bfloat16",), 64, 128, 1024, "x")
    with pytest.raises(ValueError, match="faster than itself"):
        SB = SDPBackend
        sdpa_speed.Measurement(SB.MATH, (SB.MATH,), "cuda", 9.0, ("bfloat16",), 64, 128, 1024, "x")
    with pytest.raises(TypeError, match="Measurement"):
        sdpa_speed.add("cudnn is faster")
    with pytest.raises(TypeError, match="flag .sdpa_prefer_faster. expects a bool"):
        jb.with_backends(sdpa_prefer_faster="yes")


@contextlib.contextmanager
def _compilations():
    """The names of the functions XLA compiles inside the block (jax.monitoring's compile events)."""
    names = []

    def listen(event, secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("backend", ["math", "mem_efficient", "flash"])
def test_eager_attention_compiles_once_per_shape(backend):
    """An eager call runs its implementation as one jit: the second call of the same shapes compiles
    nothing, forward or gradient (eager JAX recompiled the blockwise kernels' loops at every call), and
    gives the same numbers as the call under the user's jit."""
    q, k, v = jax.random.normal(jax.random.key(3), (3, 2, 40, 2, 16))
    flags = dict(math=False, flash=False, mem_efficient=False, cudnn=False) | {backend: True}

    def loss(q, k, v):
        return (jb.dot_product_attention(q, k, v, is_causal=True) ** 2).sum()

    with jb.with_backends(**flags):
        first = jb.dot_product_attention(q, k, v, is_causal=True), jax.grad(loss, (0, 1, 2))(q, k, v)
        with _compilations() as compiled:
            again = jb.dot_product_attention(q, k, v, is_causal=True), jax.grad(loss, (0, 1, 2))(q, k, v)
        jitted = jax.jit(
            lambda q, k, v: (
                jb.dot_product_attention(q, k, v, is_causal=True),
                jax.grad(loss, (0, 1, 2))(q, k, v),
            )
        )(q, k, v)
    assert compiled == []
    for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(again), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", ["auto", "xla"])
def test_eager_int4_compiles_once_per_shape_and_still_reports_each_choice(engine, caplog):
    """The same for the int4 ops (eager JAX rebuilt and recompiled their per-platform choice at every
    call), while the choice itself is still made, and logged under verbose, at every call."""
    import logging

    p = _packed()
    x = jax.random.normal(jax.random.key(4), (5, 128))

    def calls():
        return (
            jb.quantized.dyn_quant_matmul_4bit(x, p, 32, 128, 64),
            jb.quantized.int4_matmul(x, p),
            jax.grad(lambda a: jb.quantized.int4_matmul(a, p).sum())(x),
        )

    with jb.with_backends(quantized_engine=engine):
        first = calls()
        with _compilations() as compiled, caplog.at_level(logging.INFO, logger="jbackends"), jb.verbose(1):
            again = calls()
    assert compiled == []
    assert caplog.text.count("dispatch op=dyn_quant_matmul_4bit") == 1
    assert caplog.text.count("dispatch op=int4_matmul") == 2
    want = jb.quantized.int4_matmul(x, p, implementation="xla")
    np.testing.assert_allclose(np.asarray(first[1]), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
