"""Each implementation against the reference, through the shared `Int4Suite`."""

import contextlib

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.int4_matmul import cpp, triton, xla

from tests.int4.int4_base import GRID, Int4Suite


@contextlib.contextmanager
def _cpp_isa(isa):
    """Runs the block on the C++ code path `isa` (skips the test on a CPU without it), then restores
    the default path."""
    default = cpp.isa()
    if not cpp.set_isa(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    try:
        yield
    finally:
        cpp.set_isa(default)


@contextlib.contextmanager
def _bf16_kernels(mode):
    """Runs the block with `cpp.set_bf16_kernels(mode)`, then restores the default, "auto"."""
    cpp.set_bf16_kernels(mode)
    try:
        yield
    finally:
        cpp.set_bf16_kernels("auto")


class TestXla(Int4Suite):
    impl = staticmethod(xla.dyn_quant_matmul)
    weight_only = staticmethod(xla.weight_only_matmul)


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
class TestCpp(Int4Suite):
    impl = staticmethod(lambda x, p: cpp.dyn_quant_matmul(x, p))
    weight_only = staticmethod(cpp.weight_only_matmul)
    supports_odd_channelwise = False

    @pytest.mark.parametrize("isa", ["avx512bw", "avx2", "scalar"])
    def test_other_code_paths(self, isa):
        """The non-default paths (a CPU without VNNI / AVX-512 / AVX2) on the whole grid."""
        from pallas_kernels.int4_matmul import base
        from tests.int4.int4_base import make_case, reference
        import numpy as np

        with _cpp_isa(isa):
            for case in GRID:
                x, p = make_case(*case)
                np.testing.assert_array_equal(
                    np.asarray(cpp.dyn_quant_matmul(x, p)), np.asarray(reference(x, p))
                )
                # set_isa switches the weight-only row kernel too (float tolerance)
                w = np.asarray(base.dequantize(p.weight, p.scales, p.groupsize), np.float64)
                want = np.asarray(x, np.float64) @ w.T + (
                    0 if p.bias is None else np.asarray(p.bias, np.float64)
                )
                got = np.asarray(cpp.weight_only_matmul(x, p), np.float64)
                np.testing.assert_allclose(
                    got, want, rtol=0, atol=self.weight_only_tol * max(np.abs(want).max(initial=0), 1)
                )


# Interpret mode is slow: small tiles so that several ragged blocks and split-K are exercised. W4A8 steps
# are >= 64 k (int8 dots over >= 32 k, triton.MIN_INT8_DOT_K): groupsize 32 and 96 take the masked windows.
_DECODE = triton.Config(block_m=16, block_n=16, block_k=64, split_k=2, num_warps=4, num_stages=2)


def _pallas_dyn(x, p):
    M = x.size // x.shape[-1] if x.ndim else 1
    cfg = _DECODE if M <= triton.DECODE_M else triton.Config(block_m=32, block_n=16, block_k=64)
    if p.num_groups % cfg.split_k:
        cfg = triton.Config(cfg.block_m, cfg.block_n, cfg.block_k, 1)
    return triton.dyn_quant_matmul(x, p, config=cfg, interpret=True)


def _pallas_wo(x, p):
    return triton.weight_only_matmul(
        x, p, config=triton.Config(block_m=16, block_n=16, block_k=32, split_k=2), interpret=True
    )


class TestPallasInterpret(Int4Suite):
    impl = staticmethod(_pallas_dyn)
    weight_only = staticmethod(_pallas_wo)
    supports_odd_channelwise = False

    def test_prefill_heuristic_config(self):
        from tests.int4.int4_base import make_case
        from pallas_kernels.int4_matmul import base
        import numpy as np

        x, p = make_case(40, 128, 24, 64, True)
        got = triton.dyn_quant_matmul(x, p, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(base.dyn_quant_matmul(x, p)))

    def test_weight_only_bf16_compute(self):
        from tests.int4.int4_base import make_case
        from pallas_kernels.int4_matmul import base
        import numpy as np

        x, p = make_case(3, 128, 16, 64, False)
        got = _pallas_wo(x.astype(jnp.bfloat16), p)
        want = base.weight_only_matmul(x, p)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want), atol=0.05 * float(jnp.abs(want).max())
        )


def test_long_channelwise_rows_exact():
    """K > 8192 channel-wise: the XLA path splits K into exact float32 blocks, C++ sums in int32."""
    import numpy as np
    from tests.int4.int4_base import make_case, reference

    for M in (2, 12):
        x, p = make_case(M, 10240, 4, 10240, True)
        want = np.asarray(reference(x, p))
        np.testing.assert_array_equal(np.asarray(xla.dyn_quant_matmul(x, p)), want)
        if cpp.available():
            np.testing.assert_array_equal(np.asarray(cpp.dyn_quant_matmul(x, p)), want)


# The C++ group paths (groupsize a multiple of 128; the row path and, from 16 rows, the blocked one):
# more than 16 groups with a ragged last block of 16, N not a multiple of the 8-row weight tile, 64-byte chunks per group > 1 (groupsize 256,
# channel-wise K = 256), 1 to 4 rows per block plus a remainder, and rows whose zero point is -128
# (all-positive rows: the second zero-point dot) next to ordinary ones in the same block of rows.
_GROUP_CASES = [
    (1, 2176, 37, 128),
    (1, 256, 21, 256),  # channel-wise decode
    (2, 2304, 19, 256),
    (5, 256, 13, 256),
    (8, 640, 24, 128),
    (6, 128, 9, 128),
    # 16 rows and more: the blocked path (16 rows per vector), ragged row blocks and weight quads
    (16, 256, 13, 256),
    (33, 2176, 37, 128),
    (50, 384, 8, 128),
    (9, 256, 11, 128),  # the first blocked size
    (70, 384, 53, 128),  # two groups of row blocks (4 + 1)
    (40, 256, 776, 64),  # full 48-row weight tiles (N >= 384 per thread) and a ragged one
]


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
@pytest.mark.parametrize("isa", ["avx512vnni", "avx512bw", "avx2", "scalar"])
@pytest.mark.parametrize("M,K,N,g", _GROUP_CASES)
def test_cpp_group_path_every_isa(isa, M, K, N, g):
    import numpy as np

    from pallas_kernels.int4_matmul import base
    from tests.int4.int4_base import make_case, reference

    with _cpp_isa(isa):
        x, p = make_case(M, K, N, g, M % 2 == 1, seed=M)
        x = np.array(x)
        x[0] = np.abs(x[0])  # zp = -128
        if M > 2:
            x[2] = 0.0
        if M > 4:
            x[4] = np.abs(x[4]) + 0.5
        x = jnp.asarray(x)
        np.testing.assert_array_equal(np.asarray(cpp.dyn_quant_matmul(x, p)), np.asarray(reference(x, p)))
        w = np.asarray(base.dequantize(p.weight, p.scales, g), np.float64)
        want = np.asarray(x, np.float64) @ w.T + (0 if p.bias is None else np.asarray(p.bias, np.float64))
        got = np.asarray(cpp.weight_only_matmul(x, p), np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(np.abs(want).max(), 1))


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
def test_cpp_weight_only_crossover_is_explained():
    """Weight-only rows up to the measured crossover of this code path run in C++; above it, XLA's GEMM,
    and explain says why."""
    import jax

    import jbackends as jb
    from tests.int4.int4_base import make_case

    _, p = make_case(1, 128, 16, 32, False)
    limit = cpp.weight_only_max_rows()
    assert limit == (
        cpp.WEIGHT_ONLY_MAX_ROWS_AVX512 if cpp.isa().startswith("avx512") else cpp.WEIGHT_ONLY_MAX_ROWS
    )
    with jb.with_backends(quantized_engine="auto"):
        at = jb.quantized.explain(jax.ShapeDtypeStruct((limit, 128), jnp.float32), p, platform="cpu")
        above = jb.quantized.explain(jax.ShapeDtypeStruct((limit + 1, 128), jnp.float32), p, platform="cpu")
    assert at.implementation == "cpp", str(at)
    assert above.implementation == "xla" and "crossover" in above.reasons["cpp"], str(above)


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
@pytest.mark.parametrize("M", [1, 5, 20, 40])
def test_cpp_own_threads_match_xla_pool(M):
    """Calls large enough for several threads (M N K / 2 >= 2**18): on XLA's intra-op pool (the
    default) and on threads of the kernels' own (the no-pool fallback) the results are the same
    bits, exact against the reference for dyn-quant and within float tolerance for weight-only."""
    import numpy as np

    from pallas_kernels.int4_matmul import base
    from tests.int4.int4_base import make_case, reference

    x, p = make_case(M, 1024, 1040 if M == 1 else 264, 128, True, seed=3)
    dyn, wo = jax.jit(cpp.dyn_quant_matmul), jax.jit(cpp.weight_only_matmul)
    pooled = np.asarray(dyn(x, p)), np.asarray(wo(x, p))
    cpp.set_xla_pool(False)
    try:
        own = np.asarray(dyn(x, p)), np.asarray(wo(x, p))
    finally:
        cpp.set_xla_pool(True)
    np.testing.assert_array_equal(pooled[0], np.asarray(reference(x, p)))
    np.testing.assert_array_equal(own[0], pooled[0])
    w = np.asarray(base.dequantize(p.weight, p.scales, p.groupsize), np.float64)
    want = np.asarray(x, np.float64) @ w.T + np.asarray(p.bias, np.float64)
    for got in (pooled[1], own[1]):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


# float32 activations on the blocked path (from 16 rows, 12 on Intel CPUs: M = 13 is a lone ragged row
# block there and the row kernel elsewhere): K in chunks of 128 in the permuted order of
# DequantChunk, with a zero-padded last chunk (K = 576, 320, 704), 1 to 4 groups per chunk (groupsize
# 32, 64), groups that straddle chunks (96, 320), channel-wise with and without a padded chunk, 1 to 4
# row blocks and a ragged one, ragged and full 48-row weight tiles.
_F32_BLOCKED_CASES = [
    (16, 576, 50, 96),
    (17, 320, 97, 32),
    (33, 1152, 48, 384),
    (20, 704, 30, 704),
    (16, 512, 13, 512),
    (70, 640, 53, 320),
    (40, 256, 776, 64),
    (100, 2176, 9, 128),
    (13, 576, 50, 96),
]


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "scalar"])
@pytest.mark.parametrize("M,K,N,g", _F32_BLOCKED_CASES)
def test_cpp_weight_only_float32_blocked(isa, M, K, N, g):
    """float32 x from 16 rows: against float64 math on the dequantized weight, NaN and Inf rows included
    (they must spread exactly as in the reference, and not into the other rows)."""
    import numpy as np

    from pallas_kernels.int4_matmul import base
    from tests.int4.int4_base import make_case

    with _cpp_isa(isa):
        x, p = make_case(M, K, N, g, True, seed=K)
        x = np.array(x)
        x[3, K - 1] = np.inf  # the last k: in the padded chunk where K % 128 != 0
        x[5, 7] = np.nan
        w = np.asarray(base.dequantize(p.weight, p.scales, g), np.float64)
        with np.errstate(invalid="ignore"):
            want = x.astype(np.float64) @ w.T + np.asarray(p.bias, np.float64)
        got = np.asarray(cpp.weight_only_matmul(jnp.asarray(x), p), np.float64)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
        scale = np.abs(x.astype(np.float64)).clip(max=1e30) @ np.abs(w.T)
        assert (np.abs(got[finite] - want[finite]) <= 2e-6 * scale[finite] + 1e-30).all()


# One float32 row on AVX512-VNNI: the integer-dot path (the row as 24-bit block fixed point per 128 k),
# and the rows it hands to the float32 kernel. (K, N, groupsize): one group per chunk, 2 and 8 chunks
# per group, channel-wise, an odd number of chunks, a bias.
_LIMB_CASES = [(4096, 300, 128), (384, 50, 128), (512, 33, 256), (1024, 17, 1024), (1152, 40, 128)]


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
@pytest.mark.parametrize("K,N,g", _LIMB_CASES)
def test_cpp_weight_only_one_row_integer_dots(K, N, g):
    """M=1 float32 x: within 3e-7 of sum |x w| of float64 math (the float32 kernel's error is about
    1e-8 to 5e-8 here) for ordinary and non-negative rows, moderate outlier channels, tiny values
    against tiny scales, zero chunks, sparse weight rows and a chunk maximum at the range's ends; rows
    the integer path must refuse (NaN, inf, a chunk maximum just outside [2^-96, 2^96], a few values
    dominating their chunks) give the float32 kernel's bits (the AVX512BW path runs only that kernel)."""
    import numpy as np

    from pallas_kernels.int4_matmul import base
    from tests.int4.int4_base import make_case

    x0, p = make_case(1, K, N, g, K % 3 == 0, seed=K + N)
    x0 = np.array(x0)
    rng = np.random.default_rng(K)
    # No bias (a bias would hide the dot of tiny rows); sparse weight rows: row 1 all q = 0 with a
    # nonzero scale (its output must be exactly 0), rows 2.. with 90% of q = 0.
    packed = np.array(p.weight)
    packed[1] = 0x88
    keep = rng.random(packed[2:].shape + (2,)) < 0.1
    lo = np.where(keep[..., 0], packed[2:] & 0x0F, 0x08)
    hi = np.where(keep[..., 1], packed[2:] >> 4, 0x08)
    packed[2:] = lo | (hi << 4)
    scales = np.array(p.scales)
    scales[1] = 0.02
    sparse = base.PackedInt4Weight(jnp.asarray(packed), jnp.asarray(scales), None, g, K, N)
    tiny_scales = base.PackedInt4Weight(p.weight, p.scales * 2.0**-10, None, g, K, N)
    run = jax.jit(cpp.weight_only_matmul)

    def both(x, q):
        with _cpp_isa("avx512vnni"):
            vnni = np.asarray(run(jnp.asarray(x), q))
        with _cpp_isa("avx512bw"):
            f32 = np.asarray(run(jnp.asarray(x), q))
        return vnni, f32

    def at_max(x, m):  # each 128-k chunk scaled so that its largest |x| is m
        c = x.reshape(-1, 128).astype(np.float64)
        return (c / np.abs(c).max(axis=1, keepdims=True) * m).astype(np.float32).reshape(x.shape)

    outliers = x0.copy()
    outliers[0, rng.choice(K, 2, replace=False)] *= 20.0
    zero_chunks = np.zeros_like(x0)
    zero_chunks[0, 128:256] = x0[0, 128:256]
    relu = np.maximum(x0, 0.0)
    integer_rows = [
        ("ordinary", x0, p),
        ("ordinary, sparse weights", x0, sparse),
        ("relu", relu, p),
        ("relu, sparse weights", relu, sparse),
        ("20x outliers", outliers, p),
        ("zero chunks", zero_chunks, p),
        ("max 2^-96, scales x 2^-10", at_max(x0, 2.0**-96), tiny_scales),
        ("max 2^96", at_max(x0, 2.0**96), p),
    ]
    for name, x, q in integer_rows:
        vnni, f32 = both(x, q)
        w = np.asarray(base.dequantize(q.weight, q.scales, g), np.float64)
        bias = 0 if q.bias is None else np.asarray(q.bias, np.float64)
        want = x.astype(np.float64) @ w.T + bias
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.T) + np.abs(bias)
        err = np.abs(vnni.astype(np.float64) - want)
        assert (err <= 3e-7 * scale).all(), (name, float((err / np.maximum(scale, 1e-300)).max()))
        assert not np.array_equal(vnni, f32), name  # the integer path ran: its rounding differs
        if q is sparse:
            assert vnni[0, 1] == 0.0, name

    spread = x0.copy()
    spread[0, 5] = 1e6  # one value dominates its chunk: the rest would round to 2^-24 of it
    inf, nan = x0.copy(), x0.copy()
    inf[0, K - 1] = np.inf
    nan[0, 3] = np.nan
    float_rows = {
        "spread": spread,
        "inf": inf,
        "nan": nan,
        "max 2^-97": at_max(x0, 2.0**-97),
        "max 2^97": at_max(x0, 2.0**97),
    }
    for name, x in float_rows.items():
        vnni, f32 = both(x, p)
        np.testing.assert_array_equal(vnni, f32, err_msg=name)


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
def test_cpp_weight_only_one_row_integer_dots_error_bound_on_heavy_tails():
    """The integer-dot row's guaranteed bound, where the 3e-7 of sum |x w| above does not hold:
    heavy-tailed weights (Student t, 2 degrees) and six 100x outlier channels in 2048 (a spread the
    routing keeps on the integer path) measured 2e-7 to 1.4e-6 of sum |x w| (XLA's float32 dot: 2e-7
    to 1e-6 on the same rows). Each x is rounded to 24 bits of its 128-k chunk's largest |x| (within
    2^-23 max_c), so the error stays within 2^-23 sum_c max_c sum_(k in c) |w_k| plus float32's
    rounding of the sums (found by a review's fuzz: the docs claimed 3e-7 here)."""
    import numpy as np

    from jbackends import quantized as Q

    K, N, g = 2048, 64, 128
    worst = 0.0
    for seed in range(4):
        rng = np.random.default_rng(seed + 10)
        q8, s = Q.quantize_4bit(jnp.asarray(rng.standard_t(2, (N, K)).astype(np.float32)), g)
        p = Q.dyn_quant_pack_4bit_weight(q8, s, None, g, K, N)
        x = rng.standard_normal((1, K)).astype(np.float32)
        x[0, rng.choice(K, 6, replace=False)] *= 100.0
        with _cpp_isa("avx512vnni"):
            vnni = np.asarray(cpp.weight_only_matmul(jnp.asarray(x), p), np.float64)
        with _cpp_isa("avx512bw"):
            f32 = np.asarray(cpp.weight_only_matmul(jnp.asarray(x), p), np.float64)
        assert not np.array_equal(vnni, f32)  # the integer path ran
        w = np.asarray(Q.dequantize_4bit(p), np.float64)
        x64 = x.astype(np.float64)
        want = x64 @ w.T
        w = np.abs(w)
        mag = np.abs(x64) @ w.T
        chunk_max = np.abs(x64).reshape(-1, 128).max(axis=1)
        quantized = 2.0**-23 * (w.reshape(N, -1, 128).sum(-1) * chunk_max).sum(-1)
        bound = quantized + (K // 128 + 8) * 2.0**-24 * mag
        err = np.abs(vnni - want)
        assert (err <= bound).all(), float((err / bound).max())
        worst = max(worst, float((err / mag).max()))
    assert worst < 3e-6, worst


# bfloat16 activations. The row kernel (up to 15 rows): chunks of 128 k with 1 to 4 groups per chunk
# (groupsize 32, 64), groups that straddle chunks (96), an odd number of chunks (K = 2176),
# channel-wise, K not a multiple of 128 (widened to float32). The blocked path (from 16 rows): slices
# of 64, 48, 32 and 16 weight bytes (groupsize 128+, 96, 320, 32), 1 to 4 row blocks per register
# tile, two groups of row blocks with a ragged one, ragged weight tiles, full 48-row weight tiles
# (N >= 384 per thread), channel-wise.
_BF16_CASES = [
    (1, 256, 40, 32),
    (1, 128, 8, 128),
    (3, 384, 24, 64),
    (4, 1152, 33, 96),
    (5, 2176, 37, 128),
    (15, 256, 9, 256),
    (2, 512, 7, 512),
    (12, 4096, 20, 128),
    (1, 160, 5, 32),
    (40, 256, 21, 64),
    (16, 256, 9, 256),
    (33, 384, 24, 96),
    (70, 1152, 53, 32),
    (40, 512, 9, 512),
    (100, 160, 30, 32),
    (20, 256, 29, 64),
    (3, 256, 776, 64),
    (40, 256, 776, 64),
    (16, 128, 800, 128),
    (20, 640, 9, 320),
]


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
@pytest.mark.parametrize(
    "isa,bf16_kernels",
    [("avx512vnni", "auto"), ("avx512vnni", "always"), ("avx2", "auto"), ("scalar", "auto")],
)
@pytest.mark.parametrize("M,K,N,g", _BF16_CASES)
def test_cpp_weight_only_bfloat16(isa, bf16_kernels, M, K, N, g):
    """bfloat16 x: the AVX512-BF16 kernel (exact bf16 x int4 products) where the CPU, the shape and
    `set_bf16_kernels` allow ("always" reaches it on Intel too), else widened to float32 in the kernel;
    the float32 sums within float tolerance of the float64 reference, rounded to bfloat16 in the kernel
    as XLA rounds (at most one bf16 ulp from the reference's own rounding, which may sit on the other
    side of a tie)."""
    import ml_dtypes
    import numpy as np

    from pallas_kernels.int4_matmul import base
    from tests.int4.int4_base import make_case

    with _cpp_isa(isa), _bf16_kernels(bf16_kernels):
        x, p = make_case(M, K, N, g, True, seed=M + K)
        xb = x.astype(jnp.bfloat16)
        path = cpp.weight_only_bf16_path(M, K)
        if isa in ("avx2", "scalar"):
            assert path == "float32"
        elif path != "float32":  # a CPU with AVX512-BF16
            assert path == ("bf16 row" if M <= 15 and K % 128 == 0 else "bf16 blocked")
        got = jax.jit(cpp.weight_only_matmul)(xb, p)
        assert got.dtype == jnp.bfloat16 and got.shape == (M, N)
        w = np.asarray(base.dequantize(p.weight, p.scales, g), np.float64)
        want = np.asarray(xb, np.float64) @ w.T + np.asarray(p.bias, np.float64)
        if path == "float32":  # widened: the float32 kernel's sums, rounded to nearest even as XLA does
            want_bits = jax.jit(cpp.weight_only_matmul)(xb.astype(jnp.float32), p).astype(jnp.bfloat16)
            np.testing.assert_array_equal(
                np.asarray(got).view(np.uint16), np.asarray(want_bits).view(np.uint16)
            )
        got = np.asarray(got, np.float64)
        want_bf16 = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        ulp = np.spacing(np.abs(want_bf16).astype(ml_dtypes.bfloat16)).astype(np.float64)
        assert np.all(np.abs(got - want_bf16) <= ulp + 2e-5 * np.abs(want).max()), np.abs(
            got - want_bf16
        ).max()


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
def test_cpp_bfloat16_kernels_route():
    """bfloat16 activations on a CPU with AVX512-BF16: widened to float32 on an Intel CPU (its float32
    kernels measured faster there), the AVX512-BF16 kernels on others; "always" takes them on
    every such CPU; a bad mode is refused."""
    import pathlib

    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to tell the CPU's vendor")
    intel = "GenuineIntel" in cpuinfo.read_text()
    with _cpp_isa("avx512vnni"), _bf16_kernels("always"):
        if cpp.weight_only_bf16_path(2, 256) != "bf16 row":
            pytest.skip("this CPU has no AVX512-BF16")
        assert [cpp.weight_only_bf16_path(m, 256) for m in (1, 15, 16)] == [
            "bf16 row",
            "bf16 row",
            "bf16 blocked",
        ]
    with _cpp_isa("avx512vnni"), _bf16_kernels("auto"):
        want = ["float32"] * 3 if intel else ["bf16 row", "bf16 row", "bf16 blocked"]
        assert [cpp.weight_only_bf16_path(m, 256) for m in (1, 15, 16)] == want
    with pytest.raises(ValueError, match="'auto' or 'always'"):
        cpp.set_bf16_kernels("never")


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
@pytest.mark.parametrize("bf16_kernels", ["auto", "always"])
def test_cpp_weight_only_bfloat16_nonfinite(bf16_kernels):
    """NaN and Inf activations come out as in the float64 reference: NaN where it is NaN, the same
    infinities; rows of large finite activations stay finite (on every bf16 route)."""
    import numpy as np

    from pallas_kernels.int4_matmul import base
    from tests.int4.int4_base import make_case

    x, p = make_case(4, 256, 24, 64, True, seed=9)
    x = np.array(x)
    x[0, 3] = np.inf
    x[1, 200] = -np.inf
    x[2, 7] = np.nan
    x[3] *= 1e30
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    w = np.asarray(base.dequantize(p.weight, p.scales, 64), np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (np.asarray(xb, np.float64) @ w.T + np.asarray(p.bias, np.float64)).astype(np.float32)
    with _bf16_kernels(bf16_kernels):
        got = np.asarray(jax.jit(cpp.weight_only_matmul)(xb, p), np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isfinite(want[3]).all() and np.isnan(want[2]).all() and np.isinf(want[0]).any()
    np.testing.assert_allclose(got[3], want[3], rtol=2**-7)


@pytest.mark.skipif(not cpp.available(), reason="C++ extension not built (pip install -e . with a compiler)")
def test_cpp_weight_only_bfloat16_row_limit_is_explained():
    """bfloat16 activations on the AVX512-BF16 blocked path stay in C++ above the float32 crossover
    (measured ahead of XLA up to 2048 rows); without it they follow the float32 rule."""
    import jbackends as jb
    from tests.int4.int4_base import make_case

    _, p = make_case(1, 128, 16, 32, False)
    rows = cpp.weight_only_max_rows() + 1
    with jb.with_backends(quantized_engine="auto"):
        got = jb.quantized.explain(jax.ShapeDtypeStruct((rows, 128), jnp.bfloat16), p, platform="cpu")
    if cpp.weight_only_bf16_path(rows, 128) == "bf16 blocked":
        assert got.implementation == "cpp", str(got)
    else:
        assert got.implementation == "xla" and "crossover" in got.reasons["cpp"], str(got)
