"""The Pallas Triton int4 kernels as the GPU compiles them.

The W4A8 kernel returned garbage for groupsize 32 on an H100 while interpret mode passed: each 32-k
group's nibble plane was an int8 ``jnp.dot`` over 16 k. Triton's NVIDIA backend has no int8 MMA
narrower than k32 (its ``min_dot_size`` asks for K >= 32 on 8-bit operands; Pallas does not check),
and compiles the 16-k dot to ``mma.m16n8k32`` with the operand registers repeated
(``{a0, a1, a0, a1} x {b0, b0}``): every product counted twice. The interpreter runs ``jnp.dot`` as
written, so only the structure can be checked on CPU: `test_kernel_dots_fit_triton_mma` asserts the
dot shapes of every kernel the heuristics pick (it fails on the old kernel), and the interpret tests
run the new masked windows (groupsizes that are odd multiples of 32) bit for bit. The ``gpu`` tests
run the compiled kernels against the XLA engine.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends.quantized as Q
from pallas_kernels.int4_matmul import base, triton

from tests.int4.int4_base import make_case, reference


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def _kernel_dots(jaxpr, inside=False):
    """The dot_general equations inside every pallas_call of ``jaxpr`` (loop bodies included); of a
    `pallas_kernels.gpu.gpu_call`, the GPU branch only (its other is the kernel in interpret mode)."""
    for e in jaxpr.eqns:
        if e.primitive.name == "jb_pallas_gpu_call":
            yield from _kernel_dots(e.params["gpu"].jaxpr, inside)
            continue
        if e.primitive.name == "pallas_call":
            yield from _kernel_dots(e.params["jaxpr"], True)
            continue
        if inside and e.primitive.name == "dot_general":
            yield e
        for sub in _sub_jaxprs(e):
            yield from _kernel_dots(sub, inside)


def _abstract_packed(K, N, g):
    return jax.eval_shape(
        lambda: base.PackedInt4Weight(
            jnp.zeros((N, K // 2), jnp.uint8), jnp.zeros((N, K // g)), jnp.zeros(N), g, K, N
        )
    )


# Triton's NVIDIA minimum contraction per operand width (bits -> k); M and N are padded by Triton.
_MIN_K = {8: triton.MIN_INT8_DOT_K, 16: 16}


@pytest.mark.parametrize("mode", ["w4a8", "w4a16"])
@pytest.mark.parametrize(
    "K,N,g",
    [
        (1024, 512, 32),
        (1024, 512, 64),
        (4096, 4096, 128),
        (1152, 500, 96),
        (1120, 200, 160),
        (1120, 200, 1120),
        (1152, 500, 1152),
        (32, 64, 32),
    ],
)
def test_kernel_dots_fit_triton_mma(mode, K, N, g):
    """Every int8 dot the compiled W4A8 kernel runs contracts over >= 32 k, every 16-bit one over >= 16."""
    p = _abstract_packed(K, N, g)
    for M in (1, 4, 16, 33, 64, 128, 512):
        if mode == "w4a8":
            x = jax.ShapeDtypeStruct((M, K), jnp.float32)
            f = lambda x, p: triton.dyn_quant_matmul(x, p)
        else:
            x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
            f = lambda x, p: triton.weight_only_matmul(x, p)
        dots = list(_kernel_dots(jax.make_jaxpr(f)(x, p).jaxpr))
        assert dots, "no dot found in the kernel"
        for e in dots:
            a, b = (v.aval for v in e.invars)
            (ca,), (cb,) = e.params["dimension_numbers"][0]
            k = a.shape[ca]
            assert b.shape[cb] == k
            bits = jnp.dtype(a.dtype).itemsize * 8
            if bits in _MIN_K:
                assert k >= _MIN_K[bits], (
                    f"{mode} M={M} K={K} g={g}: {a.dtype} dot over {k} k {a.shape}x{b.shape}"
                )
            if mode == "w4a8":
                assert a.dtype == jnp.int8 and b.dtype == jnp.int8


def test_w4a8_config_refuses_narrow_int8_dots():
    x, p = make_case(2, 128, 16, 32, False)
    with pytest.raises(ValueError, match="block_k=32 must be >= 64"):
        triton.dyn_quant_matmul(x, p, config=triton.Config(block_k=32), interpret=True)
    assert triton.heuristics(1, 512, 1024, 32, mode="w4a8").block_k == 64
    assert triton.heuristics(300, 512, 1024, 32, mode="w4a8").block_k == 64
    assert triton.heuristics(1, 512, 1024, 128, mode="w4a8").block_k == 128


# (M, K, N, groupsize): the heuristic configs (what the GPU runs), in the interpreter. Odd multiples of 32
# (32, 96, 160, channel-wise 96 / 160 / 32) take the masked windows; K = 32 is padded to one window.
_HEURISTIC_CASES = [
    (1, 192, 40, 32),
    (3, 192, 40, 96),
    (16, 192, 40, 64),
    (2, 96, 24, 96),
    (1, 32, 24, 32),
    (17, 160, 24, 32),
    (40, 320, 24, 160),
    (33, 160, 70, 160),
    (20, 256, 24, 128),
]


@pytest.mark.parametrize(
    "M,K,N,g", _HEURISTIC_CASES, ids=[f"M{c[0]}-K{c[1]}-N{c[2]}-g{c[3]}" for c in _HEURISTIC_CASES]
)
def test_w4a8_heuristic_configs_bit_exact(M, K, N, g):
    x, p = make_case(M, K, N, g, True)
    got = jax.jit(lambda x, p: triton.dyn_quant_matmul(x, p, interpret=True))(x, p)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference(x, p)))


@pytest.mark.parametrize("block_k,split_k", [(128, 1), (256, 2), (64, 3)])
def test_w4a8_windows_wider_than_the_group(block_k, split_k):
    """Any block_k >= 64 is correct (masked) for groupsize 32 and 96, decode (split) and prefill."""
    for M, g in ((2, 32), (20, 96)):
        x, p = make_case(M, 384, 24, g, False)
        cfg = triton.Config(block_m=16, block_n=16, block_k=block_k, split_k=split_k)
        got = triton.dyn_quant_matmul(x, p, config=cfg, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(reference(x, p)))


@pytest.mark.parametrize(
    "M,K,N,g,bias",
    [(1, 256, 40, 32, True), (3, 512, 24, 128, False), (20, 256, 17, 64, True), (5, 384, 33, 384, True)],
)
@pytest.mark.parametrize("mma", [True, False], ids=["mma", "no_mma"])
def test_w4a16_search_space_options_near_float64(M, K, N, g, bias, mma):
    """The W4A16 options of the search space compute the same product: ``scale_after_dot`` (exact
    integer weights in the dot, the group scales on each step's dot) and ``mma=False`` (each row a
    float32 multiply-and-sum, no MMA): float32 within 3e-7 of float64 like the default path, bf16 no
    worse than it; split-K, ragged N and rows (more rows than one program holds), channel-wise and bias
    included."""
    x, p = make_case(M, K, N, g, bias)
    want = _f64_reference(x, p) if bias else np.asarray(x, np.float64) @ _f64_weight(p).T
    split = 2 if M <= triton.DECODE_M and (K // 32) % 2 == 0 else 1
    errs = {}
    for after in (False, True):
        cfg = triton.Config(16, 16, 32, split, scale_after_dot=after, mma=mma)
        for dt in (jnp.float32, jnp.bfloat16, jnp.float16):  # half precision: the exact-integer planes
            got = triton.weight_only_matmul(x.astype(dt), p, config=cfg, interpret=True)
            errs[after, jnp.dtype(dt).name] = np.linalg.norm(
                np.asarray(got, np.float64) - want
            ) / np.linalg.norm(want)
    assert errs[False, "float32"] < 3e-7 and errs[True, "float32"] < 3e-7, errs
    assert errs[True, "bfloat16"] <= 1.05 * errs[False, "bfloat16"] and errs[True, "bfloat16"] < 5e-3, errs
    assert errs[True, "float16"] <= 1.05 * errs[False, "float16"] and errs[True, "float16"] < 1e-3, errs


@pytest.mark.parametrize(
    "M,K,N,g", [(1, 256, 40, 32), (3, 512, 24, 128), (20, 256, 17, 64), (70, 1152, 50, 96)]
)
def test_swap_ab_and_byte_planes_compute_the_same_product(M, K, N, g):
    """``swap_ab`` (the transposed MMA, weights as its A operand) and W4A8's ``byte_planes`` (16-fold
    int8 weights, their sums from an MMA with ones): W4A8 bit-exact with torch's numerics (decode's group
    sums and prefill's fused tail, masked windows included), W4A16 as near float64 as the untransposed
    kernel (float32 within 3e-7, bf16 within 1.05x of its error), with split-K, ragged rows and columns
    and a bias."""
    x, p = make_case(M, K, N, g, True)
    decode = M <= triton.DECODE_M
    bm = 16 if decode else 32
    want8 = np.asarray(reference(x, p))
    for bk in (64, 128):
        split = 2 if decode and (K // g) % 2 == 0 else 1
        for swap, planes in ((True, False), (False, True), (True, True)):
            cfg = triton.Config(bm, 16, bk, split, swap_ab=swap, byte_planes=planes)
            got = triton.dyn_quant_matmul(x, p, config=cfg, interpret=True)
            np.testing.assert_array_equal(np.asarray(got), want8, err_msg=f"{cfg}")
    want = _f64_reference(x, p)
    for after in (False, True):
        split = 2 if decode and (K // 32) % 2 == 0 else 1
        errs = {}
        for swap in (False, True):
            cfg = triton.Config(bm, 16, 32, split, scale_after_dot=after, swap_ab=swap)
            for dt in (jnp.float32, jnp.bfloat16):
                got = np.asarray(
                    triton.weight_only_matmul(x.astype(dt), p, config=cfg, interpret=True), np.float64
                )
                errs[swap, jnp.dtype(dt).name] = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert errs[True, "float32"] < 3e-7, errs
        assert errs[True, "bfloat16"] <= 1.05 * errs[False, "bfloat16"] and errs[True, "bfloat16"] < 5e-3, (
            errs
        )


def test_swap_ab_transposes_every_kernel_dot():
    """The option is not ignored: every dot of the kernel takes the weight tile (``block_n`` rows) as its
    left operand, for both kernels, at decode and prefill."""
    K, N, g = 256, 64, 64
    p = _abstract_packed(K, N, g)
    for M in (4, 40):
        for fn, dt in ((triton.weight_only_matmul, jnp.bfloat16), (triton.dyn_quant_matmul, jnp.float32)):
            x = jax.ShapeDtypeStruct((M, K), dt)
            for swap in (False, True):
                cfg = triton.Config(16 if M <= 16 else 32, 64, 64, swap_ab=swap)
                dots = list(_kernel_dots(jax.make_jaxpr(lambda x, p: fn(x, p, config=cfg))(x, p).jaxpr))
                assert dots
                for e in dots:
                    lhs_rows = e.invars[0].aval.shape[0]
                    assert lhs_rows == (64 if swap else cfg.block_m), (fn.__name__, M, swap, e)


def test_int4_options_are_checked_and_kept_to_their_kernel():
    with pytest.raises(TypeError, match="scale_after_dot must be a bool"):
        triton.Config(scale_after_dot=1)
    with pytest.raises(TypeError, match="mma must be a bool"):
        triton.Config(mma=None)
    for M in (2, 40):
        x, p = make_case(M, 128, 16, 64, False)
        for opt in (dict(scale_after_dot=True), dict(mma=False)):
            with pytest.raises(ValueError, match="W4A16 options"):
                triton.dyn_quant_matmul(x, p, config=triton.Config(block_k=64, **opt), interpret=True)
        calls = {op: base.Int4Call.of(op, x, p) for op in ("weight_only", "dyn_quant")}
        spaces = {op: triton.Config.search_space(c, options=True) for op, c in calls.items()}
        assert {c.scale_after_dot for c in spaces["weight_only"]} == {False, True}
        assert {c.mma for c in spaces["weight_only"]} == ({True, False} if M <= triton.DECODE_M else {True})
        assert {(c.scale_after_dot, c.mma) for c in spaces["dyn_quant"]} == {(False, True)}
        assert {c.swap_ab for s in spaces.values() for c in s} == {False, True}
        assert not any(c.swap_ab and not c.mma for c in spaces["weight_only"])
        assert {c.byte_planes for c in spaces["dyn_quant"]} == {False, True}
        assert not any(c.byte_planes for c in spaces["weight_only"])
        # the autotuner's space leaves the unmeasured options out
        plain = {op: triton.Config.search_space(c) for op, c in calls.items()}
        assert {(c.scale_after_dot, c.mma, c.swap_ab) for c in plain["weight_only"]} == {(False, True, False)}
        assert len(spaces["weight_only"]) == len(plain["weight_only"]) * (6 if M <= triton.DECODE_M else 4)
        assert len(spaces["dyn_quant"]) == len(plain["dyn_quant"]) * 4
        for op, call in calls.items():  # the measured kernels, until a GPU says otherwise
            default = triton.Config.heuristics(call)
            assert not default.scale_after_dot and default.mma and not default.swap_ab
            assert not default.byte_planes
    # byte_planes keeps a group's 16-fold sums in int32: not offered for groupsizes of 2**17 and more
    big = base.Int4Call.of(
        "dyn_quant", jax.ShapeDtypeStruct((2, 2**17), jnp.float32), _abstract_packed(2**17, 16, 2**17)
    )
    assert not any(c.byte_planes for c in triton.Config.search_space(big, options=True))
    with pytest.raises(ValueError, match="block_m must be <= 16"):
        triton.Config(block_m=32, mma=False)
    with pytest.raises(TypeError, match="swap_ab must be a bool"):
        triton.Config(swap_ab=0)
    with pytest.raises(TypeError, match="byte_planes must be a bool"):
        triton.Config(byte_planes=1)
    x, p = make_case(2, 128, 16, 64, False)
    with pytest.raises(ValueError, match="byte_planes is a W4A8 option"):
        triton.weight_only_matmul(x, p, config=triton.Config(block_k=64, byte_planes=True), interpret=True)
    with pytest.raises(ValueError, match="swap_ab transposes the MMA"):
        triton.Config(swap_ab=True, mma=False)


def test_w4a16_no_mma_has_no_dot_and_rounds_like_the_mma_path():
    """mma=False lowers to no dot at all (the option is not ignored); with float32 x and a bf16
    compute dtype both paths round x and the scaled weights to bf16 alike."""
    x, p = make_case(3, 256, 24, 64, True)
    for mma, dots in ((True, 2), (False, 0)):
        cfg = triton.Config(16, 16, 32, 2, mma=mma)
        jaxpr = jax.make_jaxpr(lambda x, p: triton.weight_only_matmul(x, p, config=cfg))(x, p)
        assert len(list(_kernel_dots(jaxpr.jaxpr))) == dots
    outs = [
        np.asarray(
            triton.weight_only_matmul(
                x, p, compute_dtype=jnp.bfloat16, config=triton.Config(16, 16, 32, 2, mma=mma), interpret=True
            )
        )
        for mma in (True, False)
    ]
    want = _f64_reference(x, p)
    for got in outs:
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-4 < err < 5e-3, err  # bf16 operands: rounded, not float32
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------------------------------------------ the gpu lane

_GPU_SHAPES = (
    [(1152, 500, g) for g in (32, 64, 96, 128, 1152)]
    + [(1120, 200, g) for g in (32, 160, 1120)]
    + [(1024, 512, 32), (4096, 4096, 32)]
)
_GPU_M = (1, 4, 16, 33, 64, 128, 256, 512)


def _f64_weight(p):
    return np.asarray(base.dequantize(p.weight, p.scales, p.groupsize), np.float64)


def _f64_reference(x, p):
    return np.asarray(x, np.float64) @ _f64_weight(p).T + np.asarray(p.bias, np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("K,N,g", _GPU_SHAPES, ids=[f"K{k}-N{n}-g{g}" for k, n, g in _GPU_SHAPES])
def test_gpu_w4a8_compiled_equals_xla(K, N, g):
    """The compiled W4A8 kernel equals the XLA engine bit for bit (and is near the float64 product)."""
    pallas_fn = jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation="pallas"))
    xla_fn = jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation="xla"))
    for M in _GPU_M:
        x, p = make_case(M, K, N, g, True)
        got, want = np.asarray(pallas_fn(x, p)), np.asarray(xla_fn(x, p))
        rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        np.testing.assert_array_equal(got, want, err_msg=f"M={M} K={K} N={N} g={g}: relative error {rel:.3g}")
        exact = _f64_reference(x, p)
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.05, (M, K, N, g)


_W4A8_VARIANTS = {
    "swap_ab": dict(swap_ab=True),
    "byte_planes": dict(byte_planes=True),
    "both": dict(swap_ab=True, byte_planes=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("K,N,g", _GPU_SHAPES[:3] + _GPU_SHAPES[-1:], ids=lambda v: str(v))
@pytest.mark.parametrize("variant", list(_W4A8_VARIANTS))
def test_gpu_w4a8_options_compiled_equal_xla(K, N, g, variant):
    """The search space's W4A8 options compiled (``swap_ab``: weights as the int8 MMA's A operand, from
    registers; ``byte_planes``: 16-fold int8 weights, their sums from an MMA with ones): bit-equal to
    the XLA engine at decode (group sums) and prefill (the fused tail)."""

    def kernel(x, p):
        cfg = triton.Config.heuristics(base.Int4Call.of("dyn_quant", x, p))
        return triton.dyn_quant_matmul(x, p, config=dataclasses.replace(cfg, **_W4A8_VARIANTS[variant]))

    pallas_fn = jax.jit(kernel)
    xla_fn = jax.jit(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, g, K, N, implementation="xla"))
    for M in (1, 16, 33, 256):
        x, p = make_case(M, K, N, g, True)
        np.testing.assert_array_equal(np.asarray(pallas_fn(x, p)), np.asarray(xla_fn(x, p)), err_msg=f"M={M}")


# The W4A16 options only the search space has (until a GPU measures them): fewer shapes and rows.
_VARIANTS = {"default": {}, "scale_after_dot": dict(scale_after_dot=True), "no_mma": dict(mma=False)}
_VARIANTS["no_mma_scale_after_dot"] = dict(scale_after_dot=True, mma=False)
_VARIANTS["swap_ab"] = dict(swap_ab=True)
_VARIANTS["scale_after_dot_swap_ab"] = dict(scale_after_dot=True, swap_ab=True)


@pytest.mark.gpu
@pytest.mark.parametrize("K,N,g", _GPU_SHAPES[:8], ids=[f"K{k}-N{n}-g{g}" for k, n, g in _GPU_SHAPES[:8]])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_gpu_w4a16_compiled_near_float64(K, N, g, variant):
    if variant != "default" and (K, N, g) not in _GPU_SHAPES[:3]:
        pytest.skip("the search-space options run on the first three shapes")

    def kernel(x, p):
        cfg = triton.Config.heuristics(base.Int4Call.of("weight_only", x, p))
        if not _VARIANTS[variant].get("mma", True):  # rows unrolled per program: 16 at most
            cfg = dataclasses.replace(cfg, block_m=16)
        return triton.weight_only_matmul(x, p, config=dataclasses.replace(cfg, **_VARIANTS[variant]))

    if variant == "default":
        fn = jax.jit(lambda x, p: Q.int4_matmul(x, p, implementation="pallas"))
    else:
        fn = jax.jit(kernel)
    for M in _GPU_M if variant == "default" else (1, 4, 16, 33):
        x, p = make_case(M, K, N, g, True)
        want = _f64_reference(x, p)
        got = np.asarray(fn(x, p), np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(), err_msg=f"M={M}")
        got16 = np.asarray(fn(x.astype(jnp.bfloat16), p), np.float64)
        assert np.linalg.norm(got16 - want) / np.linalg.norm(want) < 2e-2, (M, K, N, g)


@pytest.mark.parametrize("op,mode", [("weight_only", "w4a16"), ("dyn_quant", "w4a8")])
@pytest.mark.parametrize("M", [2, 40])
def test_config_protocol_search_space_is_accepted_by_the_kernel(op, mode, M):
    x, p = make_case(M, 128, 16, 32, False)
    call = base.Int4Call.of(op, x, p)
    assert triton.Config.heuristics(call) == triton.heuristics(M, 16, 128, 32, mode=mode)
    assert triton.Config.heuristics(call, {"num_sms": 8}) == triton.heuristics(
        M, 16, 128, 32, mode=mode, num_sms=8
    )
    space = triton.Config.search_space(call)
    assert space and all(isinstance(c, triton.Config) for c in space)
    fn = triton.weight_only_matmul if op == "weight_only" else triton.dyn_quant_matmul
    for tiles in {(c.block_m, c.block_n, c.block_k, c.split_k) for c in space}:
        out = jax.eval_shape(lambda x, p: fn(x, p, config=triton.Config(*tiles), interpret=True), x, p)
        assert out.shape == (M, 16)


def test_autotune_int4_interpret_picks_a_candidate_and_caches():
    from pallas_kernels.attention import autotune

    x, p = make_case(2, 128, 16, 32, False)
    cands = [
        triton.Config(block_m=16, block_n=16, block_k=64),
        triton.Config(block_m=16, block_n=32, block_k=64),
    ]
    autotune.clear_cache()
    best = autotune.autotune_int4(x, p, "dyn_quant", candidates=cands, interpret=True, repeats=1)
    assert best in cands
    # Cached: no candidate is run again (an empty candidate list would otherwise fail).
    assert autotune.autotune_int4(x, p, "dyn_quant", candidates=[], interpret=True) == best
    got = triton.dyn_quant_matmul(x, p, config=best, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference(x, p)))
    with pytest.raises(ValueError, match="op"):
        autotune.autotune_int4(x, p, "nope", interpret=True)
    autotune.clear_cache()
