"""The public API (`jb.quantized`, `jb.nn` int4 layers): engine choice per lowering platform, export
for CUDA from CPU carrying the Pallas (Triton) kernel, pytrees under jit / vmap, flax layers."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import jbackends as jb
import jbackends.quantized as Q
from jbackends._src import nn_int4
from pallas_kernels import gpu
from pallas_kernels.int4_matmul import cpp
from tests.int4.int4_base import make_case, reference

TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("engine", ["auto", "xla", "pallas"])
def test_engines_bit_exact(engine):
    x, p = make_case(3, 128, 24, 32, True, lead=(2,))
    f = jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, 32, 128, 24))
    with jb.with_backends(quantized_engine=engine):
        got = f(x, p)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference(x, p)))


def test_engine_attribute_and_flag():
    assert Q.engine == "auto"
    assert Q.supported_engines == ["auto", "pallas", "xla"] and isinstance(Q.supported_engines, list)
    assert Q.supported_engines() == ["auto", "pallas", "xla"]  # the earlier function form still works
    with jb.with_backends(quantized_engine="xla"):
        assert Q.engine == "xla"
    assert Q.engine == "auto"


@pytest.mark.parametrize(
    "M,g,mode",
    [(1, 64, "dyn_quant"), (40, 32, "dyn_quant"), (1, 128, "weight_only"), (64, 64, "weight_only")],
)
def test_export_for_cuda_carries_triton(M, g, mode):
    K, N = 256, 96
    p = jax.eval_shape(
        lambda: Q.dyn_quant_pack_4bit_weight(
            jnp.zeros((N, K // 2), jnp.uint8), jnp.zeros((N, K // g)), jnp.zeros(N), g, K, N
        )
    )
    x = jax.ShapeDtypeStruct((2, M, K), jnp.float32 if mode == "dyn_quant" else jnp.bfloat16)
    if mode == "dyn_quant":
        f = lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N)
    else:
        f = lambda x, p: Q.int4_matmul(x, p)
    with gpu.cuda_target(), warnings.catch_warnings(record=True) as caught:
        # an abstract H100: JAX >= 0.11 lowers Pallas GPU kernels only for a named GPU
        warnings.simplefilter("always")
        exp = export.export(
            jax.jit(f), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)]
        )(x, p)
    # JAX's Triton-backend deprecation (jax >= 0.11) is for kernel authors; it never reaches our users
    assert not [w for w in caught if "Triton backend is deprecated" in str(w.message)]
    text = exp.mlir_module()
    assert TRITON in text
    assert "jb_int4_dyn_quant_matmul_f32" not in text and "jb_int4_matmul_f32" not in text
    assert exp.out_avals[0].shape == (2, M, N)


@pytest.mark.parametrize("mode", ["dyn_quant", "weight_only"])
def test_export_for_cpu_and_cuda_runs_the_cpu_branch_exactly(mode):
    """One artifact for CPU and CUDA (a Triton pallas_call refused to lower for the CPU branch that
    `platform_dependent` lowers too): the CUDA branch carries the Triton kernel, and the exported
    function, called on CPU, gives the live call's numbers, forward and gradients."""
    from pallas_kernels.int4_matmul import cpp

    K, N, g = 128, 48, 32
    rng = np.random.default_rng(0)
    q, s = Q.quantize_4bit(jnp.asarray(rng.standard_normal((N, K)), jnp.float32), g)
    p = Q.dyn_quant_pack_4bit_weight(q, s, jnp.asarray(rng.standard_normal(N), jnp.float32), g, K, N)
    x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
    if mode == "dyn_quant":
        f = lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N)
    else:
        f = lambda x, p: Q.int4_matmul(x, p)
    # gradients in x and the scales (the packed nibbles are integers)
    loss = lambda x, sc: (f(x, dataclasses.replace(p, scales=sc)) * jnp.cos(jnp.arange(N))[None]).sum()
    grads = jax.grad(loss, argnums=(0, 1))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in (TRITON, *cpp.TARGETS)]
    with gpu.cuda_target():
        exp_f = export.export(jax.jit(f), platforms=["cpu", "cuda"], disabled_checks=checks)(x, p)
        exp_g = export.export(jax.jit(grads), platforms=["cpu", "cuda"], disabled_checks=checks)(x, p.scales)
    assert TRITON in exp_f.mlir_module()
    np.testing.assert_array_equal(np.asarray(exp_f.call(x, p)), np.asarray(f(x, p)))
    got, want = exp_g.call(x, p.scales), grads(x, p.scales)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "M,mma,after", [(1, True, True), (40, True, True), (1, False, True), (5, False, True), (3, False, False)]
)
def test_export_for_cuda_w4a16_search_space_options(M, mma, after):
    """The W4A16 kernel's search-space options (scale after the dot; no MMA) lower to Triton for CUDA."""
    from pallas_kernels.int4_matmul import triton

    K, N, g = 256, 96, 64
    p = jax.eval_shape(
        lambda: Q.dyn_quant_pack_4bit_weight(
            jnp.zeros((N, K // 2), jnp.uint8), jnp.zeros((N, K // g)), jnp.zeros(N), g, K, N
        )
    )
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    cfg = triton.Config(16 if M <= 16 else 32, 32, 64, 2 if M <= 16 else 1, scale_after_dot=after, mma=mma)
    with gpu.cuda_target():
        exp = export.export(
            jax.jit(lambda x, p: triton.weight_only_matmul(x, p, config=cfg)),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)],
        )(x, p)
    assert TRITON in exp.mlir_module() and exp.out_avals[0].shape == (M, N)


def test_vmap_over_weights_and_inputs():
    x, p = make_case(2, 64, 16, 32, True)
    x2, p2 = make_case(2, 64, 16, 32, False, seed=5)
    p2 = Q.PackedInt4Weight(p2.weight, p2.scales, jnp.zeros(16), 32, 64, 16)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), p, p2)
    xs = jnp.stack([x, x2])
    f = lambda x, p: Q.dyn_quant_matmul_4bit(x, p, 32, 64, 16)
    got = jax.jit(jax.vmap(f))(xs, stacked)
    for i, (xi, pi) in enumerate([(x, p), (x2, p2)]):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(reference(xi, pi)))
    got = jax.vmap(f, in_axes=(None, 0))(x, stacked)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(reference(x, p2)))


def test_pytree_and_checkpoint_roundtrip():
    _, p = make_case(1, 64, 16, 32, True)
    leaves, treedef = jax.tree.flatten(p)
    assert [l.dtype for l in leaves] == [jnp.uint8, jnp.float32, jnp.float32]
    q = jax.tree.unflatten(treedef, [np.asarray(l) for l in leaves])
    assert q.groupsize == 32 and q.in_features == 64 and q.out_features == 16
    assert p.nbytes == 16 * 32 + 16 * 2 * 4 + 16 * 4


def test_orbax_checkpoint_of_a_quantized_model(tmp_path):
    """The packed weights save and restore with orbax (flax's checkpointing), bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    from flax import nnx

    from jbackends import nn as jnn

    mlp = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
    model = jnn.quantize_4bit(mlp, groupsize=32)
    graphdef, state = nnx.split(model)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "int4", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "int4", target=jax.tree.map(jnp.zeros_like, state))
    leaves = jax.tree.leaves(restored)
    assert any(l.dtype == jnp.uint8 for l in leaves)  # still packed nibbles, not floats
    for a, b in zip(jax.tree.leaves(state), leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, restored)(x)), np.asarray(model(x)))


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built")
def test_cpu_auto_uses_cpp():
    x, p = make_case(1, 64, 16, 32, False)
    f = jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, 32, 64, 16))
    assert "jb_int4_dyn_quant_matmul_f32" in f.lower(x, p).as_text()
    with jb.with_backends(quantized_engine="pallas"):
        assert "jb_int4_dyn_quant_matmul_f32" not in f.lower(x, p).as_text()


@pytest.mark.parametrize("op", ["dyn_quant_matmul_4bit", "int4_matmul"])
def test_forced_pallas_engine_never_falls_back(op, monkeypatch):
    """quantized_engine='pallas' forces the Pallas kernels: a call they cannot run raises (with every
    engine's reason, and explain() says nothing runs it) instead of running the C++ kernel or XLA."""
    from pallas_kernels import triton_backend

    def call(x, p, K, N, g):
        if op == "int4_matmul":
            return Q.int4_matmul(x, p)
        return Q.dyn_quant_matmul_4bit(x, p, g, K, N)

    x, p = make_case(2, 128, 16, 32, False)
    with jb.with_backends(quantized_engine="pallas"):
        want = Q.dyn_quant_matmul_4bit(x, p, 32, 128, 16, implementation="pallas_interpret")
        if op == "int4_matmul":
            want = Q.int4_matmul(x, p, implementation="pallas_interpret")
        got = jax.jit(lambda a: call(a, p, 128, 16, 32))(x)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # channel-wise K = 48: no Pallas kernel takes it
        q48, s48 = Q.quantize_4bit(jnp.ones((8, 48)), 48)
        p48 = Q.dyn_quant_pack_4bit_weight(q48, s48, None, 48, 48, 8)
        x48 = jnp.ones((2, 48))
        assert Q.explain(x48, p48, op=op, platform="cpu").implementation is None
        assert "nothing can run it" in str(Q.explain(x48, p48, op=op, platform="cpu"))
        with pytest.raises(NotImplementedError, match="quantized_engine='pallas'"):
            jax.jit(lambda a: call(a, p48, 48, 8, 48))(x48)
        # a JAX without Pallas Triton: an error, not the C++ kernel
        monkeypatch.setattr(triton_backend, "missing", lambda: ["no Pallas Triton (test)"])
        with pytest.raises(NotImplementedError, match="no Pallas Triton"):
            jax.jit(lambda a: call(a, p, 128, 16, 32))(x + 1)
    assert Q.explain(x48, p48, op=op, platform="cpu").implementation in ("cpp", "xla")


@pytest.mark.parametrize("op", ["int4_matmul", "dyn_quant_matmul_4bit"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.int32, jnp.int8, jnp.float32])
def test_explain_refuses_the_dtypes_the_call_refuses(op, dtype):
    """explain never names a kernel for a call that raises: the input dtypes are checked as the call
    checks them (float16 is weight-only's, not dyn-quant's), with the same TypeError."""
    x, p = make_case(2, 128, 16, 32, False)
    x = x.astype(dtype)

    def call():
        if op == "int4_matmul":
            return Q.int4_matmul(x, p)
        return Q.dyn_quant_matmul_4bit(x, p, 32, 128, 16)

    if dtype == jnp.float32 or (dtype == jnp.float16 and op == "int4_matmul"):
        call()
        assert Q.explain(x, p, op=op, platform="cpu").implementation is not None
        return
    with pytest.raises(TypeError, match="dtype"):
        call()
    with pytest.raises(TypeError, match="dtype"):
        Q.explain(x, p, op=op, platform="cpu")
    with pytest.raises(TypeError, match="dtype"):
        Q.explain(jax.ShapeDtypeStruct(x.shape, x.dtype), p, op=op, platform="cuda")


def test_argument_types_named_in_errors():
    x, p = make_case(1, 64, 8, 32, False)
    with pytest.raises(TypeError, match="compute_dtype"):
        Q.int4_matmul(x, p, compute_dtype="garbage")
    for bad in (dict(groupsize=32.0), dict(in_features=True), dict(out_features=np.float32(8))):
        kw = dict(groupsize=32, in_features=64, out_features=8) | bad
        with pytest.raises(TypeError, match=next(iter(bad))):
            Q.dyn_quant_matmul_4bit(x, p, kw["groupsize"], kw["in_features"], kw["out_features"])
    np.testing.assert_array_equal(  # numpy ints are ints
        np.asarray(Q.dyn_quant_matmul_4bit(x, p, np.int64(32), 64, 8)),
        np.asarray(Q.dyn_quant_matmul_4bit(x, p, 32, 64, 8)),
    )
    # every spelling of a compute dtype is the same option of the compiled op (a 0-d array, whose
    # dtype is read explicitly: JAX deprecates reading an array as a dtype, and a jax array is no
    # hashable static value itself)
    want = np.asarray(Q.int4_matmul(x, p, compute_dtype=jnp.bfloat16, implementation="xla"))
    spellings = ("bfloat16", np.dtype(jnp.bfloat16), jnp.zeros((), jnp.bfloat16), np.zeros((), np.float16))
    for spelling in spellings:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            got = Q.int4_matmul(x, p, compute_dtype=spelling, implementation="xla")
        ref = (
            want
            if spelling is not spellings[-1]
            else Q.int4_matmul(x, p, compute_dtype="float16", implementation="xla")
        )
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    with pytest.raises(TypeError, match="compute_dtype"):
        Q.int4_matmul(x, p, compute_dtype=jnp.zeros((2,), jnp.bfloat16))


def test_int4_matmul_weight_only_public():
    x, p = make_case(3, 128, 24, 64, True, lead=(2,))
    w = np.asarray(Q.dequantize_4bit(p), np.float64)
    want = np.asarray(x, np.float64) @ w.T + np.asarray(p.bias, np.float64)
    got = jax.jit(lambda x, p: Q.int4_matmul(x, p))(x, p)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())
    gb = jax.jit(lambda x, p: Q.int4_matmul(x, p))(x.astype(jnp.bfloat16), p)
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gb, np.float64), want, rtol=0, atol=3e-2 * np.abs(want).max())


# --------------------------------------------------------------------------------- flax nnx


def _mlp(seed=0):
    r = nnx.Rngs(seed)
    return nnx.Sequential(
        nnx.Linear(128, 96, rngs=r), nnx.relu, nnx.Linear(96, 64, rngs=r), nnx.relu, nnx.Linear(64, 8, rngs=r)
    )


@pytest.mark.parametrize("mode", ["weight_only", "dyn_quant"])
def test_quantized_mlp_within_tolerance(mode):
    model = _mlp()
    x = jax.random.normal(jax.random.key(1), (16, 128))
    want = model(x)
    # the same model with every kernel replaced by its int4 round trip: the int4 layers must match it
    deq = _mlp()
    qmodel = nn_int4.quantize_4bit(model, groupsize=32, mode=mode)
    for i in (0, 2, 4):
        layer = qmodel.layers[i]
        assert isinstance(layer, nn_int4.Int4Linear)
        assert layer.weight[...].dtype == jnp.uint8 and layer.weight[...].shape[1] * 2 == layer.in_features
        deq.layers[i].kernel[...] = Q.dequantize_4bit(layer.packed).T
    got = nnx.jit(lambda m, x: m(x))(qmodel, x)
    rel = float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want**2)))
    # int4 with groups of 32 on LeCun-normal weights: ~10% relative RMS; stated tolerance 20%.
    assert rel < 0.2, rel
    if mode == "weight_only":
        np.testing.assert_allclose(np.asarray(got), np.asarray(deq(x)), rtol=1e-4, atol=1e-4)


def test_quantize_model_groupsize_rules():
    r = nnx.Rngs(0)
    m = nnx.Sequential(nnx.Linear(96, 48, rngs=r), nnx.Linear(48, 4, rngs=r))
    q = nn_int4.quantize_4bit(m, groupsize=64)  # 96 % 64 != 0 -> channel-wise
    assert q.layers[0].groupsize == 96 and q.layers[1].groupsize == 48
    m = nnx.Sequential(nnx.Linear(96, 48, rngs=r))
    with pytest.raises(ValueError, match="layers/0"):
        nn_int4.quantize_4bit(m, groupsize=64, channelwise_fallback=False)
    with pytest.raises(ValueError, match="mode"):
        nn_int4.quantize_4bit(m, groupsize=32, mode="int8")
    lin = nn_int4.quantize_4bit(nnx.Linear(64, 8, rngs=r), groupsize=32)
    assert isinstance(lin, nn_int4.Int4Linear)
    state = nnx.state(lin)
    leaves = jax.tree.leaves(state)
    assert sum(l.nbytes for l in leaves) == 8 * 32 + 8 * 2 * 4 + 8 * 4


def test_int4_matmul_gradients():
    x, p = make_case(3, 64, 16, 32, True, lead=(2,))
    from pallas_kernels.int4_matmul import base

    def loss(f, x, s, b):
        pp = Q.PackedInt4Weight(p.weight, s, b, 32, 64, 16)
        return jnp.sum(jnp.sin(f(x, pp)))

    got = jax.jit(jax.grad(lambda *a: loss(Q.int4_matmul, *a), argnums=(0, 1, 2)))(x, p.scales, p.bias)
    want = jax.grad(lambda *a: loss(base.weight_only_matmul, *a), argnums=(0, 1, 2))(x, p.scales, p.bias)
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * float(jnp.abs(w).max())
        )


@pytest.mark.parametrize("g", [32, 128, 1024])
def test_xla_small_m_path_materializes_no_weight(g):
    """M=1 on the pure-XLA path: temporaries stay far below a dequantized weight (4 bytes each)."""
    from pallas_kernels.int4_matmul import xla

    N, K = 512, 1024
    w = jnp.asarray(np.random.default_rng(g).standard_normal((N, K)), jnp.float32)
    q, s = Q.quantize_4bit(w, g)
    p = Q.dyn_quant_pack_4bit_weight(q, s, None, g, K, N)
    x = jnp.ones((1, K), jnp.float32)
    dequantized = N * K * 4
    for fn, limit in ((xla.dyn_quant_matmul, p.weight.nbytes), (xla.weight_only_matmul, dequantized // 3)):
        temp = jax.jit(fn).lower(x, p).compile().memory_analysis().temp_size_in_bytes
        assert temp < limit, (fn.__name__, temp, limit)


@pytest.mark.parametrize("K", [10, 40, 120])  # channel-wise rows whose pairwise sums meet odd lengths
def test_xla_weight_only_channelwise_short_rows(K):
    from pallas_kernels.int4_matmul import base, xla

    rng = np.random.default_rng(K)
    w = jnp.asarray(rng.standard_normal((8, K)), jnp.float32)
    q, s = Q.quantize_4bit(w, K)
    p = Q.dyn_quant_pack_4bit_weight(q, s, None, K, K, 8)
    x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(base.dequantize(p.weight, p.scales, K), np.float64).T
    np.testing.assert_allclose(np.asarray(jax.jit(xla.weight_only_matmul)(x, p)), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["dyn_quant", "weight_only"])
def test_shape_polymorphic_export_with_a_symbolic_batch(mode):
    """A symbolic number of rows: the C++ and Pallas engines are refused with a reason (their checks
    need M) and the XLA engine traces the call (Int4Call.of raised InconclusiveDimensionOperation)."""
    K, N, g = 128, 48, 32
    rng = np.random.default_rng(1)
    q, s = Q.quantize_4bit(jnp.asarray(rng.standard_normal((N, K)), jnp.float32), g)
    p = Q.dyn_quant_pack_4bit_weight(q, s, jnp.asarray(rng.standard_normal(N), jnp.float32), g, K, N)
    if mode == "dyn_quant":
        f = lambda x, p, **kw: Q.dyn_quant_matmul_4bit(x, p, g, K, N, **kw)
    else:
        f = lambda x, p, **kw: Q.int4_matmul(x, p, **kw)
    (b,) = export.symbolic_shape("b")
    exp = export.export(jax.jit(f), platforms=["cpu"])(jax.ShapeDtypeStruct((b, 3, K), jnp.float32), p)
    assert "jb_int4" not in exp.mlir_module()
    for rows in (1, 7):
        x = jnp.asarray(rng.standard_normal((rows, 3, K)), jnp.float32)
        want = f(x, p, implementation="xla")
        np.testing.assert_allclose(np.asarray(exp.call(x, p)), np.asarray(want), rtol=1e-5, atol=1e-5)
