"""The reference (base.py) against an independent float64/int64 numpy computation, against torch's
own ops when torch is installed, the packing round trip, and the argument checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends.quantized as Q
from pallas_kernels.int4_matmul import base
from tests.int4.int4_base import make_case, reference

f32 = np.float32


def _np_round_away(v):
    return np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)


def numpy_dyn_quant(x, q, scales, g, bias):
    """torch's reference kernels written out in numpy: int64 integer math, float32 ops one at a time."""
    x = np.asarray(x, f32)
    M, K = x.shape
    N = q.shape[0]
    channelwise = g == K
    mn = np.minimum(f32(0), x.min(-1, initial=np.inf)).astype(f32)
    mx = np.maximum(f32(0), x.max(-1, initial=-np.inf)).astype(f32)
    with np.errstate(divide="ignore"):
        sc = np.where(mn == mx, f32(1), f32(255) / (mx - mn)).astype(f32)
    rec = (f32(1) / sc).astype(f32)
    dmin, dmax = (mn * sc).astype(f32), (mx * sc).astype(f32)
    if channelwise:
        cond = ((f32(-128) + dmin).astype(f32) + (f32(127) + dmax).astype(f32)).astype(f32) > 0
    else:
        cond = (((f32(-128) + dmin).astype(f32) + f32(127)).astype(f32) + dmax).astype(f32) > 0
    zp = np.where(cond, (f32(-128) - dmin).astype(f32), (f32(127) - dmax).astype(f32))
    zp = np.rint(np.clip(zp, -128, 127)).astype(np.int64)
    qa = np.clip(_np_round_away((x * sc[:, None]).astype(f32)).astype(np.int64) + zp[:, None], -128, 127)
    a = (qa - zp[:, None]).astype(np.float64)
    G = K // g
    isum = np.einsum("mgk,ngk->mng", a.reshape(M, G, g), q.reshape(N, G, g).astype(np.float64))
    assert np.all(isum == np.round(isum))  # float64 holds these integers exactly
    s = np.asarray(scales, f32)
    if channelwise:
        out = (isum[..., 0].astype(f32) * s[None, :, 0]).astype(f32)
    else:
        out = np.zeros((M, N), f32)
        for j in range(G):
            out = (out + (isum[..., j].astype(f32) * s[None, :, j]).astype(f32)).astype(f32)
    out = (out * rec[:, None]).astype(f32)
    if bias is not None:
        out = (out + np.asarray(bias, f32)).astype(f32)
    return out


@pytest.mark.parametrize(
    "M,K,N,g,bias",
    [
        (1, 256, 24, 32, True),
        (4, 192, 40, 64, False),
        (3, 384, 16, 128, True),
        (5, 96, 8, 96, True),
        (2, 48, 8, 48, False),
        (6, 96, 8, 96, False),
        (7, 320, 16, 64, True),
        (0, 64, 8, 32, True),
    ],
)
def test_reference_equals_numpy_float64(M, K, N, g, bias):
    x, p = make_case(M, K, N, g, bias)
    q = np.asarray(base.unpack_nibbles(p.weight))
    want = numpy_dyn_quant(np.asarray(x), q, p.scales, g, None if p.bias is None else np.asarray(p.bias))
    got = np.asarray(jax.jit(base.dyn_quant_matmul)(x, p))
    np.testing.assert_array_equal(got, want)


def test_quantize_pack_roundtrip():
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(6, 64))
    packed = base.pack_nibbles(jnp.asarray(q))
    assert packed.dtype == jnp.uint8 and packed.shape == (6, 32)
    # low nibble = even k, stored as q + 8
    np.testing.assert_array_equal(np.asarray(packed) & 15, q[:, 0::2] + 8)
    np.testing.assert_array_equal(np.asarray(packed) >> 4, q[:, 1::2] + 8)
    np.testing.assert_array_equal(np.asarray(base.unpack_nibbles(packed)), q)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    w[2] = 0
    for g in (32, 64, 128):
        pk, s = Q.quantize_4bit(w, g)
        qq = np.asarray(base.unpack_nibbles(pk))
        assert qq.min() >= -7 and qq.max() <= 7
        s = np.asarray(s)
        np.testing.assert_allclose(s, np.abs(w.reshape(6, -1, g)).max(-1) / 7, rtol=1e-7)
        back = np.asarray(base.dequantize(pk, s, g))
        step = np.repeat(s, g, axis=1)
        assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-6))
        assert np.all(back[2] == 0)
        p = Q.dyn_quant_pack_4bit_weight(pk, s, None, g, 128, 6)
        np.testing.assert_array_equal(np.asarray(Q.dequantize_4bit(p)), back)
        assert p.nbytes == 6 * 64 + s.size * 4


def test_round_half_up_ties():
    # w / scale = 0.5 exactly rounds up (torch's rule), -0.5 rounds up to 0.
    w = jnp.asarray([[3.5, -3.5, 7.0, -7.0] + [0.0] * 28], jnp.float32)
    q = np.asarray(base.unpack_nibbles(base.quantize_4bit(w, 32)[0]))[0, :4]
    np.testing.assert_array_equal(q, [4, -3, 7, -7])


def test_weight_only_reference_matches_dequant():
    x, p = make_case(5, 128, 16, 32, True)
    w = np.asarray(base.dequantize(p.weight, p.scales, 32), np.float64)
    want = np.asarray(x, np.float64) @ w.T + np.asarray(p.bias, np.float64)
    np.testing.assert_allclose(np.asarray(base.weight_only_matmul(x, p)), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------- torch


try:
    import torch  # noqa: F811

    _HAS_TORCH_OPS = hasattr(torch.ops.aten, "_dyn_quant_matmul_4bit")
except ImportError:  # torch is optional
    torch = None
    _HAS_TORCH_OPS = False


@pytest.mark.skipif(not _HAS_TORCH_OPS, reason="torch with _dyn_quant_matmul_4bit not installed")
@pytest.mark.parametrize(
    "M,K,N,g,bias",
    [(3, 256, 40, 32, True), (4, 384, 24, 128, False), (2, 192, 16, 192, True), (1, 128, 48, 64, True)],
)
def test_reference_bit_exact_with_torch(M, K, N, g, bias):
    x, p = make_case(M, K, N, g, bias)
    channelwise = g == K
    # torch: float32 scales channel-wise, bfloat16 group-wise
    s = p.scales if channelwise else p.scales.astype(jnp.bfloat16).astype(jnp.float32)
    p = base.PackedInt4Weight(p.weight, s, p.bias, g, K, N)
    ts = torch.tensor(np.asarray(s))
    if not channelwise:
        ts = ts.to(torch.bfloat16)
    tb = None if p.bias is None else torch.tensor(np.asarray(p.bias))
    tp = torch.ops.aten._dyn_quant_pack_4bit_weight(torch.tensor(np.asarray(p.weight)), ts, tb, g, K, N)
    want = torch.ops.aten._dyn_quant_matmul_4bit(torch.tensor(np.asarray(x)), tp, g, K, N).numpy()
    np.testing.assert_array_equal(np.asarray(reference(x, p)), want)
    # and through the public API with torch's argument order
    jp = Q.dyn_quant_pack_4bit_weight(
        p.weight, jnp.asarray(s).astype(jnp.bfloat16) if not channelwise else s, p.bias, g, K, N
    )
    got = jax.jit(lambda x, jp: Q.dyn_quant_matmul_4bit(x, jp, g, K, N))(x, jp)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.skipif(not _HAS_TORCH_OPS, reason="torch with _dyn_quant_matmul_4bit not installed")
def test_bfloat16_channelwise_bit_exact_with_torch():
    M, K, N = 3, 128, 24
    x, p = make_case(M, K, N, K, True)
    xb = x.astype(jnp.bfloat16)
    tp = torch.ops.aten._dyn_quant_pack_4bit_weight(
        torch.tensor(np.asarray(p.weight)),
        torch.tensor(np.asarray(p.scales)),
        torch.tensor(np.asarray(p.bias)),
        K,
        K,
        N,
    )
    tx = torch.tensor(np.asarray(x)).to(torch.bfloat16)
    want = torch.ops.aten._dyn_quant_matmul_4bit(tx, tp, K, K, N).float().numpy()
    got = reference(xb, p)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


# ------------------------------------------------------------------------------ bad input


def _packed(K=64, N=8, g=32, bias=False):
    q, s = Q.quantize_4bit(jnp.ones((N, K)), g)
    return Q.dyn_quant_pack_4bit_weight(q, s, jnp.zeros(N) if bias else None, g, K, N)


def test_bad_groupsize():
    w = jnp.ones((4, 128))
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.quantize_4bit(w, 48)
    with pytest.raises(ValueError, match="divide"):
        Q.quantize_4bit(jnp.ones((4, 96)), 64)
    with pytest.raises(ValueError, match="even"):
        Q.quantize_4bit(jnp.ones((4, 33)), 33)
    with pytest.raises(TypeError, match="groupsize"):
        Q.quantize_4bit(w, 32.0)
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize_4bit(jnp.ones((128,)), 32)
    with pytest.raises(TypeError, match="floating"):
        Q.quantize_4bit(jnp.ones((4, 128), jnp.int32), 32)


def test_bad_pack_args():
    q, s = Q.quantize_4bit(jnp.ones((8, 64)), 32)
    with pytest.raises(TypeError, match="uint8"):
        Q.dyn_quant_pack_4bit_weight(q.astype(jnp.int8), s, None, 32, 64, 8)
    with pytest.raises(ValueError, match="bytes"):
        Q.dyn_quant_pack_4bit_weight(q[:, :16], s, None, 32, 64, 8)
    with pytest.raises(ValueError, match="scales_zeros"):
        Q.dyn_quant_pack_4bit_weight(q, s[:, :1], None, 32, 64, 8)
    with pytest.raises(TypeError, match="scales_zeros"):
        Q.dyn_quant_pack_4bit_weight(q, s.astype(jnp.float16), None, 32, 64, 8)
    with pytest.raises(ValueError, match="bias"):
        Q.dyn_quant_pack_4bit_weight(q, s, jnp.zeros(7), 32, 64, 8)
    with pytest.raises(ValueError, match="odd|even"):
        Q.dyn_quant_pack_4bit_weight(q, s, None, 63, 63, 8)
    with pytest.raises(ValueError, match="out_features"):
        Q.dyn_quant_pack_4bit_weight(q, s, None, 32, 64, 0)


def test_bad_matmul_args():
    p = _packed()
    x = jnp.ones((2, 64))
    with pytest.raises(ValueError, match="in_features"):
        Q.dyn_quant_matmul_4bit(jnp.ones((2, 32)), p, 32, 64, 8)
    with pytest.raises(ValueError, match="in_features=128"):
        Q.dyn_quant_matmul_4bit(x, p, 32, 128, 8)
    with pytest.raises(ValueError, match="groupsize"):
        Q.dyn_quant_matmul_4bit(x, p, 64, 64, 8)
    with pytest.raises(TypeError, match="float32, bfloat16"):
        Q.dyn_quant_matmul_4bit(x.astype(jnp.float16), p, 32, 64, 8)
    with pytest.raises(TypeError, match="PackedInt4Weight"):
        Q.dyn_quant_matmul_4bit(x, (p.weight, p.scales), 32, 64, 8)
    with pytest.raises(TypeError, match="dtype"):
        Q.int4_matmul(x.astype(jnp.int32), p)
    with pytest.raises(ValueError, match="implementation"):
        Q.int4_matmul(x, p, implementation="cuda")
    bad = base.PackedInt4Weight(p.weight.astype(jnp.int8), p.scales, None, 32, 64, 8)
    with pytest.raises(TypeError, match="uint8"):
        Q.int4_matmul(x, bad)
    bad = base.PackedInt4Weight(p.weight, p.scales[:, :1], None, 32, 64, 8)
    with pytest.raises(ValueError, match="scales"):
        Q.int4_matmul(x, bad)
    with pytest.raises(ValueError, match="out_features=16"):
        Q.dyn_quant_matmul_4bit(x, p, 32, 64, 16)
    with pytest.raises(TypeError, match="scales must be float32"):
        Q.int4_matmul(x, base.PackedInt4Weight(p.weight, p.scales.astype(jnp.int32), None, 32, 64, 8))
    with pytest.raises(TypeError, match="bias must be float32"):
        Q.int4_matmul(x, base.PackedInt4Weight(p.weight, p.scales, jnp.zeros(8, jnp.int32), 32, 64, 8))
    with pytest.raises(ValueError, match=r"bias must have shape \(out_features,\)"):
        Q.int4_matmul(x, base.PackedInt4Weight(p.weight, p.scales, jnp.zeros(3), 32, 64, 8))
    with pytest.raises(TypeError, match="compute_dtype"):
        Q.int4_matmul(x, p, compute_dtype=jnp.int8)


@pytest.mark.parametrize(
    "name", ["pallas_kernels.int4_matmul.packing", "pallas_kernels.int4_matmul.reference"]
)
def test_docstring_examples(name):
    import doctest  # noqa: PLC0415
    import importlib  # noqa: PLC0415

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
