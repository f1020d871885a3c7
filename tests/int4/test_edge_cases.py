"""Bad and unusual inputs, answered the same way on every engine.

* NaN / inf in an activation row: torch's x86 kernel, emulated below line by line from its C++
  (``ref_dyn_quant_matmul_4bit_{channelwise,groupwise}_kernel``), is the contract.
* ``jax.grad`` through the dynamic-quant matmul: the straight-through gradient on every engine.
* ``jb.nn.quantize_4bit`` / `Int4Linear`: arguments validated up front; the layer's dtype kept.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jbackends as jb
import jbackends.quantized as Q
from jbackends._src import nn_int4
from pallas_kernels.int4_matmul import base, cpp

from tests.int4.int4_base import make_case

ENGINES = ["xla", "reference", "pallas_interpret"] + (["cpp"] if cpp.available() else [])
F32 = np.float32
INT_MIN = -(2**31)


# ------------------------------------------------------------- torch's x86 kernel, in Python


def _wrap32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def _cvt(v) -> int:
    """(int32_t) of an integral float on x86: NaN, inf and out-of-range are INT32_MIN."""
    v = float(v)
    return int(v) if math.isfinite(v) and -(2**31) <= v < 2**31 else INT_MIN


def _round_away(v):
    """std::round (half away from zero); float32 values are exact in double, so is ``|v| + 0.5``."""
    v = float(v)
    return math.copysign(math.floor(abs(v) + 0.5), v) if math.isfinite(v) else v


def _cmax(a, b):  # (std::max)(a, b)
    return b if a < b else a


def _cmin(a, b):  # (std::min)(a, b)
    return b if b < a else a


def _torch_quantize_row(row, channelwise, skip_nan=False):
    """skip_nan: torch's bfloat16 kernel, whose range scan keeps its running value over a NaN."""
    max0, min0 = F32(np.finfo(F32).max) * F32(-1), F32(np.finfo(F32).max)
    for v in row:
        if skip_nan and math.isnan(v):
            continue
        max0 = _cmax(F32(v), max0)
        min0 = _cmin(F32(v), min0)
    qmin, qmax = F32(-128), F32(127)
    rmin, rmax = _cmin(F32(0), min0), _cmax(F32(0), max0)
    with np.errstate(all="ignore"):
        scale = F32(1) if rmin == rmax else F32((qmax - qmin) / F32(rmax - rmin))
        recip = F32(F32(1) / scale) if scale else F32(0)
        dmin, dmax = F32(rmin * scale), F32(rmax * scale)
        if channelwise:
            from_min = F32(F32(qmin + dmin) + F32(qmax + dmax)) > 0
        else:
            from_min = F32(F32(F32(qmin + dmin) + qmax) + dmax) > 0
        zpf = F32(qmin - dmin) if from_min else F32(qmax - dmax)
        zpf = _cmin(_cmax(zpf, qmin), qmax)
        # int32_t zp = lrintf(zpf): ties to even; a 64-bit long on x86-64, whose NaN answer
        # 0x8000000000000000 keeps 0 in its low 32 bits
        zp = _cvt(np.rint(zpf)) if not math.isnan(zpf) else 0
        qa = [max(min(_wrap32(_cvt(_round_away(F32(F32(v) * scale))) + zp), 127), -128) for v in row]
    return qa, zp, recip


def _bits_equal(got, want, err_msg=""):
    """Bit for bit (``assert_array_equal`` takes -0.0 for 0.0 and any NaN for any other)."""
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    assert got.shape == want.shape, (got.shape, want.shape, err_msg)
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), (err_msg, np.argwhere(bad)[:5].tolist(), got[bad][:5], want[bad][:5])


def _torch_dyn_quant_matmul(x, q, scales, groupsize, skip_nan=False):
    """torch's reference kernels, without a bias."""
    M, K = x.shape
    N = q.shape[0]
    channelwise = groupsize == K
    out = np.zeros((M, N), F32)
    for m in range(M):
        qa, zp, recip = _torch_quantize_row(x[m], channelwise, skip_nan)
        qa = np.asarray(qa, np.int64)
        for n in range(N):
            if channelwise:
                iacc = _wrap32(int(np.dot(qa - zp, q[n])))
                with np.errstate(over="ignore"):
                    acc = F32(F32(iacc) * scales[n, 0])
            else:
                acc = F32(0)
                for g in range(K // groupsize):
                    sl = slice(g * groupsize, (g + 1) * groupsize)
                    iacc = _wrap32(int(np.dot(qa[sl] - zp, q[n, sl])))
                    with np.errstate(over="ignore", invalid="ignore"):
                        acc = F32(acc + F32(F32(iacc) * scales[n, g]))
            with np.errstate(all="ignore"):
                acc = F32(acc * recip)
            out[m, n] = min(max(acc, -np.finfo(F32).max), np.finfo(F32).max)
    return out


def _nonfinite_rows(M, K, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, K)) * 2).astype(F32)
    x[0, 5] = np.nan  # NaN early: the range is the rest of the row
    x[1, K - 1] = np.nan  # NaN last: range [0, 0], scale 1
    x[2, 0] = np.nan  # NaN first
    x[3, 3] = np.nan
    x[3, K // 2] = np.nan
    x[3, K // 2 + 1 :] = np.abs(x[3, K // 2 + 1 :])  # zp < 0 after it
    x[3, 1] = 1e9  # before the last NaN, far outside the range seen
    x[4, 7] = np.inf  # +inf: scale 0
    x[5, 2] = -np.inf
    x[5, 9] = np.inf  # both: NaN zero point
    x[6] = np.nan  # all NaN
    return x


@pytest.mark.parametrize("K,g", [(128, 32), (128, 64), (96, 96), (128, 128), (384, 128)])
def test_nonfinite_rows_follow_torch_on_every_engine(K, g):
    M, N = 9, 12  # rows 7, 8 stay ordinary
    x = _nonfinite_rows(M, K, seed=K + g)
    w = np.random.default_rng(g).standard_normal((N, K)).astype(F32)
    q8, s = Q.quantize_4bit(jnp.asarray(w), g)
    p = Q.dyn_quant_pack_4bit_weight(q8, s, None, g, K, N)
    want = _torch_dyn_quant_matmul(x, np.asarray(base.unpack_nibbles(q8)), np.asarray(s), g)
    assert np.isfinite(want).all()
    for impl in ENGINES:
        if impl == "cpp" and K % 32:
            continue
        got = np.asarray(
            jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation=impl))(x, p)
        )
        _bits_equal(got, want, err_msg=impl)
    # the ordinary rows are ordinary: near the float64 product
    ref = x[7:].astype(np.float64) @ np.asarray(base.dequantize(q8, s, g), np.float64).T
    assert np.linalg.norm(want[7:] - ref) / np.linalg.norm(ref) < 0.1


@pytest.mark.parametrize("K,g", [(96, 96), (128, 128), (128, 32)])
def test_nonfinite_bfloat16_rows_follow_torchs_bfloat16_kernel(K, g):
    """bfloat16 input: torch's bfloat16 kernel leaves a NaN out of the row's range (its float32 kernel
    keeps only what follows the last NaN), on every engine; checked against torch itself where it
    has the op (channel-wise only there)."""
    M, N = 9, 12
    x = np.asarray(jnp.asarray(_nonfinite_rows(M, K, seed=K + g + 1), jnp.bfloat16).astype(jnp.float32))
    w = np.random.default_rng(g + 1).standard_normal((N, K)).astype(F32)
    q8, s = Q.quantize_4bit(jnp.asarray(w), g)
    p = Q.dyn_quant_pack_4bit_weight(q8, s, None, g, K, N)
    want = _torch_dyn_quant_matmul(x, np.asarray(base.unpack_nibbles(q8)), np.asarray(s), g, skip_nan=True)
    want = np.asarray(base.truncate_to_bfloat16(jnp.asarray(want)).astype(jnp.float32))
    as_f32 = _torch_dyn_quant_matmul(x, np.asarray(base.unpack_nibbles(q8)), np.asarray(s), g)
    assert not np.array_equal(want[:4], np.asarray(base.truncate_to_bfloat16(jnp.asarray(as_f32[:4]))))
    xb = jnp.asarray(x, jnp.bfloat16)
    for impl in ENGINES:
        got = jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation=impl))(xb, p)
        assert got.dtype == jnp.bfloat16
        _bits_equal(np.asarray(got.astype(jnp.float32)), want, err_msg=impl)
    torch = pytest.importorskip("torch")
    if g != K or not hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit"):
        return
    tp = torch.ops.aten._dyn_quant_pack_4bit_weight(
        torch.tensor(np.asarray(q8)), torch.tensor(np.asarray(s, F32)), None, g, K, N
    )
    theirs = torch.ops.aten._dyn_quant_matmul_4bit(torch.tensor(x).bfloat16(), tp, g, K, N)
    _bits_equal(theirs.float().numpy(), want)


def test_nonfinite_rows_large_m_paths():
    """The prefill formulations (XLA GEMM form, Pallas fused tiles) agree with the decode ones."""
    K, N, g = 128, 16, 32
    x = np.concatenate([_nonfinite_rows(9, K, seed=s) for s in range(4)])  # 36 rows
    _, p = make_case(2, K, N, g, True)
    outs = {impl: np.asarray(Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation=impl)) for impl in ENGINES}
    for impl, got in outs.items():
        assert np.isfinite(got).all(), impl
        _bits_equal(got, outs["reference"], err_msg=impl)
    # row by row (the decode paths) gives the same numbers
    for r in range(0, 36, 7):
        _bits_equal(
            np.asarray(Q.dyn_quant_matmul_4bit(x[r : r + 1], p, g, K, N, implementation="xla")),
            outs["xla"][r : r + 1],
        )


def test_torch_emulation_matches_on_finite_rows():
    """The Python emulation of torch is itself checked against the reference on ordinary data."""
    x, p = make_case(3, 128, 8, 32, False)
    want = _torch_dyn_quant_matmul(
        np.asarray(x), np.asarray(base.unpack_nibbles(p.weight)), np.asarray(p.scales), 32
    )
    np.testing.assert_array_equal(np.asarray(base.dyn_quant_matmul(x, p)), want)


def test_nan_semantics_in_docstring():
    doc = " ".join(Q.dyn_quant_matmul_4bit.__doc__.split())
    assert "the elements after the row's last NaN" in doc and "straight-through estimator" in doc
    assert "its elements other than NaN (bfloat16" in doc


@pytest.mark.parametrize("scale", [1.0, 3e38])
def test_infinite_range_without_a_bias_follows_torch_bit_for_bit(scale):
    """A row holding an infinity has scale 0 and a NaN zero point, which torch's ``lrintf`` (a 64-bit
    long) turns into 0: its output is a signed 0 whose sign the group sums decide, or NaN where a
    sum times a scale near the float32 maximum overflows (inf * 0). On every engine, bit for bit
    with the emulation, and with torch itself where it is installed."""
    K, N, g = 64, 8, 64
    rng = np.random.default_rng(0)
    q8, s = Q.quantize_4bit(jnp.asarray(rng.standard_normal((N, K)).astype(F32)), g)
    s = np.asarray(s) * 0 + F32(scale) if scale != 1.0 else np.asarray(s)
    p = Q.dyn_quant_pack_4bit_weight(q8, jnp.asarray(s), None, g, K, N)
    x = rng.standard_normal((3, K)).astype(F32)
    x[0, 10] = np.inf
    x[1, 3] = -np.inf
    x[2, [1, 7]] = [np.inf, -np.inf]
    want = _torch_dyn_quant_matmul(x, np.asarray(base.unpack_nibbles(q8)), s, g)
    signs = np.signbit(want[np.isfinite(want)])
    if scale == 1.0:
        assert (want == 0).all() and signs.any() and not signs.all()  # both signs: the test can fail
    else:
        assert np.isnan(want).any()
    for impl in ENGINES:
        _bits_equal(Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation=impl), want, err_msg=impl)
    torch = pytest.importorskip("torch")
    if not hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit"):
        pytest.skip("this torch has no _dyn_quant_matmul_4bit")
    tp = torch.ops.aten._dyn_quant_pack_4bit_weight(
        torch.tensor(np.asarray(q8)), torch.tensor(np.asarray(s, F32)), None, g, K, N
    )
    _bits_equal(torch.ops.aten._dyn_quant_matmul_4bit(torch.tensor(x), tp, g, K, N).numpy(), want)


def test_infinite_range_gives_the_bias():
    K, N, g = 64, 8, 32
    x = _nonfinite_rows(9, K)
    _, p = make_case(2, K, N, g, True)
    for impl in ENGINES:
        got = np.asarray(Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation=impl))
        np.testing.assert_array_equal(got[[4, 5]], np.broadcast_to(np.asarray(p.bias), (2, N)), err_msg=impl)


# ------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("impl", ENGINES + [None])
def test_dyn_quant_grad_is_straight_through_on_every_engine(impl):
    M, K, N, g = 3, 128, 16, 32
    x, p = make_case(M, K, N, g, True, lead=(2,))

    def loss(x, s, b):
        pp = Q.PackedInt4Weight(p.weight, s, b, g, K, N)
        return jnp.sum(jnp.sin(Q.dyn_quant_matmul_4bit(x, pp, g, K, N, implementation=impl)))

    dx, ds, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, p.scales, p.bias)
    # float64: the cotangent of the (int8-quantized) output, pulled back through x @ dequantize(w).T + b
    y = np.asarray(Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation="reference"), np.float64)
    gy = np.cos(y).reshape(-1, N)
    q = np.asarray(base.unpack_nibbles(p.weight), np.float64)
    w = (q.reshape(N, K // g, g) * np.asarray(p.scales, np.float64)[..., None]).reshape(N, K)
    xf = np.asarray(x, np.float64).reshape(-1, K)
    want_dx = (gy @ w).reshape(x.shape)
    want_ds = ((gy.T @ xf) * q).reshape(N, K // g, g).sum(-1)
    want_db = gy.sum(0)
    for got, want in ((dx, want_dx), (ds, want_ds), (db, want_db)):
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max()
        )


def test_dyn_quant_grad_bfloat16_and_layer():
    """bf16 input gets a bf16 gradient; a dyn_quant Int4Linear trains the layers before it."""
    x, p = make_case(4, 64, 8, 32, True)
    dx = jax.grad(lambda x: Q.dyn_quant_matmul_4bit(x, p, 32, 64, 8).astype(jnp.float32).sum())(
        x.astype(jnp.bfloat16)
    )
    assert dx.dtype == jnp.bfloat16
    want = np.asarray(Q.dequantize_4bit(p), np.float64).sum(0)
    np.testing.assert_allclose(
        np.asarray(dx, np.float64), np.broadcast_to(want, dx.shape), rtol=1e-2, atol=1e-2
    )
    r = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(16, 64, rngs=r), nnx.Linear(64, 8, rngs=r))
    model.layers[1] = nn_int4.Int4Linear.from_linear(model.layers[1], 32, mode="dyn_quant")
    xin = jax.random.normal(jax.random.key(0), (5, 16))
    grads = nnx.grad(lambda m: jnp.sum(m(xin) ** 2))(model)
    gk = grads.layers[0].kernel[...]
    assert gk.shape == (16, 64) and float(jnp.abs(gk).max()) > 0


# ------------------------------------------------------------------------ jb.nn.quantize_4bit


def _two_layers():
    r = nnx.Rngs(0)
    return nnx.Sequential(nnx.Linear(96, 64, rngs=r), nnx.relu, nnx.Linear(64, 8, rngs=r))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(groupsize=0), ValueError, "groupsize must be a positive multiple of 32, got groupsize=0"),
        (dict(groupsize=-32), ValueError, "groupsize must be a positive multiple of 32"),
        (dict(groupsize=48), ValueError, "groupsize must be a positive multiple of 32, got groupsize=48"),
        (dict(groupsize=32.0), TypeError, "groupsize must be an int"),
        (dict(groupsize=True), TypeError, "groupsize must be an int"),
        (dict(groupsize=32, mode="int8"), ValueError, "mode must be one of"),
        (dict(groupsize=32, compute_dtype=jnp.int8), TypeError, "compute_dtype must be None or float32"),
        (dict(groupsize=32, filter="layers"), TypeError, "filter must be None or a callable"),
        (dict(groupsize=32, channelwise_fallback="no"), TypeError, "channelwise_fallback must be a bool"),
    ],
)
def test_quantize_model_validates_up_front(kwargs, error, match):
    model = _two_layers()
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(error, match=match):
        jb.nn.quantize_4bit(model, **kwargs)
    assert isinstance(model.layers[0], nnx.Linear) and isinstance(model.layers[2], nnx.Linear)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(model)))


@pytest.mark.parametrize(
    "bad", [{"w": np.ones((4, 4))}, np.ones((4, 4)), None, [nnx.Linear(32, 4, rngs=nnx.Rngs(0))]]
)
def test_quantize_model_refuses_a_non_module(bad):
    with pytest.raises(TypeError, match="model must be a flax nnx.Module"):
        jb.nn.quantize_4bit(bad, groupsize=32)


def test_quantize_model_all_or_nothing():
    """A layer that cannot be quantized leaves every layer as it was."""
    r = nnx.Rngs(0)
    model = nnx.Sequential(
        nnx.Linear(64, 128, rngs=r), nnx.Linear(128, 96, rngs=r), nnx.Linear(96, 4, rngs=r)
    )
    with pytest.raises(ValueError, match="layers/2: groupsize=64 does not divide in_features=96"):
        jb.nn.quantize_4bit(model, groupsize=64, channelwise_fallback=False)
    assert all(isinstance(l, nnx.Linear) for l in model.layers)
    odd = nnx.Sequential(nnx.Linear(64, 33, rngs=r), nnx.Linear(33, 4, rngs=r))
    with pytest.raises(ValueError, match="in_features is odd"):
        jb.nn.quantize_4bit(odd, groupsize=32)
    assert isinstance(odd.layers[0], nnx.Linear)


def test_quantize_model_groupsize_per_layer_and_numbers():
    model = _two_layers()
    x = jax.random.normal(jax.random.key(2), (4, 96))
    wants = [np.asarray(l.kernel[...], np.float64) for l in (model.layers[0], model.layers[2])]
    q = jb.nn.quantize_4bit(model, groupsize=64)  # 96 % 64: channel-wise (documented fallback)
    assert (q.layers[0].groupsize, q.layers[2].groupsize) == (96, 64)
    for layer, w in zip((q.layers[0], q.layers[2]), wants):
        deq = np.asarray(Q.dequantize_4bit(layer.packed), np.float64).T
        assert np.abs(deq - w).max() <= np.abs(w).max() / 7 / 2 * 1.0001  # half a step of the coarsest scale
    h = np.maximum(
        np.asarray(x, np.float64) @ np.asarray(Q.dequantize_4bit(q.layers[0].packed), np.float64).T
        + np.asarray(q.layers[0].bias[...], np.float64),
        0,
    )
    want = h @ np.asarray(Q.dequantize_4bit(q.layers[2].packed), np.float64).T + np.asarray(
        q.layers[2].bias[...]
    )
    np.testing.assert_allclose(np.asarray(q(x), np.float64), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_quantize_model_replaces_a_shared_layer_at_every_path():
    """A layer reachable by several paths (weight tying, a Sequential, an nnx.Dict / nnx.List) is
    replaced at each by one Int4Linear: the tying survives, and no float weight is left behind."""

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(64, 64, rngs=rngs)
            self.dec = self.enc
            self.seq = nnx.Sequential(self.enc, nnx.relu)
            self.d = nnx.Dict({"a": self.enc})
            self.l = nnx.List([self.enc, nnx.Linear(64, 32, rngs=rngs)])

        def __call__(self, x):
            return self.l[1](self.d["a"](self.seq(self.dec(self.enc(x)))))

    model = Tied(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 64))
    q = jb.nn.quantize_4bit(model, groupsize=32)
    shared = (q.enc, q.dec, q.seq.layers[0], q.d["a"], q.l[0])
    assert isinstance(q.enc, jb.nn.Int4Linear) and all(layer is q.enc for layer in shared)
    assert isinstance(q.l[1], jb.nn.Int4Linear) and q.l[1] is not q.enc
    assert jax.tree.leaves(nnx.state(q, nnx.Param)) == []
    w = np.asarray(Q.dequantize_4bit(q.enc.packed), np.float64).T
    b = np.asarray(q.enc.bias[...], np.float64)
    h = np.asarray(x, np.float64)
    h = np.maximum(((h @ w + b) @ w + b) @ w + b, 0) @ w + b  # enc, dec, seq (with its relu), d["a"]
    want = h @ np.asarray(Q.dequantize_4bit(q.l[1].packed), np.float64).T + np.asarray(q.l[1].bias[...])
    np.testing.assert_allclose(np.asarray(q(x), np.float64), want, rtol=0, atol=1e-4 * np.abs(want).max())
    # A filter decides for a shared layer by every path to it: refusing one path keeps it float at all.
    kept = jb.nn.quantize_4bit(Tied(nnx.Rngs(0)), groupsize=32, filter=lambda path, lin: path != ("dec",))
    assert type(kept.enc) is nnx.Linear and kept.dec is kept.enc and kept.l[0] is kept.enc
    assert isinstance(kept.l[1], jb.nn.Int4Linear)


def test_quantize_model_reaches_layers_in_plain_containers():
    """Layers held in plain containers (`nnx.data` of a dict, a tuple, a namedtuple, nested) are
    converted like attributes, a tuple rebuilt where it was held; a layer shared with an attribute
    stays one layer."""
    import collections

    Pair = collections.namedtuple("Pair", "first second")

    class Held(nnx.Module):
        def __init__(self, rngs):
            self.enc = nnx.Linear(64, 64, rngs=rngs)
            self.d = nnx.data({"a": nnx.Linear(64, 64, rngs=rngs), "t": (self.enc, 3)})
            self.t = nnx.data((nnx.Linear(64, 64, rngs=rngs), (nnx.Linear(64, 64, rngs=rngs),)))
            self.p = nnx.data(Pair(nnx.Linear(64, 32, rngs=rngs), "name"))
            self.u = nnx.data(self.t)  # one tuple held at two attributes

        def __call__(self, x):
            h = self.d["t"][0](self.d["a"](self.enc(x)))
            return self.p.first(self.t[1][0](self.t[0](h)))

    model = Held(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 64))
    q = jb.nn.quantize_4bit(model, groupsize=32)
    layers = (q.enc, q.d["a"], q.d["t"][0], q.t[0], q.t[1][0], q.p.first)
    assert all(isinstance(layer, jb.nn.Int4Linear) for layer in layers)
    assert q.d["t"][0] is q.enc and q.d["t"][1] == 3 and isinstance(q.p, Pair) and q.p.second == "name"
    assert q.u[0] is q.t[0] and q.u[1][0] is q.t[1][0]
    assert jax.tree.leaves(nnx.state(q, nnx.Param)) == []
    h = np.asarray(x, np.float64)
    for layer in (q.enc, q.d["a"], q.enc, q.t[0], q.t[1][0], q.p.first):
        w = np.asarray(Q.dequantize_4bit(layer.packed), np.float64).T
        h = h @ w + np.asarray(layer.bias[...], np.float64)
    np.testing.assert_allclose(np.asarray(q(x), np.float64), h, rtol=0, atol=1e-4 * np.abs(h).max())


def test_quantize_model_names_a_stacked_layer():
    """Layers stacked by nnx.vmap (for nnx.scan) have a 3-D kernel: a ValueError naming the layer and
    the way out, and the model unchanged (not a weight-shape error from inside the packing)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return nnx.Linear(64, 32, rngs=nnx.Rngs(key))

    class Stacked(nnx.Module):
        def __init__(self):
            self.head = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
            self.blocks = make(jax.random.split(jax.random.key(0), 3))

    model = Stacked()
    with pytest.raises(ValueError, match=r"layer blocks: kernel has shape \(3, 64, 32\).*stacked.*filter"):
        jb.nn.quantize_4bit(model, groupsize=32)
    assert type(model.head) is nnx.Linear and type(model.blocks) is nnx.Linear
    q = jb.nn.quantize_4bit(model, groupsize=32, filter=lambda path, lin: path != ("blocks",))
    assert isinstance(q.head, jb.nn.Int4Linear) and type(q.blocks) is nnx.Linear


# ----------------------------------------------------------------------------- Int4Linear dtypes


@pytest.mark.parametrize("mode", ["weight_only", "dyn_quant"])
@pytest.mark.parametrize(
    "dtype,param_dtype,x_dtype",
    [
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
        (jnp.bfloat16, jnp.float32, jnp.float32),
        (None, jnp.bfloat16, jnp.bfloat16),
        (None, jnp.bfloat16, jnp.float32),
        (None, jnp.float32, jnp.bfloat16),
        (jnp.float16, jnp.float16, jnp.float32),
        (None, jnp.bfloat16, jnp.int32),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_int4_linear_keeps_the_layer_dtype(mode, dtype, param_dtype, x_dtype):
    lin = nnx.Linear(64, 16, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 64)) * 3
    x = x.astype(x_dtype)
    want = lin(x)
    q = jb.nn.quantize_4bit(lin, groupsize=32, mode=mode)
    got = q(x)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    w = np.asarray(Q.dequantize_4bit(q.packed), np.float64)
    ref = np.asarray(x.astype(want.dtype), np.float64) @ w.T + np.asarray(q.bias[...], np.float64)
    tol = 0.05 if mode == "dyn_quant" else (1e-5 if want.dtype == jnp.float32 else 2e-2)
    err = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
    assert err < tol, err


def test_int4_linear_validates_dtypes():
    _, p = make_case(1, 64, 8, 32, False)
    with pytest.raises(TypeError, match="dtype must be None or a floating dtype"):
        nn_int4.Int4Linear(p, dtype=jnp.int32)
    with pytest.raises(TypeError, match="compute_dtype must be None or float32, bfloat16, float16"):
        nn_int4.Int4Linear(p, compute_dtype="float64x")
    layer = nn_int4.Int4Linear(p)  # no float layer: the input's dtype, as before
    assert layer(jnp.ones((2, 64), jnp.bfloat16)).dtype == jnp.bfloat16
    assert layer(jnp.ones((2, 64), jnp.int32)).dtype == jnp.float32
