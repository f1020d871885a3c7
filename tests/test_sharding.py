"""Batch- and head-sharded inputs stay sharded through every attention backend (8 virtual CPU devices).

For each backend the compiled forward and gradient carry no all-gather, the outputs and gradients
keep the inputs' sharding, and the values match the same call on unsharded inputs. A bias broadcast
over the batch gets its gradient summed across the batch shards (an all-reduce: the one collective
it needs). Both of JAX's sharding modes: Auto (jit propagates) and Explicit (sharding in the types).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jbackends as jb
from pallas_kernels import partition
from pallas_kernels.int4_matmul import cpp as int4_cpp
from tests.attention.attention_base import normal, seeds, uniform

B, T, N, K, H = 4, 40, 4, 2, 16

BACKENDS = {
    "math": dict(backends=[jb.SDPBackend.MATH]),
    "flash_cpp": dict(backends=[jb.SDPBackend.FLASH_ATTENTION], flash_cpu_kernel="auto"),
    "flash_xla": dict(backends=[jb.SDPBackend.FLASH_ATTENTION], flash_cpu_kernel="xla"),
    "efficient": dict(backends=[jb.SDPBackend.EFFICIENT_ATTENTION]),
}


def _mesh(axis_type="Auto"):
    t = getattr(jax.sharding.AxisType, axis_type)
    return jax.make_mesh((4, 2), ("b", "h"), axis_types=(t, t))


def _inputs(seed=0):
    keys = seeds(seed, 5)
    q = normal(keys[0], (B, T, N, H), jnp.float32)
    k = normal(keys[1], (B, T, K, H), jnp.float32)
    v = normal(keys[2], (B, T, K, H), jnp.float32)
    bias = normal(keys[3], (1, N, T, T), jnp.float32)  # broadcast over the batch
    mask = uniform(keys[4], (B, 1, T, T)) > 0.2
    return q, k, v, bias, mask


def _call(name, with_bias):
    cfg = dict(BACKENDS[name])
    backends = cfg.pop("backends")

    def loss(q, k, v, bias, mask):
        with jb.sdpa_kernel(backends), jb.with_backends(**cfg):
            out = jb.dot_product_attention(
                q,
                k,
                v,
                bias=bias if with_bias else None,
                mask=mask if with_bias else None,
                is_causal=not with_bias,
            )
        return out, (out.astype(jnp.float32) ** 2).sum()

    def value_and_grads(q, k, v, bias, mask):
        (l, out), g = jax.value_and_grad(lambda *a: loss(*a)[::-1], argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, bias, mask
        )
        return out, l, g

    return jax.jit(value_and_grads)


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize(
    "spec", [P("b"), P("b", None, "h"), P(None, None, "h")], ids=["batch", "batch+heads", "heads"]
)
def test_sharded_inputs_stay_sharded_with_no_all_gather(name, spec):
    with_bias = name == "efficient"
    mesh = _mesh()
    q, k, v, bias, mask = _inputs()
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    qs, ks, vs = put(q, spec), put(k, spec), put(v, spec)
    bs, ms = put(bias, P()), put(mask, P(spec[0] if len(spec) else None))
    f = _call(name, with_bias)
    hlo = f.lower(qs, ks, vs, bs, ms).compile().as_text()
    assert "all-gather" not in hlo, f"{name}: the compiled call gathers its inputs"
    out, _, grads = f(qs, ks, vs, bs, ms)
    ref_out, _, ref_grads = f(q, k, v, bias, mask)
    want = NamedSharding(mesh, spec)
    assert out.sharding.is_equivalent_to(want, out.ndim), (name, out.sharding)
    for g in grads[:3]:
        assert g.sharding.is_equivalent_to(want, g.ndim), (name, g.sharding)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    if with_bias and spec[0] == "b":
        assert "all-reduce" in hlo  # dbias: each batch shard holds a partial sum


@pytest.mark.parametrize("name", ["flash_cpp", "flash_xla", "efficient"])
def test_explicit_sharding_mode(name):
    """``jax.make_mesh``'s Explicit axes (sharding in the types): the kernel runs under shard_map."""
    with_bias = name == "efficient"
    mesh = _mesh("Explicit")
    q, k, v, bias, mask = _inputs(1)
    spec = P("b", None, "h")
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    f = _call(name, with_bias)
    out, _, grads = f(put(q, spec), put(k, spec), put(v, spec), put(bias, P()), put(mask, P("b")))
    ref_out, _, ref_grads = f(q, k, v, bias, mask)
    assert out.sharding.spec[:3] == spec[:3] or out.sharding.spec == spec, out.sharding
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


DROPOUT_KERNELS = ["flash_xla", "efficient", "pallas_flash", "pallas_decode"]


def _dropout_loss(name, rng):
    """A loss through one backend with dropout (rate 0.3), and the same loss on MATH."""
    from pallas_kernels.attention import base, triton_decode, triton_flash  # noqa: PLC0415

    def out_of(q, k, v):
        if name.startswith("pallas"):
            module = triton_flash if name == "pallas_flash" else triton_decode
            args = base.make_args(
                q, k, v, dropout_rate=0.3, dropout_rng=rng, is_causal=name == "pallas_flash"
            )
            return module.attention(args, interpret=True)[0]
        cfg = dict(BACKENDS[name])
        with jb.sdpa_kernel(cfg.pop("backends")), jb.with_backends(**cfg):
            return jb.dot_product_attention(
                q, k, v, is_causal=name != "pallas_decode", dropout_rate=0.3, dropout_rng=rng
            )

    def math(q, k, v):
        with jb.sdpa_kernel([jb.SDPBackend.MATH]):
            return jb.dot_product_attention(
                q, k, v, is_causal=name != "pallas_decode", dropout_rate=0.3, dropout_rng=rng
            )

    def value_and_grads(f):
        def run(q, k, v):
            loss = lambda *a: (
                (f(*a) * jnp.cos(jnp.arange(H, dtype=jnp.float32))[None, None, None]) ** 2
            ).sum()  # noqa: E731
            return f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        return jax.jit(run)

    return value_and_grads(out_of), value_and_grads(math)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("name", DROPOUT_KERNELS)
def test_dropout_stays_sharded_and_drops_what_one_device_drops(name, axis_type):
    """Dropout hashes global batch and head indices: each shard's kernel is given its offsets, so a
    batch- and head-sharded call keeps its sharding (no all-gather) and equals MATH on one device."""
    mesh = _mesh(axis_type)
    q, k, v, _, _ = _inputs(3)
    if name == "pallas_decode":
        q = q[:, :4]
    rng = jax.random.key(7)
    spec = P("b", None, "h")
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    f, math = _dropout_loss(name, rng)
    if axis_type == "Auto":
        assert "all-gather" not in f.lower(put(q), put(k), put(v)).compile().as_text()
    out, grads = f(put(q), put(k), put(v))
    want_out, want_grads = math(q, k, v)
    assert out.sharding.spec[:3] == spec[:3], out.sharding
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, want_grads):
        assert g.sharding.spec[:3] == spec[:3], g.sharding
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["plain", "dropout"])
@pytest.mark.parametrize("name", ["flash_xla", "efficient"])
def test_heads_split_finer_than_the_kv_heads_are_gathered_not_crashed(name, dropout, axis_type):
    """q's 4 heads split 4 ways over 2 kv heads: no shard holds a whole kv-head group, so the heads are
    gathered (Shardy hands the backward half-axis shardings JAX cannot decode; that used to raise)."""
    t = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(t, t))
    q, k, v, _, _ = _inputs(4)
    q, k, v = q[:2], k[:2], v[:2]
    rng = jax.random.key(11)
    cfg = dict(BACKENDS[name])
    backends = cfg.pop("backends")

    def run(backends, cfg):
        def out_of(q, k, v):
            with jb.sdpa_kernel(backends), jb.with_backends(**cfg):
                return jb.dot_product_attention(
                    q, k, v, is_causal=True, dropout_rate=dropout, dropout_rng=rng if dropout else None
                )

        def loss(q, k, v):
            return (
                (out_of(q, k, v) * jnp.cos(jnp.arange(H, dtype=jnp.float32))[None, None, None]) ** 2
            ).sum()

        return jax.jit(lambda q, k, v: (out_of(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))

    out, grads = run(backends, cfg)(
        jax.device_put(q, NamedSharding(mesh, P("b", None, "h"))),
        jax.device_put(k, NamedSharding(mesh, P("b"))),
        jax.device_put(v, NamedSharding(mesh, P("b"))),
    )
    want_out, want_grads = run([jb.SDPBackend.MATH], {})(q, k, v)
    assert out.sharding.spec[0] == "b", out.sharding
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, want_grads):
        assert g.sharding.spec[0] == "b", g.sharding
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_an_operand_split_over_the_minor_part_of_an_axis_is_gathered():
    """An operand whose dimension is split over the minor half of a mesh axis (a reshape and transpose
    put it there) is not a PartitionSpec JAX can decode: the kernel takes it gathered, and computes."""
    mesh = jax.make_mesh((2, 4), ("b", "h"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f = partition.sharded(
        lambda x: (jnp.cumsum(x, axis=1) * 2,),
        in_factors=(("b", "t", "k"),),
        out_factors=(("b", "t", "k"),),
        parallel=("b", "k"),
    )
    x = normal(0, (2, 6, 4, 2, 3))

    def g(x):
        y = x.reshape(2, 6, 2, 2, 2, 3).transpose(0, 1, 3, 2, 4, 5)  # dim 2: the minor half of h
        return f((y * y).sum((3, 4, 5)))[0]

    out = jax.jit(g)(jax.device_put(x, NamedSharding(mesh, P("b", None, "h"))))
    np.testing.assert_allclose(np.asarray(out), np.asarray(g(x)), rtol=1e-5, atol=1e-5)


def test_vmap_of_a_sharded_kernel_runs_unpartitioned():
    def kern(x):
        return (jnp.cumsum(x, axis=1),)

    f = partition.sharded(kern, in_factors=(("b", "t"),), out_factors=(("b", "t"),), parallel=("b",))
    x = normal(0, (3, 4, 5))
    np.testing.assert_allclose(np.asarray(jax.vmap(lambda x: f(x)[0])(x)), np.cumsum(x, axis=2), rtol=1e-6)


def test_sharded_checks_its_factors():
    with pytest.raises(ValueError, match="parallel factors \\['k'\\] appear in no operand"):
        partition.sharded(lambda x: (x,), in_factors=(("b",),), out_factors=(("b",),), parallel=("k",))
    f = partition.sharded(
        lambda x: (x,), in_factors=(("b", "t"),), out_factors=(("b", "t"),), parallel=("b",)
    )
    with pytest.raises(ValueError, match="has factors"):
        f(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("kernel", ["flash", "decode"])
def test_pallas_kernels_keep_sharding(kernel):
    """The Pallas kernels (interpret mode here; the same rule wraps the compiled ones)."""
    from pallas_kernels.attention import base, triton_decode, triton_flash  # noqa: PLC0415

    mesh = _mesh()
    q, k, v, _, _ = _inputs(2)
    if kernel == "decode":
        q = q[:, :4]
    spec = P("b", None, "h")
    module = {"flash": triton_flash, "decode": triton_decode}[kernel]

    def f(q, k, v):
        def loss(q, k, v):
            out, _ = module.attention(base.make_args(q, k, v, is_causal=kernel == "flash"), interpret=True)
            return (out**2).sum(), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    jf = jax.jit(f)
    hlo = jf.lower(put(q), put(k), put(v)).compile().as_text()
    assert "all-gather" not in hlo
    out, grads = jf(put(q), put(k), put(v))
    ref_out, ref_grads = jf(q, k, v)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("engine", ["auto", "xla", "pallas_interpret"])
@pytest.mark.parametrize("op", ["dyn_quant", "weight_only"])
def test_int4_keeps_row_and_feature_sharding(engine, op, axis_type):
    """int4 matmuls: x's rows (M) and the weight's output features (N) stay sharded, and so do the
    gradients of x, the scales and the bias (Explicit mode: the scales' gradient sums over x's
    sharded rows, which it refuses to leave implicit), with the unsharded call's values."""
    import jbackends.quantized as Q  # noqa: PLC0415

    t = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((4, 2), ("m", "n"), axis_types=(t, t))
    K, Nf, M, g = 256, 64, 16, 32
    w = normal(0, (Nf, K))
    qw, s = Q.quantize_4bit(w, g)
    p = Q.dyn_quant_pack_4bit_weight(qw, s, jnp.arange(Nf, dtype=jnp.float32), g, K, Nf)
    x = normal(1, (2, M, K))
    impl = None if engine == "auto" else engine
    if op == "dyn_quant":
        f = lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, Nf, implementation=impl)  # noqa: E731
    else:
        f = lambda x, p: Q.int4_matmul(x, p, implementation=impl)  # noqa: E731

    def run(x, p):
        y, vjp = jax.vjp(f, x, p)
        gx, gp = vjp(2 * jnp.sin(y))
        return y, gx, gp.scales, gp.bias

    xs = jax.device_put(x, NamedSharding(mesh, P(None, "m")))
    ps = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("n"))), p)
    jf = jax.jit(run)
    assert "all-gather" not in jf.lower(xs, ps).compile().as_text()
    got, ref = jf(xs, ps), jax.jit(run)(x, p)
    y, gx, gs, gb = got
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "m", "n")), 3)
    assert gx.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "m")), 3)
    assert gs.sharding.is_equivalent_to(NamedSharding(mesh, P("n")), 2)
    assert gb.sharding.is_equivalent_to(NamedSharding(mesh, P("n")), 1)
    for a, r in zip(got, ref):
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(a), r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


def _int4_weight(K=128, Nf=16, g=32, bias=False):
    import jbackends.quantized as Q  # noqa: PLC0415

    qw, s = Q.quantize_4bit(normal(3, (Nf, K)), g)
    b = jnp.linspace(-1, 1, Nf) if bias else None
    return qw, s, b, lambda s_: Q.dyn_quant_pack_4bit_weight(qw, s_, b, g, K, Nf)


_CPP = ("cpp",) if int4_cpp.available() else ()  # the C++ engine by name, where it is built

INT4_OPS = {
    "weight_only": lambda x, p, impl: jb.quantized.int4_matmul(x, p, implementation=impl),
    "dyn_quant": lambda x, p, impl: jb.quantized.dyn_quant_matmul_4bit(
        x, p, p.groupsize, p.in_features, p.out_features, implementation=impl
    ),
}


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="jax.set_mesh (Explicit meshes in force)")
@pytest.mark.parametrize(
    "how", ["device_put", pytest.param("numpy", marks=pytest.mark.extended), "mixed_mesh"]
)  # numpy operands take the device_put path's route once converted: the default run keeps two
def test_explicit_mesh_with_replicated_inputs(how):
    """Under `jax.set_mesh` with Explicit axes (all, or one beside an Auto axis), replicated (or
    numpy) operands run every kernel replicated, with the unsharded values: jax 0.12 refused the
    custom-partitioning call there ("No registered implementation for untyped custom call to
    Sharding")."""
    if how == "mixed_mesh":
        AT = jax.sharding.AxisType
        mesh = jax.make_mesh((4, 2), ("b", "h"), axis_types=(AT.Explicit, AT.Auto))
    else:
        mesh = _mesh("Explicit")
    q, k, v, _, _ = _inputs(2)
    x = normal(4, (4, 8, 128))
    packed = _int4_weight(bias=True)[3](_int4_weight()[1])
    attn_ref = {}
    for name in ("flash_cpp", "flash_xla", "efficient"):
        attn_ref[name] = _call(name, False)(q, k, v, None, None)
    int4_ref = {
        (op, impl): jax.jit(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(f(x, packed, impl)))))(x)
        for op, f in INT4_OPS.items()
        for impl in (None, "xla") + _CPP
    }
    with jax.set_mesh(mesh):
        put = np.asarray if how == "numpy" else (lambda a: jax.device_put(a, P()))
        for name, ref in attn_ref.items():
            out, _, grads = jax.jit(_call(name, False))(put(q), put(k), put(v), None, None)
            assert out.sharding.spec == P(None, None, None, None), (name, out.sharding)
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), rtol=2e-5, atol=2e-5)
            for g, r in zip(grads[:3], ref[2][:3]):
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
        for (op, impl), (ref_l, ref_g) in int4_ref.items():
            f = INT4_OPS[op]
            l, g = jax.jit(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(f(x, packed, impl)))))(put(x))
            assert g.sharding.spec == P(None, None, None), (op, impl, g.sharding)
            np.testing.assert_allclose(float(l), float(ref_l), rtol=1e-5)
            np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", list(INT4_OPS))
def test_int4_inside_shard_map_with_a_replicated_weight(op):
    """Inside `shard_map` (vma checked, JAX's default): the default dispatch (whose GPU branch is
    traced too) runs; the product of split rows varies over the split, so ``out_specs=P()`` is
    refused rather than keeping one device's rows; and the gradient of the weight that is the same
    on every device sums the devices' parts, as JAX's autodiff of the plain product does."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    qw, s, b, pack = _int4_weight(bias=True)
    x = normal(5, (8, 4, 128))
    f = INT4_OPS[op]
    fwd = jax.jit(
        jax.shard_map(lambda x, p: f(x, p, None), mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    )
    want = np.asarray(f(x, pack(s), None))  # weight-only: the kernel for 4 rows, not 32, sums in its order
    np.testing.assert_allclose(np.asarray(fwd(x, pack(s))), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    for impl in (None,) + _CPP:
        bad = jax.shard_map(lambda x, p: f(x, p, impl), mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
        with pytest.raises(ValueError, match="(?i)vary|varying|out_specs"):
            jax.jit(bad)(x, pack(s))

    def loss(x, s_):
        return jnp.sum(jnp.sin(f(x, pack(s_), None)))

    grads = jax.jit(
        jax.shard_map(
            jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P())
        )
    )(x, s)
    want = jax.grad(loss, argnums=(0, 1))(x, s)
    for g, w in zip(grads, want):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


@pytest.mark.parametrize("name", ["flash_cpp", "flash_xla", "efficient"])
def test_fused_backward_inside_shard_map_with_replicated_keys(name):
    """Queries split along the sequence inside `shard_map`, keys and values the same on every
    device: the fused backward's dk / dv are per-device parts, summed across the devices as
    jax.nn's autodiff sums them (JAX refused the custom_vjp's output type before)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v, _, _ = _inputs(6)
    q = jnp.concatenate([q, q], axis=1)  # T = 80: ten rows per device
    cfg = dict(BACKENDS[name])
    backends = cfg.pop("backends")

    def grads(attn):
        def body(q, k, v):
            return jax.grad(lambda *a: jnp.sum(jnp.sin(attn(*a))), argnums=(0, 1, 2))(q, k, v)

        spec = P(None, "d")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P(), P())))(
            q, k, v
        )

    def ours(q, k, v):
        with jb.sdpa_kernel(backends), jb.with_backends(**cfg):
            return jb.dot_product_attention(q, k, v)

    want = grads(jax.nn.dot_product_attention)
    for g, w in zip(grads(ours), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# ---- sequence parallelism (a ring over the devices that split the sequence) ----------------------


def _ring_call(name, causal):
    cfg = dict(BACKENDS[name])
    backends = cfg.pop("backends")

    def f(q, k, v):
        def loss(q, k, v):
            with jb.sdpa_kernel(backends), jb.with_backends(**cfg):
                out = jb.dot_product_attention(q, k, v, is_causal=causal)
            return (out**2).sum(), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return jax.jit(f)


@pytest.mark.parametrize(
    "axis_type, logits", [("Auto", "ordinary"), ("Explicit", "ordinary"), ("Explicit", "large")]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["flash_cpp", "flash_xla"])
def test_sequence_split_runs_a_ring(name, causal, axis_type, logits):
    """q / k / v split along the sequence on 8 devices: a ring of kernel calls, no gather. "large":
    every logit ~400 (a common offset on one feature), so the backward's rows have |lse2| >= 256,
    where the fused kernels recompute exact softmax statistics: a ring's per-shard backward must
    keep the global lse (a shard's own statistics normalised P over its keys only)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    keys = seeds(3, 3)
    q = normal(keys[0], (2, 64, 4, 16))
    k = normal(keys[1], (2, 64, 2, 16))  # GQA: 2 query heads per kv head
    v = normal(keys[2], (2, 64, 2, 16))
    if logits == "large":
        q, k = q.at[..., 0].set(40.0), k.at[..., 0].set(40.0)
    spec = NamedSharding(mesh, P(None, "d"))
    put = lambda x: jax.device_put(x, spec)  # noqa: E731
    f = _ring_call(name, causal)
    hlo = f.lower(put(q), put(k), put(v)).compile().as_text()
    assert "all-gather" not in hlo and "collective-permute" in hlo
    out, grads = f(put(q), put(k), put(v))
    from pallas_kernels.attention import base  # noqa: PLC0415

    args = base.make_args(q, k, v, is_causal=causal)

    def ref_loss(q, k, v):
        out, _ = base.reference(args.replace(q=q, k=k, v=v))
        return (out**2).sum(), out

    (_, ref_out), ref_grads = jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert out.sharding.is_equivalent_to(spec, 4)
    # Logits of ~400 are float32 numbers with ulp 3e-5: P carries ~1e-5 relative error either way.
    large = logits == "large"
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=3e-4 if large else 1e-5)
    for g, r in zip(grads, ref_grads):
        assert g.sharding.is_equivalent_to(spec, 4)
        atol = 1e-3 * float(jnp.abs(r).max()) if large else 1e-4
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=atol)


def test_sequence_split_memory_per_device_at_32k():
    """The ring's per-device temporary memory at L=32k is <= 1/4 of the unsharded flash call's
    (compiled ``memory_analysis``; the blockwise XLA engine, whose buffers XLA sees)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    L = 32768

    def grads(q, k, v):
        def loss(q, k, v):
            with jb.sdpa_kernel([jb.SDPBackend.FLASH_ATTENTION]), jb.with_backends(flash_cpu_kernel="xla"):
                return (jb.dot_product_attention(q, k, v, is_causal=True) ** 2).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def temp(spec):
        s = jax.ShapeDtypeStruct((1, L, 8, 64), jnp.float32, sharding=NamedSharding(mesh, spec))
        return jax.jit(grads).lower(s, s, s).compile().memory_analysis().temp_size_in_bytes

    whole, split = temp(P()), temp(P(None, "d"))
    assert split <= whole / 4, (split / 2**20, whole / 2**20)


def test_ring_is_chosen_only_where_it_applies():
    from pallas_kernels.attention import base, sharded  # noqa: PLC0415

    q = jnp.zeros((1, 16, 2, 8))
    assert sharded.ring_supported(base.make_args(q, q, q, is_causal=True))
    assert not sharded.ring_supported(base.make_args(q, q[:, :8], q[:, :8]))  # T != S
    assert not sharded.ring_supported(base.make_args(q, q, q, is_causal=True, diag_offset=3))
    assert not sharded.ring_supported(base.make_args(q, q, q, window=(4, 0)))
    assert not sharded.ring_supported(base.make_args(q, q, q, kv_seq_lengths=jnp.array([9])))


def test_causal_ring_with_an_odd_chunk_gathers_instead():
    """8 devices, L=40: chunks of 5 rows cannot be cut in two for the zigzag layout."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    q = normal(4, (1, 40, 2, 8))
    x = jax.device_put(q, NamedSharding(mesh, P(None, "d")))
    f = _ring_call("flash_xla", True)
    assert "collective-permute" not in f.lower(x, x, x).compile().as_text()
    out, _ = f(x, x, x)
    ref, _ = f(q, q, q)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_explain_says_how_a_sharded_call_runs():
    mesh = jax.make_mesh((2, 4), ("dp", "sp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    q = jax.ShapeDtypeStruct((2, 4096, 8, 64), jnp.float32, sharding=NamedSharding(mesh, P("dp", "sp")))
    e = jb.explain(q, q, q, is_causal=True)
    assert e.sharding == (
        "batch split over dp (no collective); sequence split over sp: a ring of 4 "
        "steps (causal: load-balanced zigzag)"
    )
    assert "sharding: batch split over dp" in str(e)
    e = jb.explain(q, q, q, is_causal=True, local_window_size=(64, 0))
    assert "sequence split over sp: gathered along the sequence" in e.sharding
    qt = jax.ShapeDtypeStruct(
        (2, 8, 4096, 64), jnp.float32, sharding=NamedSharding(mesh, P("dp", None, "sp"))
    )  # torch layout
    assert jb.explain(qt, qt, qt, api="sdpa").sharding.endswith("a ring of 4 steps")
    with jb.sdpa_kernel([jb.SDPBackend.MATH]):
        assert "XLA" in jb.explain(q, q, q).sharding
    x = jnp.zeros((1, 8, 2, 4))
    assert jb.explain(x, x, x).sharding is None


# ---- the GPU lane: the same rules lowered for and run on a GPU ------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_gpu_attention_keeps_batch_sharding(backend):
    """On every local GPU (one is enough to prove the partitioning rules lower for CUDA), a
    batch-sharded bf16 call keeps its sharding, with no all-gather, forward and gradients."""
    devices = jax.devices("gpu")
    mesh = jax.sharding.Mesh(np.array(devices), ("b",))
    n = len(devices)
    keys = seeds(0, 3)
    q, k, v = (normal(kk, (2 * n, 256, 4, 64), jnp.bfloat16) for kk in keys)

    def f(q, k, v):
        def loss(q, k, v):
            with jb.sdpa_kernel([getattr(jb.SDPBackend, backend)]):
                out = jb.dot_product_attention(q, k, v, is_causal=True)
            return (out.astype(jnp.float32) ** 2).sum(), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    sharding = NamedSharding(mesh, P("b"))
    put = lambda x: jax.device_put(x, sharding)  # noqa: E731
    jf = jax.jit(f)
    assert "all-gather" not in jf.lower(put(q), put(k), put(v)).compile().as_text()
    out, grads = jf(put(q), put(k), put(v))
    ref_out, ref_grads = jf(q, k, v)
    for got, want in zip((out, *grads), (ref_out, *ref_grads)):
        assert got.sharding.is_equivalent_to(sharding, 4)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
        )


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["dyn_quant", "weight_only"])
def test_gpu_int4_keeps_row_sharding(op):
    """The Pallas int4 kernels on every local GPU: x's rows stay sharded, no all-gather."""
    import jbackends.quantized as Q  # noqa: PLC0415

    devices = jax.devices("gpu")
    mesh = jax.sharding.Mesh(np.array(devices), ("m",))
    K, Nf, g = 512, 256, 32
    qw, s = Q.quantize_4bit(normal(0, (Nf, K)), g)
    p = Q.dyn_quant_pack_4bit_weight(qw, s, None, g, K, Nf)
    x = normal(1, (16 * len(devices), K))
    if op == "dyn_quant":
        f = lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, Nf, implementation="pallas")  # noqa: E731
    else:
        f = lambda x, p: Q.int4_matmul(x, p, implementation="pallas")  # noqa: E731
    sharding = NamedSharding(mesh, P("m"))
    xs = jax.device_put(x, sharding)
    jf = jax.jit(f)
    assert "all-gather" not in jf.lower(xs, p).compile().as_text()
    y = jf(xs, p)
    assert y.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jf(x, p)), rtol=1e-5, atol=1e-5)
