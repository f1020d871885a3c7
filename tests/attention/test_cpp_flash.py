"""The C++ CPU flash kernel (jax.ffi) on the shared grid, its dispatch on CPU, and its threads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends._src import attention_dispatch as D
from pallas_kernels.attention import base, cpp_flash
from tests.attention.attention_base import (
    AttentionTestBase,
    Case,
    assert_close,
    grads_of,
    make_case,
    normal,
    outputs_and_grads,
    seeds,
    uniform,
)

pytestmark = pytest.mark.skipif(
    not cpp_flash.available(), reason="C++ flash kernel not built or no AVX2 + FMA here"
)

# Small, unequal tiles: every grid case spans several ragged blocks (forward and backward differ).
CFG = cpp_flash.Config(block_q=5, block_k=16, block_q_bwd=7, block_k_bwd=32)


@pytest.fixture(params=cpp_flash.ISAS)
def isa(request):
    """Runs the test on each code path of the kernels this CPU has (skips the others)."""
    if not cpp_flash.set_isa(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    cpp_flash.set_isa("")


class TestCpuFlash(AttentionTestBase):
    """The shared grid and properties, on every code path this CPU runs."""

    @pytest.fixture(autouse=True)
    def _each_isa(self, isa):
        del isa

    impl = staticmethod(functools.partial(cpp_flash.attention, config=CFG))
    supports_dropout = False
    unsupported_error = NotImplementedError


def _check(args, cfg=None, tol=2e-5):
    impl = functools.partial(cpp_flash.attention, config=cfg)
    out, lse = jax.jit(impl)(args)
    ref, ref_lse = base.reference(args)
    assert_close(out, ref, tol, "out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    g = grads_of(impl, args, jit=True)
    r = grads_of(base.reference, args, jit=True)
    for name, a, b in zip(("dq", "dk", "dv"), g, r):
        assert_close(a, b, 5e-5 * float(jnp.abs(b).max() + 1), name)


@pytest.fixture
def two_threads():
    cpp_flash.set_threads(2)
    yield
    cpp_flash.set_threads(0)


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("cap", [1.0, 30.0])
def test_soft_cap_matches_reference(cap):
    """The soft cap forward and backward, a tight cap (tanh saturates: large logits, scale 1) and a
    loose one, with causal blocks and odd head dims."""
    key = seeds(9, 3)
    q = 3 * normal(key[0], (2, 70, 4, 24))
    k = normal(key[1], (2, 75, 2, 24))
    v = normal(key[2], (2, 75, 2, 20))
    args = base.make_args(q, k, v, is_causal=True, scale=1.0, logits_soft_cap=cap)
    _check(args, cpp_flash.Config(block_q=13, block_k=32, block_q_bwd=9, block_k_bwd=16), tol=3e-5)


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize(
    "bias_shape, mask_shape",
    [
        ((2, 4, 70, 75), None),
        ((1, 4, 1, 75), (2, 1, 70, 75)),
        (None, (1, 1, 70, 75)),
        ((2, 1, 70, 1), (2, 4, 70, 75)),
    ],
)
def test_bias_and_mask_broadcasts(bias_shape, mask_shape):
    """An additive bias and a boolean mask broadcast over batch / heads (read in place) or T / S
    (materialised), with causal blocks, GQA, a soft cap, rows the mask empties (0, LSE -inf, zero
    gradients) and -inf bias entries; dbias summed over the broadcast dimensions."""
    key = seeds(13, 5)
    q = normal(key[0], (2, 70, 4, 24))
    k = normal(key[1], (2, 75, 2, 24))
    v = normal(key[2], (2, 75, 2, 20))
    kw = {}
    if bias_shape is not None:
        bias = 2 * normal(key[3], bias_shape)
        if bias_shape[-1] > 1:  # some -inf entries (a whole row of them: the reference's grads are NaN)
            bias = jnp.where(uniform(key[4], bias_shape) < 0.05, -jnp.inf, bias)
        kw["bias"] = bias
    if mask_shape is not None:
        mask = uniform(key[4], mask_shape) > 0.3
        kw["mask"] = mask.at[..., 5, :].set(False)  # row 5 sees nothing
    args = base.make_args(q, k, v, is_causal=True, diag_offset=5, logits_soft_cap=8.0, **kw)
    cfg = cpp_flash.Config(block_q=13, block_k=32, block_q_bwd=9, block_k_bwd=16)
    _check(args, cfg, tol=3e-5)
    if bias_shape is None:
        return
    impl = functools.partial(cpp_flash.attention, config=cfg)

    def loss(f, b):
        return (f(args.replace(bias=b))[0] * args.q[..., :20]).sum()

    got = jax.jit(jax.grad(functools.partial(loss, impl)))(args.bias)
    want = jax.jit(jax.grad(functools.partial(loss, base.reference)))(args.bias)
    assert got.shape == args.bias.shape
    assert_close(got, want, 5e-5 * float(jnp.abs(want).max() + 1), "dbias")


@pytest.mark.parametrize("bias_shape", [(1, 1, 200, 190), (2, 1, 200, 190), (1, 4, 200, 190), (1, 1, 1, 190)])
@pytest.mark.usefixtures("isa")
def test_broadcast_bias_gradient_is_summed_in_the_kernel(bias_shape, two_threads):
    """A bias broadcast over batches and / or heads: the kernel writes its gradient in the bias's
    own [1|B, 1|N, T, S] (not B * N copies of dS for XLA to sum), as the HLO's custom call shows,
    on both task splits (one owner of every dbias entry: key-block tasks with a dQ buffer per
    thread; two: whole owners). dq, dk, dv and dbias match the reference, with GQA, a causal mask,
    a soft cap and -inf bias entries, and are the same bits run after run."""
    del two_threads
    key = seeds(17, 5)
    q = normal(key[0], (2, 200, 4, 32))
    k = normal(key[1], (2, 190, 2, 32))
    v = normal(key[2], (2, 190, 2, 24))
    bias = 2 * normal(key[3], bias_shape)
    bias = jnp.where(uniform(key[4], bias_shape) < 0.05, -jnp.inf, bias)
    args = base.make_args(q, k, v, bias=bias, is_causal=True, diag_offset=40, logits_soft_cap=6.0)
    cfg = cpp_flash.Config(block_q_bwd=16, block_k_bwd=32)
    kernel_bias = bias_shape[:2] + (200, 190)
    assert cpp_flash.dbias_dims(q.shape, k.shape, kernel_bias, config=cfg) == bias_shape[:2]
    impl = functools.partial(cpp_flash.attention, config=cfg)

    def loss(f, q, k, v, b):
        out = f(args.replace(q=q, k=k, v=v, bias=b))[0]
        return (out * jnp.cos(jnp.arange(24.0))[None, None, None]).sum()

    grad = jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3)))
    # The backward custom call's results (StableHLO): dbias in the bias's [Bb, Nb], not [B, N].
    calls = [ln for ln in grad.lower(q, k, v, bias).as_text().splitlines() if cpp_flash.BACKWARD_TARGET in ln]
    assert len(calls) == 1, calls
    Bb, Nb = bias_shape[:2]
    assert f"tensor<{Bb}x{Nb}x200x190xf32>" in calls[0]
    assert "tensor<2x4x200x190xf32>" not in calls[0]
    got = grad(q, k, v, bias)
    want = jax.jit(jax.grad(functools.partial(loss, base.reference), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert a.shape == b.shape
        assert_close(a, b, 5e-5 * float(jnp.abs(b).max() + 1), name)
    for _ in range(2):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, grad(q, k, v, bias)), got)


def test_dbias_dims_keeps_every_thread_busy():
    """The kernel sums a broadcast bias's dS itself only where its tasks (one per key block and
    owner of dbias entries) are at least the threads; a full-size bias always gets [B, N]."""
    q, k = (2, 4096, 8, 64), (2, 4096, 2, 64)
    cfg = cpp_flash.Config()  # 256-key backward blocks: 16 of them
    assert cpp_flash.dbias_dims(q, k, (1, 1, 4096, 4096), config=cfg, num_threads=16) == (1, 1)
    assert cpp_flash.dbias_dims(q, k, (1, 1, 4096, 4096), config=cfg, num_threads=17) == (2, 8)
    assert cpp_flash.dbias_dims(q, k, (1, 8, 4096, 4096), config=cfg, num_threads=32) == (1, 8)
    assert cpp_flash.dbias_dims(q, k, (2, 1, 4096, 4096), config=cfg, num_threads=33) == (2, 8)
    assert cpp_flash.dbias_dims(q, k, (2, 8, 4096, 4096), config=cfg, num_threads=1) == (2, 8)
    # The dQ buffers of the workspace follow the split: one per thread with a single owner.
    one = cpp_flash.workspace_bytes(q, k, k, backward=True, config=cfg, num_threads=2)
    shared = cpp_flash.workspace_bytes(
        q, k, k, backward=True, config=cfg, num_threads=2, dbias_of=(1, 1, 4096, 4096)
    )
    assert shared - one == 4 * 2 * 4096 * 8 * 64


@pytest.mark.parametrize("kv_heads, batch", [(1, 1), (2, 2)])
@pytest.mark.usefixtures("isa")
def test_threaded_paths_match_reference(kv_heads, batch, two_threads):
    """Calls big enough for two threads: one (batch, kv head) group -> key-block tasks with a dQ
    buffer per thread; two groups -> whole groups per thread. Head dims not multiples of 16."""
    del two_threads
    key = seeds(7, 3)
    q = normal(key[0], (batch, 300, 2 * kv_heads, 40))
    k = normal(key[1], (batch, 290, kv_heads, 40))
    v = normal(key[2], (batch, 290, kv_heads, 24))
    _check(base.make_args(q, k, v, is_causal=True))
    _check(base.make_args(q, k, v, window=(100, 20)), cpp_flash.Config(block_q=32, block_k=64))


@pytest.mark.usefixtures("isa")
def test_own_threads_match_xla_pool(two_threads):
    """The kernels' threads on XLA's intra-op pool (the default) and on threads of their own (the
    no-pool fallback): the same bits, forward and backward, in both threading modes."""
    del two_threads
    key = seeds(5, 3)
    for kv_heads, batch in ((1, 1), (2, 2)):
        q = normal(key[0], (batch, 200, 2 * kv_heads, 32))
        k = normal(key[1], (batch, 190, kv_heads, 32))
        v = normal(key[2], (batch, 190, kv_heads, 16))
        args = base.make_args(q, k, v, is_causal=True)

        def run(args=args):
            return jax.tree.map(np.asarray, outputs_and_grads(cpp_flash.attention, args, jit=True))

        pooled = run()
        cpp_flash.set_xla_pool(False)
        try:
            own = run()
        finally:
            cpp_flash.set_xla_pool(True)
        jax.tree.map(np.testing.assert_array_equal, own, pooled)
        _check(args)


@pytest.mark.usefixtures("isa")
def test_backward_is_reproducible_across_runs(two_threads):
    """Key-block mode sums per-thread dQ buffers: the same blocks in the same order every run."""
    del two_threads
    key = seeds(11, 3)
    q = normal(key[0], (1, 260, 2, 32))
    k = normal(key[1], (1, 250, 1, 32))
    args = base.make_args(q, k, k, is_causal=True)
    cfg = cpp_flash.Config(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    grad = jax.jit(jax.grad(lambda q: cpp_flash.attention(args.replace(q=q), config=cfg)[0].sum()))
    first = np.asarray(grad(q))
    for _ in range(4):
        np.testing.assert_array_equal(np.asarray(grad(q)), first)


@pytest.mark.usefixtures("isa")
def test_nan_inputs_give_nan_rows():
    args = make_case(Case("float32", "none", 24, 24, 32, 1))
    q = args.q.at[0, 3, 0, 5].set(jnp.nan)
    out, _ = cpp_flash.attention(args.replace(q=q))
    assert bool(jnp.all(jnp.isnan(out[0, 3, 0])))
    assert bool(jnp.all(jnp.isfinite(out[0, 4])))


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True, diag_offset=-20),  # T > S lower-right: whole query blocks empty
        dict(window=(0, 0)),  # one key per query
        dict(window=(9, 2), is_causal=True, diag_offset=5),
    ],
)
@pytest.mark.usefixtures("isa")
def test_block_ranges_match_reference(kw):
    args = make_case(Case("float32", "none", 53, 33, 32, 2))
    args = args.replace(
        **{k: v for k, v in kw.items() if k != "is_causal"}, causal=kw.get("is_causal", False)
    )
    _check(args, cpp_flash.Config(block_q=16, block_k=16, block_q_bwd=8, block_k_bwd=32))


def test_isa_selection():
    """The default path is the best this CPU runs; set_isa switches it and refuses what it lacks."""
    default = cpp_flash.isa()
    assert default in ("avx512", "avx2")  # available() needs AVX2 + FMA at least
    try:
        assert cpp_flash.set_isa("scalar") and cpp_flash.isa() == "scalar"
        assert cpp_flash.set_isa("avx2") and cpp_flash.isa() == "avx2"
        assert cpp_flash.set_isa("avx512") == (default == "avx512")
        with pytest.raises(ValueError, match="name"):
            cpp_flash.set_isa("sse9")
    finally:
        assert cpp_flash.set_isa("")
    assert cpp_flash.isa() == default


@pytest.mark.parametrize("shape", [(3, 1, 1, 1, 1, 1), (2, 83, 3, 97, 24, 40), (1, 130, 2, 7, 17, 5)])
def test_code_paths_agree_on_odd_sizes(shape):
    """Every path this CPU runs against the float64 reference and the others: odd head dims (not
    multiples of 16 or of the 12-row / 32-column AVX-512 tiles), lengths of one, GQA, and Inf / NaN
    inputs (the rows that see them are NaN, as in the reference; the others are untouched)."""
    B, T, N, S, H, Hv = shape
    key = seeds(5, 3)
    q = normal(key[0], (B, T, N, H)).at[-1, T - 1, 0, 0].set(jnp.nan)
    k = normal(key[1], (B, S, 1, H)).at[0, S // 2, 0, 0].set(jnp.inf)
    k = k.at[-1, S - 1, 0, -1].set(jnp.nan)
    v = normal(key[2], (B, S, 1, Hv))
    args = base.make_args(q, k, v, is_causal=True, diag_offset=S - T)
    ref, ref_lse = (np.asarray(x) for x in base.reference(args))
    empty = np.isneginf(ref_lse)  # rows that see no key (0 in both)
    assert empty.any() == (T > S) and np.isnan(ref).any()
    outs = {}
    for name in cpp_flash.ISAS:
        if not cpp_flash.set_isa(name):
            continue
        try:
            out = np.asarray(jax.jit(cpp_flash.attention)(args)[0])
        finally:
            cpp_flash.set_isa("")
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=name)
        fin = np.isfinite(ref)
        np.testing.assert_allclose(out[fin], ref[fin], atol=2e-5, err_msg=name)
        outs[name] = out
    assert len(outs) >= 2


def _flash_on_cpu(args, **flags):
    """FLASH through the dispatcher, lowered for CPU, the way the public API runs it."""
    with jb.with_backends(flash=True, mem_efficient=False, math=False, cudnn=False, **flags):
        return D.run(args, jb.current_flags(), ("cpu",))


def test_dispatch_runs_it_on_cpu_and_says_why_not():
    args = make_case(Case("float32", "top_left", 40, 40, 32, 2))
    with jb.with_backends(flash=True):
        d = D.decide(args, jb.current_flags(), "cpu")
    assert d.implementation.name == "cpp_flash" and d.implementation_reasons == {
        "xla_flash": "lower priority than cpp_flash"
    }
    hlo = jax.jit(lambda a: _flash_on_cpu(a)[0]).lower(args).as_text()
    assert "jb_flash_attention_fwd_f32" in hlo
    hlo = jax.jit(lambda a: _flash_on_cpu(a, flash_cpu_kernel="xla")[0]).lower(args).as_text()
    assert "jb_flash_attention_fwd_f32" not in hlo
    drop = make_case(Case("float32", "top_left", 40, 40, 32, 2, dropout=0.25))
    with jb.with_backends(flash=True):
        d = D.decide(drop, jb.current_flags(), "cpu")
    assert d.implementation.name == "xla_flash" and "dropout" in d.implementation_reasons["cpp_flash"]
    assert "jb_flash" not in jax.jit(lambda a: _flash_on_cpu(a)[0]).lower(drop).as_text()
    # The XLA path gives the same answer as the kernel, soft cap included.
    for a in (args, args.replace(logits_soft_cap=5.0)):
        assert_close(_flash_on_cpu(a)[0], _flash_on_cpu(a, flash_cpu_kernel="xla")[0], 2e-5, "out")
    # Forcing the kernel where it cannot run is an error naming why, never a silent fallback.
    with pytest.raises(D.NoAvailableBackendError, match="dropout"):
        _flash_on_cpu(drop, flash_cpu_kernel="cpp")
    with pytest.raises(NotImplementedError, match="dropout"):
        cpp_flash.attention(drop)
    with pytest.raises(ValueError, match="flash_cpu_kernel"):
        jb.with_backends(flash_cpu_kernel="fast")
    assert "CPU only" in " ".join(cpp_flash.unsupported(args, "tpu"))


def test_tpu_export_lowers_the_xla_code():
    args = make_case(Case("float32", "top_left", 24, 24, 32, 1))

    def f(q, k, v, platforms):
        with jb.with_backends(flash=True, mem_efficient=False, math=False, cudnn=False):
            return D.run(args.replace(q=q, k=k, v=v), jb.current_flags(), platforms)[0]

    exp = jax.export.export(jax.jit(functools.partial(f, platforms=("tpu",))), platforms=["tpu"])(
        args.q, args.k, args.v
    )
    assert "jb_flash_attention_fwd_f32" not in exp.mlir_module()
    # A CPU export carries the kernel, a custom call JAX cannot promise to keep stable: it asks
    # for an explicit opt-in (or flash_cpu_kernel="xla" for a portable artifact).
    both = jax.jit(functools.partial(f, platforms=("cpu", "tpu")))
    with pytest.raises(ValueError, match="jb_flash_attention_fwd_f32"):
        jax.export.export(both, platforms=["cpu", "tpu"])(args.q, args.k, args.v)
    checks = [jax.export.DisabledSafetyCheck.custom_call(cpp_flash.FORWARD_TARGET)]
    exp = jax.export.export(both, platforms=["cpu", "tpu"], disabled_checks=checks)(args.q, args.k, args.v)
    assert "jb_flash_attention_fwd_f32" in exp.mlir_module()  # the CPU branch
    assert_close(exp.call(args.q, args.k, args.v), base.reference(args)[0], 2e-5, "exported")


def test_vmap_and_low_precision_inputs():
    args = make_case(Case("bfloat16", "lower_right", 20, 30, 32, 2))
    out, lse = cpp_flash.attention(args)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    qs = jnp.stack([args.q, args.q * 0.5])
    got = jax.vmap(lambda q: cpp_flash.attention(args.replace(q=q))[0])(qs)
    for i in range(2):
        want = cpp_flash.attention(args.replace(q=qs[i]))[0]
        np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32))


def test_config_validation():
    with pytest.raises(ValueError, match="block_k"):
        cpp_flash.Config(block_k=24)
    with pytest.raises(ValueError, match="block_q"):
        cpp_flash.Config(block_q=0)
    assert cpp_flash.threads() >= 1


@pytest.mark.usefixtures("isa")
def test_scores_jumping_between_key_blocks():
    """The forward's one-pass softmax against the running max recomputes a row whose scores jump
    by more than its slack (2^64) in a later key block; small jumps take the one-pass route."""
    key = seeds(3, 3)
    q = normal(key[0], (1, 40, 2, 32))
    k = normal(key[1], (1, 96, 2, 32))
    v = normal(key[2], (1, 96, 2, 32))
    cfg = cpp_flash.Config(block_q=8, block_k=16, block_q_bwd=8, block_k_bwd=16)
    u = jnp.ones((32,), jnp.float32) / jnp.sqrt(32.0)
    scale = 1 / np.sqrt(32)
    for jump in (3.0, 60.0):  # natural-log logits grow by `jump` per key block: one pass / recompute
        ramp = (jump / scale) * (jnp.arange(96) // 16).astype(jnp.float32)
        kk = k * 0.1 + ramp[None, :, None, None] * u[None, None, None, :]
        qq = q * 0.1 + u[None, None, None, :]
        args = base.make_args(qq, kk, v, is_causal=True, diag_offset=56)
        lse_ref = base.reference(args)[1]
        assert float(jnp.max(lse_ref)) > 5 * jump  # several blocks' worth of growth
        # Logits of a few hundred carry ~1e-5 absolute float32 rounding in any summation order.
        _check(args, cfg, tol=5e-5 if jump < 10 else 3e-4)


@pytest.mark.parametrize("name", ["pallas_kernels.attention.cpp_flash", "pallas_kernels.attention.xla_flash"])
def test_docstring_examples(name):
    import doctest  # noqa: PLC0415
    import importlib  # noqa: PLC0415

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


amx_only = pytest.mark.skipif(
    not cpp_flash.amx(), reason="no AMX-BF16 here (or the OS refused the tile state)"
)


def _bf16_qkv(seed, B, T, S, N, K, H, Hv):
    key = seeds(seed, 3)
    q = normal(key[0], (B, T, N, H)).astype(jnp.bfloat16)
    k = normal(key[1], (B, S, K, H)).astype(jnp.bfloat16)
    v = normal(key[2], (B, S, K, Hv)).astype(jnp.bfloat16)
    return q, k, v


def _f32_args(args):
    """The same call on float32 copies of the bf16 values (the reference's inputs)."""
    return args.replace(
        q=args.q.astype(jnp.float32), k=args.k.astype(jnp.float32), v=args.v.astype(jnp.float32)
    )


def _amx_and_widened(args, cfg=None):
    """(out, lse) of the bf16 forward on AMX tiles and widened to float32 (set_amx(False))."""
    impl = jax.jit(functools.partial(cpp_flash.attention, config=cfg))
    assert cpp_flash.amx()
    amx = impl(args)
    try:
        assert not cpp_flash.set_amx(False)
        wide = impl(args)  # the same executable: the choice is read when the kernel runs
    finally:
        assert cpp_flash.set_amx(True)
    return amx, wide


@amx_only
@pytest.mark.parametrize(
    "shape, kw",
    [
        ((2, 83, 97, 3, 1, 24, 40), dict(is_causal=True, diag_offset=14)),  # odd sizes, GQA
        ((1, 130, 7, 2, 1, 17, 5), dict(is_causal=True, diag_offset=-123)),  # rows that see no key
        ((1, 300, 300, 4, 2, 128, 128), dict(is_causal=True)),  # head dim 128, ragged blocks
        ((1, 200, 260, 2, 2, 80, 72), dict(window=(50, 10))),  # a local window, Hv % 32 == 8
        ((2, 70, 75, 4, 2, 64, 48), dict(logits_soft_cap=8.0, bias="bias", mask="mask")),
        ((2, 48, 48, 2, 1, 32, 16), dict(q_segment_ids="seg", kv_seg="seg", kv_seq_lengths=(40, 48))),
    ],
)
def test_amx_bf16_forward_matches_reference(shape, kw):
    """The AMX forward of bf16 inputs against a float32 reference on the same bf16 values: the lse
    to float32 rounding (its products are exact in float32, its exponentials within 3e-6), the
    output to bf16's (its probabilities are rounded to bf16 for p v), and beside the widened float32
    path (set_amx(False)), with the same rows empty."""
    B, T, S, N, K, H, Hv = shape
    q, k, v = _bf16_qkv(sum(shape), *shape)
    key = seeds(7, 3)
    kw = dict(kw)
    if kw.get("bias") == "bias":
        kw["bias"] = 2 * normal(key[0], (B, 1, T, S))
        kw["mask"] = (uniform(key[1], (1, N, T, S)) > 0.3).at[..., 5, :].set(False)
    if kw.get("q_segment_ids") == "seg":
        seg = jnp.broadcast_to((jnp.arange(T) >= T // 3).astype(jnp.int32), (B, T))
        kw["q_segment_ids"] = kw["kv_segment_ids"] = seg
        del kw["kv_seg"]
        kw["kv_seq_lengths"] = jnp.array(kw["kv_seq_lengths"], jnp.int32)
    args = base.make_args(q, k, v, **kw)
    (out, lse), (wout, wlse) = _amx_and_widened(args, cpp_flash.Config(block_q=37, block_k=48))
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    ref, ref_lse = base.reference(_f32_args(args))
    empty = np.isneginf(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
    np.testing.assert_array_equal(np.isneginf(np.asarray(wlse)), empty)
    fin = ~empty
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=3e-5, rtol=1e-5)
    out32, ref = np.asarray(out, np.float32), np.asarray(ref)
    scale = np.abs(ref).max()
    # bf16 rounding of the output (2^-9 relative) plus that of the probabilities, never more; the
    # widened path rounds only its output. A key dropped or misplaced (weight ~1/S) fails these.
    wout32 = np.asarray(wout, np.float32)
    np.testing.assert_allclose(wout32, ref, atol=1e-3 * scale, rtol=4e-3)
    np.testing.assert_allclose(out32, wout32, atol=2e-3 * scale, rtol=8e-3)
    np.testing.assert_allclose(out32, ref, atol=2e-3 * scale, rtol=1e-2)
    assert np.abs(out32 - ref).mean() < 2e-3 * scale  # typical errors are bf16 rounding
    if empty.any():  # rows that see no key: 0
        rows = np.moveaxis(empty, 1, 2)  # [B, T, N]
        assert not out32[rows].any()


@amx_only
def test_amx_bf16_gradients_and_nonfinite_inputs():
    """The backward (float32 kernels) from the AMX forward's residuals matches the reference's
    gradients; a NaN query gives a NaN row, an inf key NaN rows where the reference has them."""
    q, k, v = _bf16_qkv(11, 1, 90, 110, 4, 2, 64, 64)
    args = base.make_args(q, k, v, is_causal=True, diag_offset=20)
    impl = functools.partial(cpp_flash.attention, config=cpp_flash.Config(block_q=32, block_k=64))
    g = grads_of(impl, args, jit=True)
    r = grads_of(base.reference, _f32_args(args), jit=True)
    for name, a, b in zip(("dq", "dk", "dv"), g, r):
        assert a.dtype == jnp.bfloat16
        assert_close(a.astype(jnp.float32), b, 2e-2 * float(jnp.abs(b).max()), name)
    bad = args.replace(q=args.q.at[0, 7, 1, 3].set(jnp.nan), k=args.k.at[0, 50, 0, 0].set(jnp.inf))
    (out, _), (wout, _) = _amx_and_widened(bad)
    ref = np.asarray(base.reference(_f32_args(bad))[0])
    for o in (out, wout):
        np.testing.assert_array_equal(np.isnan(np.asarray(o, np.float32)), np.isnan(ref))
    assert np.isnan(ref[0, 7, 1]).all() and np.isfinite(np.delete(ref[0, :30], 7, axis=0)).all()


@amx_only
def test_amx_scores_jumping_between_key_blocks():
    """The AMX forward's one-pass softmax recomputes a row (on AVX512-BF16) whose scores jump past
    its slack in a later key block, as the float32 path does: with raw scores (scaled in the
    softmax) and with a bias (scores scaled first)."""
    key = seeds(3, 3)
    u = jnp.ones((32,), jnp.float32) / jnp.sqrt(32.0)
    ramp = (60.0 * np.sqrt(32)) * (jnp.arange(128) // 32).astype(jnp.float32)
    q = (normal(key[0], (1, 40, 2, 32)) * 0.1 + u[None, None, None, :]).astype(jnp.bfloat16)
    k = normal(key[1], (1, 128, 2, 32)) * 0.1 + ramp[None, :, None, None] * u[None, None, None, :]
    k = k.astype(jnp.bfloat16)
    v = normal(key[2], (1, 128, 2, 32)).astype(jnp.bfloat16)
    bias = 0.5 * normal(key[0], (1, 1, 40, 128))
    for kw in ({}, {"bias": bias}):
        args = base.make_args(q, k, v, is_causal=True, diag_offset=88, **kw)
        (out, lse), _ = _amx_and_widened(args, cpp_flash.Config(block_q=8, block_k=32))
        ref, ref_lse = base.reference(_f32_args(args))
        assert float(jnp.max(ref_lse)) > 150  # several blocks' worth of growth
        # Logits of a few hundred: float32 sums in another order differ by ~1e-5 of them.
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-3)
        assert_close(out.astype(jnp.float32), ref, 1e-2 * float(jnp.abs(ref).max()), "out")


def _finite_against_reference(args):
    """(out, lse, ref, ref_lse) as float32 numpy of the forward (key blocks of 32) and the reference
    on the same values, the forward's all finite."""
    out, lse = jax.jit(functools.partial(cpp_flash.attention, config=cpp_flash.Config(block_k=32)))(args)
    ref, ref_lse = base.reference(_f32_args(args))
    out, lse, ref, ref_lse = (np.asarray(x, np.float32) for x in (out, lse, ref, ref_lse))
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_additive_mask_with_growing_scores(dtype):
    """A bias of -1e9 (base-2 logits near -1.44e9, where float32 steps are 128) on rows whose scores
    grow past the one-pass softmax's slack from key block to key block: the check that triggers the
    recompute must bound the exponents actually taken (m + slack rounds to m + 128 there), or one
    reaches 2^128 = inf and the row turns NaN. On the float32 path, and on the bf16 one (AMX where
    the CPU has it)."""
    rng = np.random.default_rng(0)
    B, T, S, N, H = 1, 4, 512, 1, 64
    q = rng.standard_normal((B, T, N, H))
    k = rng.standard_normal((B, S, N, H)) * (1 + np.arange(S) / 20)[None, :, None, None]
    v = rng.standard_normal((B, S, N, H))
    bias = np.zeros((1, 1, T, S), np.float32)
    bias[:, :, 1::2, :] = -1e9  # rows 1 and 3: an additive padding mask
    dt = jnp.dtype(dtype)
    args = base.make_args(*(jnp.asarray(x, dt) for x in (q, k, v)), bias=jnp.asarray(bias))
    out, lse, ref, ref_lse = _finite_against_reference(args)
    # Rows 0 and 2 against the reference; rows 1 and 3 lose the scores' low bits to the bias's
    # rounding (the reference too, in another order): a convex combination of v and the lse near it.
    np.testing.assert_allclose(out[:, 0::2], ref[:, 0::2], atol=2e-2 * np.abs(ref).max())
    np.testing.assert_allclose(lse[..., 0::2], ref_lse[..., 0::2], atol=1e-2)
    vmax = np.abs(np.asarray(args.v, np.float32)).max(axis=1)  # [B, N, H]
    assert (np.abs(out[:, 1::2]) <= vmax[:, None] * (1 + 1e-5)).all()
    np.testing.assert_allclose(lse[..., 1::2], ref_lse[..., 1::2], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_huge_logits(dtype):
    """Logits past 2^31 (q and k entries ~3e4): the softmax's largest exponent must be exactly 0, so
    the rows stay finite (one-hot on their largest logit) on the float32 path and on the bf16 one,
    whose raw scores are scaled inside the exponent's arithmetic (AMX where the CPU has it)."""
    key = seeds(5, 3)
    dt = jnp.dtype(dtype)
    q = (3e4 * normal(key[0], (1, 24, 2, 64))).astype(dt)
    k = (3e4 * normal(key[1], (1, 96, 2, 64))).astype(dt)
    v = normal(key[2], (1, 96, 2, 64)).astype(dt)
    out, lse, ref, ref_lse = _finite_against_reference(base.make_args(q, k, v))
    assert np.abs(ref_lse).max() > 2.0**31 * np.log(2)  # base-2 logits past 2^31
    np.testing.assert_allclose(out, ref, atol=1e-2 * np.abs(ref).max())
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_amx_switch():
    """set_amx turns the AMX bf16 forward off and on (where the CPU has it) and checks its argument;
    paths other than avx512 never use it."""
    has = cpp_flash.amx()
    with pytest.raises(TypeError, match="on"):
        cpp_flash.set_amx(1)
    try:
        assert cpp_flash.set_amx(False) is False
        assert cpp_flash.set_amx(True) is has
        if cpp_flash.set_isa("avx2"):
            assert not cpp_flash.amx()
    finally:
        cpp_flash.set_isa("")
        cpp_flash.set_amx(True)
    assert cpp_flash.amx() is has
    # bf16 inputs call the bf16 kernel (AMX or widened at run time), others the float32 one.
    args = make_case(Case("bfloat16", "top_left", 40, 40, 32, 2))
    hlo = jax.jit(lambda a: cpp_flash.attention(a)[0]).lower(args).as_text()
    assert cpp_flash.FORWARD_BF16_TARGET in hlo and cpp_flash.FORWARD_TARGET not in hlo


@pytest.mark.parametrize("low", [-1e9, -3e38, -300.0])
@pytest.mark.usefixtures("isa")
def test_rows_of_large_negative_logits_keep_their_gradients(low, two_threads):
    """Query rows whose every key carries a large negative bias (the padded rows of
    ``jnp.where(mask, 0, -1e9)``), under a cotangent that does not ignore them: gradients (dbias
    included) as the reference's. The backward's P = 2^(s - lse2) lost log2(l) in lse2 ~ -1.44e9
    (ulp 128): P was 1 where it is 1/S, and those rows' gradients S times too large."""
    del two_threads
    key = seeds(3, 4)
    B, T, S = 2, 45, 70
    q = normal(key[0], (B, T, 2, 32))
    k = normal(key[1], (B, S, 1, 32))
    v = normal(key[2], (B, S, 1, 24))
    rows = jnp.arange(T)[None, :] < jnp.array([30, T])[:, None]
    bias = jnp.where(rows[:, None, :, None], normal(key[3], (B, 1, T, S)), low)
    bias = bias.at[0, 0, 40, :5].set(-jnp.inf)  # a large row that also has masked keys
    args = base.make_args(q, k, v, bias=bias)
    _check(args, CFG)
    got = grads_of(functools.partial(cpp_flash.attention, config=CFG), args, jit=True)[3]
    want = grads_of(base.reference, args, jit=True)[3]
    assert_close(got, want, 5e-5 * float(jnp.abs(want).max() + 1), "dbias")
