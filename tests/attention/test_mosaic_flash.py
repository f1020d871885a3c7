"""The Mosaic GPU flash kernel (``pallas_kernels.attention.mosaic_flash``) without a GPU.

* Parity: on jax >= 0.11.2 the kernels run in Pallas's GPU interpret mode (threads, barriers, TMA and
  WGMMA simulated on CPU, with its race detector on) against the float32 reference, forward and
  gradients (the Mosaic dQ and dK / dV kernels; Triton's backward, interpreted too, at head dim 256).
  The interpreted program stages ``P`` / ``dS`` through shared memory (the interpreter takes no WGMMA
  operand from registers); the compiled one is checked in the GPU lane
  (``tests/attention/test_gpu_lane.py``). The interpreter's race and barrier-phase checks depend on
  how its threads interleave (a kernel with a wait removed was caught in some runs, not all), so no
  test here relies on them catching a mutation.
* Export: on every supported jax the forward and its gradient lower for CUDA from CPU (Pallas lowers
  the kernel to the Mosaic GPU dialect here), and a cpu + cuda export runs on CPU.
* What it refuses, and the ``flash_cuda_kernel`` flag that selects it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jbackends as jb
from jbackends import SDPBackend
from pallas_kernels import gpu
from pallas_kernels.attention import base, mosaic_flash
from tests.attention.attention_base import AttentionTestBase, Case, make_case

needs_interpret = pytest.mark.skipif(
    not mosaic_flash.interpret_available(), reason="Mosaic GPU interpret mode needs jax >= 0.11.2"
)

# What the kernel adds, each at least once: one program and one key block; causal with GQA over two
# query tiles and a ring of two; ragged T and S with a bottom-right diagonal (keys padded and masked in
# the last block); fewer keys than one block with two batches and two kv heads; a ring reused over
# five blocks (causal: the first warpgroup releases the slots it skips); head dim 256 (64-key blocks);
# a bottom-right diagonal with more queries than keys (a negative offset: the first 70 rows see no key,
# output 0 and LSE -inf); the logits soft cap, forward and backward (at head dim 256 Triton's backward),
# with rows that see no key too; causal at head dim 256 (64-key forward blocks); boolean masks (a ring of
# int8 tiles, transposed for dK / dV; every block masked) with causal, GQA, ragged lengths, segment ids,
# dropout and lengths; an additive bias (a ring of tiles in the inputs' dtype, transposed for dK / dV;
# its gradient from the dQ kernel's dS) with causal, GQA, soft cap, dropout, lengths and a mask (refused at
# head dim 256: shared memory). Local windows are in WINDOW_GRID.
# The default run keeps a few of the cases below, one or more of each feature (`_extended` marks the
# others, and `pytest.mark.extended` the heavier checks of the class below: the GPU interpreter takes
# 10-50 s a case on one core; `pytest --extended`, and CI's gpu-machine environment, run all of them).
_EXTENDED: set = set()


def _extended(case):
    """``case``, left out of the default run (an interpret-mode case costs 5-40 s on one core)."""
    _EXTENDED.add(case)
    return case


def _params(cases, ids):
    return [
        pytest.param(
            *c, id=i, marks=[pytest.mark.extended] if (c if len(c) > 1 else c[0]) in _EXTENDED else []
        )
        for c, i in zip(cases, ids)
    ]


MOSAIC_GRID = [
    Case("bfloat16", "none", 128, 128, 64, 1, K=1, B=1),
    _extended(Case("float16", "top_left", 256, 256, 64, 2, K=1, B=1)),
    _extended(Case("bfloat16", "lower_right", 200, 333, 128, 2, K=2, B=1, jit=False)),
    Case("float16", "none", 100, 70, 64, 1, K=2, B=2),
    _extended(Case("bfloat16", "top_left", 384, 640, 128, 1, K=1, B=1)),
    Case("bfloat16", "none", 128, 64, 256, 1, K=1, B=1),
    Case("float16", "lower_right", 200, 130, 64, 2, K=1, B=1),
    Case("bfloat16", "top_left", 256, 300, 128, 2, K=1, B=1, extra="softcap"),
    _extended(Case("float16", "none", 128, 200, 256, 1, K=1, B=1, extra="softcap")),
    _extended(Case("float16", "lower_right", 200, 130, 64, 1, K=1, B=1, extra="softcap")),
    _extended(Case("bfloat16", "top_left", 200, 200, 256, 2, K=1, B=1)),
    _extended(Case("bfloat16", "none", 200, 333, 64, 2, K=1, B=2, extra="segments")),
    _extended(Case("float16", "top_left", 256, 256, 128, 1, K=2, B=1, extra="segments")),
    _extended(Case("bfloat16", "lower_right", 130, 200, 256, 1, K=1, B=1, extra="segments")),
    Case("bfloat16", "top_left", 256, 256, 64, 2, K=1, B=2, dropout=0.25),
    _extended(Case("float16", "none", 200, 333, 128, 1, K=2, B=1, dropout=0.25, extra="segments")),
    _extended(Case("bfloat16", "lower_right", 130, 200, 256, 1, K=1, B=1, dropout=0.25)),
    _extended(Case("bfloat16", "none", 200, 333, 64, 2, K=1, B=2, extra="lengths")),
    _extended(Case("float16", "top_left", 256, 300, 128, 1, K=2, B=2, extra="lengths", dropout=0.25)),
    _extended(Case("bfloat16", "lower_right", 130, 200, 256, 1, K=1, B=2, extra="lengths")),
    _extended(Case("bfloat16", "none", 256, 256, 64, 1, K=1, B=1, mask="bool")),
    _extended(Case("float16", "lower_right", 130, 200, 128, 2, K=1, B=2, mask="bool")),
    _extended(Case("bfloat16", "top_left", 300, 300, 256, 1, K=1, B=2, mask="bool", extra="segments")),
    Case("float16", "none", 130, 200, 64, 2, K=2, B=2, mask="bool", dropout=0.25, extra="lengths"),
    Case("bfloat16", "none", 256, 256, 64, 1, K=1, B=1, mask="additive"),
    _extended(Case("float16", "lower_right", 200, 333, 128, 2, K=1, B=1, mask="additive", extra="softcap")),
    _extended(
        Case(
            "bfloat16", "top_left", 300, 300, 64, 2, K=1, B=2, mask="additive", dropout=0.25, extra="lengths"
        )
    ),
    _extended(Case("float16", "none", 130, 200, 128, 1, K=1, B=1, mask="additive", extra="segments")),
]

# Local windows (left, right): the ring starts past block 0, the second warpgroup releases the blocks
# before its band first, and a band has masked blocks on both sides of its mask-free ones. Wide
# enough that some blocks are mask-free (at 128-key forward / 64-row backward blocks); a window with
# a causal diagonal (its right side ignored past it); one that leaves the last rows without a key
# (output 0, LSE -inf); with segment ids, dropout, lengths and the soft cap; head dim 256 (64-key
# forward blocks, the Triton backward).
WINDOW_GRID = [
    _extended((Case("bfloat16", "none", 640, 640, 64, 1, K=1, B=1), (130, 70))),
    _extended((Case("float16", "lower_right", 200, 333, 128, 2, K=1, B=1), (100, 40))),
    (Case("bfloat16", "top_left", 300, 100, 64, 1, K=1, B=1), (20, 0)),
    _extended((Case("float16", "none", 300, 300, 256, 1, K=1, B=1, extra="segments"), (64, 64))),
    _extended(
        (Case("bfloat16", "none", 256, 384, 64, 2, K=1, B=2, extra="lengths", dropout=0.25), (90, 150))
    ),
    _extended((Case("float16", "top_left", 384, 384, 128, 1, K=1, B=1, extra="softcap"), (150, 0))),
]


@needs_interpret
class TestMosaicFlashInterpret(AttentionTestBase):
    impl = staticmethod(functools.partial(mosaic_flash.attention, interpret=True))
    dtypes = ("bfloat16", "float16")

    def supports(self, args):
        return not mosaic_flash.unsupported(args, "cuda", compute_capability=9.0)

    @pytest.mark.parametrize("case", _params([(c,) for c in MOSAIC_GRID], [c.id for c in MOSAIC_GRID]))
    def test_grid(self, case):
        args = make_case(case, seed=case.T + case.S)
        assert self.supports(args), mosaic_flash.unsupported(args, "cuda", compute_capability=9.0)
        self.check(args, jit=case.jit)

    @pytest.mark.parametrize(
        "case, window", _params(WINDOW_GRID, [f"{c.id}-w{w[0]}_{w[1]}" for c, w in WINDOW_GRID])
    )
    def test_window(self, case, window):
        args = make_case(case, seed=case.T + case.S).replace(window=window)
        assert self.supports(args), mosaic_flash.unsupported(args, "cuda", compute_capability=9.0)
        self.check(args)

    @pytest.mark.parametrize("shape", ["per_head", pytest.param("key_padding", marks=pytest.mark.extended)])
    def test_mask_broadcasts_and_empties_rows(self, shape):
        """A mask per query head ``[1, N, T, S]`` and a key-padding mask ``[B, 1, 1, S]`` (broadcast over
        batch / heads / rows in the kernels' tiles), each leaving some rows without a key (output 0,
        LSE -inf), with a local window: against the reference, gradients included."""
        args = make_case(Case("bfloat16", "top_left", 130, 260, 64, 2, K=1, B=2), seed=11)
        rng = np.random.default_rng(4)
        if shape == "per_head":
            mask = rng.random((1, 2, 130, 260)) > 0.4
            mask[:, 1, 100:120] = False
        else:
            mask = np.ones((2, 1, 1, 260), bool)
            mask[0, ..., 100:] = False
            mask[1, ..., :30] = False  # causal: batch 1's first 30 rows see no key
        args = args.replace(mask=jnp.asarray(mask), window=(120, 0))
        assert self.supports(args), mosaic_flash.unsupported(args, "cuda", compute_capability=9.0)
        self.check(args)

    @pytest.mark.parametrize(
        "what, causal", [("segments", "none"), pytest.param("mask", "top_left", marks=pytest.mark.extended)]
    )
    def test_tiles_without_a_visible_pair_are_skipped(self, what, causal):
        """Five packed sequences per row (sorted segment ids), or a per-head block-diagonal mask: most
        tiles have no visible pair and are released without a multiply (the block flags say which;
        the forward, dQ and dK / dV kernels each skip some): against the reference, gradients
        included; causal too."""
        case = Case("bfloat16", causal, 512, 512, 64, 2, K=1, B=1)
        args = make_case(case, seed=9)
        docs = jnp.arange(512, dtype=jnp.int32) * 5 // 512  # ~102 rows each: tiles span two
        if what == "segments":
            args = args.replace(q_segment_ids=docs[None], kv_segment_ids=docs[None])
        else:  # head 0: the five diagonal blocks; head 1: the same, shifted by 64 keys
            m0 = docs[:, None] == docs[None, :]
            m1 = docs[:, None] == ((jnp.arange(512) + 64) % 512 * 5 // 512)[None, :]
            args = args.replace(mask=jnp.stack([m0, m1])[None])
        cfg, bwd = mosaic_flash.Config.heuristics(64), mosaic_flash.BwdConfig()
        s = mosaic_flash._shape(args, cfg)
        extras = mosaic_flash._kernel_extras(mosaic_flash._extras(args), s, 2)
        for rows, keys in ((64, cfg.block_kv), (64, bwd.block_kv_dq), (bwd.block_q_dkv, 64)):
            flags = mosaic_flash._block_flags(extras, s, rows, keys)
            assert 0 < int((flags == 0).sum()) < flags.size, (rows, keys)
        self.check(args)

    @pytest.mark.extended
    def test_bias_broadcasts_with_a_mask_and_minus_inf(self):
        """A bias per batch over the keys ``[B, 1, 1, S]`` (ALiBi-like, broadcast over heads and rows)
        with a boolean mask and ``-inf`` entries (whole rows of them: output 0, LSE -inf), causal with a
        window: forward and gradients (dbias summed over the broadcast dimensions) against the
        reference."""
        args = make_case(Case("float16", "top_left", 256, 300, 64, 2, K=1, B=2, mask="bool"), seed=5)
        rng = np.random.default_rng(6)
        bias = rng.normal(size=(2, 1, 1, 300)).astype(np.float32)
        bias[0, ..., 10:40] = -np.inf
        mask = np.asarray(args.mask).copy()
        mask[1, :, 100:120] = False  # rows with no key in batch 1
        args = args.replace(bias=jnp.asarray(bias, jnp.float16), mask=jnp.asarray(mask), window=(150, 0))
        assert self.supports(args), mosaic_flash.unsupported(args, "cuda", compute_capability=9.0)
        self.check(args)

    @pytest.mark.extended
    def test_finfo_min_padding_bias_like_jax_nn(self):
        """The usual additive padding mask (bf16 ``finfo.min`` on padded keys and queries): a padded row
        is the mean of V as in jax.nn (``(logits + bias) * log2(e)`` overflowed to -inf, and such a row
        looked fully masked). Gradients where the padded rows' cotangent is 0, as in training (the
        backward rebuilds P from the float32 LSE alone: docs/attention.md)."""
        rng = np.random.default_rng(5)
        B, T, N, H = 1, 128, 1, 64
        q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.bfloat16) for _ in range(3))
        ok = jnp.arange(T) < 80
        bias = jnp.where(ok[:, None] & ok[None, :], 0.0, jnp.finfo(jnp.bfloat16).min)[None, None]
        bias = bias.astype(jnp.bfloat16)
        ct = jnp.where(ok[None, :, None, None], jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32), 0.0)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

        def loss(f):
            return lambda q, k, v: jnp.sum(f32(f(q, k, v)) * ct)

        ours = lambda q, k, v: self.impl(base.make_args(q, k, v, bias=bias))[0]  # noqa: E731
        theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=f32(bias))  # noqa: E731
        np.testing.assert_allclose(
            np.asarray(f32(ours(q, k, v))), np.asarray(theirs(f32(q), f32(k), f32(v))), atol=1e-2, rtol=1e-2
        )
        got = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(loss(theirs), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(f32(a)), np.asarray(b), atol=3e-2, rtol=3e-2)

    @pytest.mark.extended
    def test_fully_masked_rows_give_zero_output_and_grads(self):
        """Rows a bottom-right diagonal leaves without a key: output 0, LSE -inf, zero finite grads."""
        args = make_case(Case("float16", "lower_right", 256, 100, 64, 1, K=1, B=1))
        out, lse = jax.jit(self.run)(args)
        empty = 256 - 100  # rows i < T - S see no key
        assert float(jnp.abs(out[:, :empty].astype(jnp.float32)).max()) == 0.0
        assert bool(jnp.all(jnp.isneginf(lse[:, :, :empty]))) and bool(
            jnp.all(jnp.isfinite(lse[:, :, empty:]))
        )
        dq, dk, dv = jax.grad(
            lambda q, k, v: self.run(args.replace(q=q, k=k, v=v))[0].astype(jnp.float32).sum(), (0, 1, 2)
        )(args.q, args.k, args.v)
        assert float(jnp.abs(dq[:, :empty].astype(jnp.float32)).max()) == 0.0
        for g in (dq, dk, dv):
            assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))

    @pytest.mark.extended
    def test_lengths_that_empty_a_batch_give_zero_output_and_grads(self):
        """A query length of 0 (batch 0) and a key length of 0 (batch 1): every row empty, output 0,
        LSE -inf, zero finite gradients; a third batch with lengths inside a tile is compared with the
        reference."""
        args = make_case(Case("bfloat16", "top_left", 200, 260, 64, 2, K=1, B=3))
        args = args.replace(
            q_seq_lengths=jnp.asarray([0, 200, 150], jnp.int32),
            kv_seq_lengths=jnp.asarray([260, 0, 70], jnp.int32),
        )
        out, lse = jax.jit(self.run)(args)
        assert float(jnp.abs(out[:2].astype(jnp.float32)).max()) == 0.0
        assert bool(jnp.all(jnp.isneginf(lse[:2])))
        grads = jax.grad(
            lambda q, k, v: self.run(args.replace(q=q, k=k, v=v))[0].astype(jnp.float32).sum(), (0, 1, 2)
        )(args.q, args.k, args.v)
        for g in grads:
            g = g.astype(jnp.float32)
            assert float(jnp.abs(g[:2]).max()) == 0.0 and bool(jnp.all(jnp.isfinite(g)))
        self.check(args)

    @pytest.mark.extended
    def test_deterministic(self):
        args = make_case(Case("bfloat16", "top_left", 256, 256, 64, 2, K=1, B=1, dropout=0.25))
        a, b = (jax.jit(self.run)(args)[0] for _ in range(2))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    @pytest.mark.extended
    def test_vjp_wrt_outputs_and_lse(self):
        """Cotangents on both outputs (the LSE too), in half precision: the kernel's ``out`` and
        ``lse`` feed the backward."""
        args = make_case(Case("float16", "lower_right", 130, 200, 64, 2, K=1, B=1))
        up = lambda a: a.replace(
            q=a.q.astype(jnp.float32), k=a.k.astype(jnp.float32), v=a.v.astype(jnp.float32)
        )  # noqa: E731
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: self.run(args.replace(q=q, k=k, v=v)), args.q, args.k, args.v
        )
        _, vjp_ref = jax.vjp(
            lambda q, k, v: base.reference(up(args).replace(q=q, k=k, v=v)),
            *map(lambda x: x.astype(jnp.float32), (args.q, args.k, args.v)),
        )
        rng = np.random.default_rng(3)
        ct = (
            jnp.asarray(rng.normal(size=out.shape), out.dtype),
            jnp.asarray(rng.normal(size=lse.shape), jnp.float32),
        )
        for g, r, name in zip(vjp(ct), vjp_ref((ct[0].astype(jnp.float32), ct[1])), "qkv"):
            scale = float(jnp.max(jnp.abs(r)))
            err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) / scale
            assert err < 1e-2, f"d{name}: {err}"


# ---- what it refuses --------------------------------------------------------------------------------


def _args(dtype=jnp.bfloat16, T=128, S=128, H=64, Hv=None, **kw):
    q = jnp.zeros((1, T, 2, H), dtype)
    k = jnp.zeros((1, S, 2, H), dtype)
    v = jnp.zeros((1, S, 2, Hv or H), dtype)
    return base.make_args(q, k, v, **kw)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(dtype=jnp.float32), "float16 / bfloat16"),
        (dict(H=80), "head dims of 64, 128 or 256"),
        (dict(Hv=128), "head dims of 64, 128 or 256"),
        (dict(bias=jnp.zeros((1, 1, 128, 128))), "bias` in the inputs' dtype"),
        (dict(H=256, bias=jnp.zeros((1, 1, 128, 128), jnp.bfloat16)), "shared memory"),
        (dict(scale=-1.0), "positive softmax scale"),
    ],
)
def test_unsupported_names_what_is_missing(kw, words):
    dtype = kw.pop("dtype", jnp.bfloat16)
    shape = {n: kw.pop(n) for n in ("T", "S", "H", "Hv") if n in kw}
    args = _args(dtype, **shape, **kw)
    reasons = mosaic_flash.unsupported(args, "cuda", compute_capability=9.0)
    assert any(words in r for r in reasons), reasons


def test_unsupported_platform_and_device():
    args = _args(is_causal=True)
    assert mosaic_flash.unsupported(args, "cuda", compute_capability=9.0) == []
    assert any("sm90" in r for r in mosaic_flash.unsupported(args, "cuda", compute_capability=8.0))
    assert any("sm90" in r for r in mosaic_flash.unsupported(args, "cuda", compute_capability=10.0))
    assert any("CUDA GPU" in r for r in mosaic_flash.unsupported(args, "cpu"))
    # No GPU here and no target named: WGMMA cannot be promised.
    assert any("unknown" in r for r in mosaic_flash.unsupported(args, "cuda"))
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        assert mosaic_flash.unsupported(args, "cuda") == []
    with gpu.cuda_target("NVIDIA A100-SXM4-80GB"):
        assert any("sm90" in r for r in mosaic_flash.unsupported(args, "cuda"))


def test_attention_refuses_with_the_reasons():
    with pytest.raises(ValueError, match="bias"):
        mosaic_flash.attention(_args(bias=jnp.zeros((1, 1, 128, 128))), interpret=True)


def test_config_is_validated():
    with pytest.raises(ValueError, match="block_kv"):
        mosaic_flash.Config(block_kv=96)
    with pytest.raises(ValueError, match="up to 256"):
        mosaic_flash.Config(block_kv=320)
    with pytest.raises(ValueError, match="up to 256"):
        mosaic_flash.BwdConfig(block_kv_dq=320)
    out, lse = jnp.zeros((1, 128, 2, 64), jnp.bfloat16), jnp.zeros((1, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_flash.backward(
            _args(), out, lse, out, config=mosaic_flash.BwdConfig(block_kv_dq=256, stages=6)
        )
    with pytest.raises(ValueError, match="block_q"):
        mosaic_flash.Config(block_q=128)
    with pytest.raises(ValueError, match="stages"):
        mosaic_flash.Config(stages=1)
    with pytest.raises(TypeError, match="block_kv"):
        mosaic_flash.Config(block_kv=128.0)
    with pytest.raises(TypeError, match="config"):
        mosaic_flash.forward(_args(), config={"block_kv": 64})
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_flash.forward(_args(H=256), config=mosaic_flash.Config(block_kv=256, stages=4))
    with pytest.raises(ValueError, match="block_q_dkv"):
        mosaic_flash.BwdConfig(block_q_dkv=32)
    with pytest.raises(ValueError, match="stages"):
        mosaic_flash.BwdConfig(stages=1)
    with pytest.raises(TypeError, match="bwd_config"):
        mosaic_flash.attention(_args(), interpret=True, bwd_config=mosaic_flash.Config())


# ---- export for CUDA ------------------------------------------------------------------------------

TRITON_CHECKS = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


def _export(f, platforms, *args):
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        return export.export(jax.jit(f), platforms=list(platforms), disabled_checks=TRITON_CHECKS)(*args)


@pytest.mark.parametrize(
    "T, S, H, G, causal, dtype, cap, index_mask, dropout",
    [
        (256, 256, 128, 2, True, jnp.bfloat16, None, None, 0.0),
        (200, 333, 64, 1, False, jnp.float16, None, None, 0.0),
        (128, 192, 256, 4, True, jnp.bfloat16, None, None, 0.0),
        (256, 300, 128, 2, True, jnp.float16, 30.0, None, 0.0),
        (200, 333, 64, 2, False, jnp.bfloat16, None, "segments", 0.0),
        (256, 256, 128, 1, True, jnp.float16, 30.0, "segments", 0.1),
        (128, 192, 256, 2, False, jnp.bfloat16, None, "segments", 0.0),
        (200, 333, 64, 2, True, jnp.bfloat16, None, None, 0.1),
        (128, 192, 256, 1, False, jnp.float16, None, None, 0.1),
        (200, 333, 64, 2, True, jnp.bfloat16, None, "lengths", 0.0),
        (256, 300, 128, 1, False, jnp.float16, None, "lengths", 0.1),
        (384, 384, 64, 2, False, jnp.bfloat16, None, "window", 0.0),
        (200, 333, 128, 1, True, jnp.float16, 30.0, "window", 0.1),
        (256, 256, 256, 1, True, jnp.bfloat16, None, "window", 0.0),
        (200, 333, 64, 2, False, jnp.bfloat16, None, "mask", 0.0),
        (256, 300, 128, 1, True, jnp.float16, 30.0, "mask", 0.1),
        (128, 192, 256, 2, True, jnp.bfloat16, None, "mask", 0.0),
        (200, 333, 64, 2, True, jnp.bfloat16, 30.0, "bias", 0.1),
        (256, 256, 128, 1, False, jnp.float16, None, "bias", 0.0),
        (128, 192, 128, 1, False, jnp.bfloat16, None, "bias", 0.0),
    ],
)
def test_forward_and_gradient_lower_for_cuda(T, S, H, G, causal, dtype, cap, index_mask, dropout):
    q = jnp.zeros((2, T, 2 * G, H), dtype)
    k = jnp.zeros((2, S, 2, H), dtype)
    masks = {}
    if index_mask == "lengths":
        masks = dict(
            q_seq_lengths=jnp.asarray([T, T // 2], jnp.int32),
            kv_seq_lengths=jnp.asarray([S - 5, S], jnp.int32),
        )
    elif index_mask == "segments":
        masks = dict(q_segment_ids=jnp.zeros((2, T), jnp.int32), kv_segment_ids=jnp.zeros((2, S), jnp.int32))
    elif index_mask == "window":
        masks = dict(window=(100, 30))
    elif index_mask == "mask":  # per batch and head
        masks = dict(mask=jnp.ones((2, 2 * G, T, S), bool))
    elif index_mask == "bias":  # per head, broadcast over the batch
        masks = dict(bias=jnp.zeros((1, 2 * G, T, S), dtype))
    if dropout:
        masks.update(dropout_rate=dropout, dropout_rng=jax.random.key(0))
    args = base.make_args(
        q, k, k, is_causal=causal, diag_offset=S - T if causal else 0, logits_soft_cap=cap, **masks
    )
    assert mosaic_flash.unsupported(args, "cuda", compute_capability=9.0) == []

    def loss(q, k, v):
        out, lse = mosaic_flash.attention(args.replace(q=q, k=k, v=v))
        return out.astype(jnp.float32).sum() + lse.sum()

    text = _export(jax.value_and_grad(loss, (0, 1, 2)), ["cuda"], q, k, k).mlir_module()
    kernels = text.count("custom_call @mosaic_gpu")
    if H <= 128:  # the forward, dQ and dK / dV kernels
        assert kernels == 3 and "__gpu$xla.gpu.triton" not in text
    else:  # head dim 256: the Triton backward
        assert kernels == 1 and "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("bias_shape", [(2, 4, 256, 320), (1, 1, 1, 320)])
def test_bias_gradient_lowers_for_cuda(bias_shape):
    """The gradient w.r.t. a bias (full, and broadcast over batch, heads and rows): the dQ kernel's dS
    output (``[B, N, Tp, Sp]`` float32), then XLA's sum; without the bias's gradient, no dS."""
    q = jnp.zeros((2, 256, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 320, 2, 64), jnp.bfloat16)
    bias = jnp.zeros(bias_shape, jnp.bfloat16)

    def loss(q, k, bias):
        args = base.make_args(q, k, k, bias=bias, is_causal=True, diag_offset=64)
        return mosaic_flash.attention(args)[0].astype(jnp.float32).sum()

    text = _export(jax.grad(loss, (0, 1, 2)), ["cuda"], q, k, bias).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 3 and "2x4x256x384xf32" in text
    text = _export(jax.grad(loss, (0, 1)), ["cuda"], q, k, bias).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 3 and "2x4x256x384xf32" not in text


@pytest.mark.parametrize(
    "config, bwd_config",
    [
        (mosaic_flash.Config(block_kv=192), None),
        (None, mosaic_flash.BwdConfig(block_kv_dq=192)),
        (None, mosaic_flash.BwdConfig(block_q_dkv=192)),
    ],
    ids=["fwd", "dq", "dkv"],
)
def test_mask_tiles_of_192_keys_lower_for_cuda(config, bwd_config):
    """A boolean mask under 192-wide blocks (a multiple of 64, not of 128): each kernel's int8 mask ring
    takes a 64-byte swizzle there (a 128-byte one cannot tile 192 bytes, and failed to trace)."""
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    k = jnp.zeros((1, 384, 2, 64), jnp.bfloat16)
    mask = jnp.ones((1, 1, 128, 384), bool)

    def loss(q, k):
        args = base.make_args(q, k, k, mask=mask)
        out, lse = mosaic_flash.attention(args, config=config, bwd_config=bwd_config)
        return out.astype(jnp.float32).sum() + lse.sum()

    text = _export(jax.value_and_grad(loss, (0, 1)), ["cuda"], q, k).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 3


def test_vmap_lowers_for_cuda():
    """vmap over the kernels (forward and gradient) lowers: the GPU-call wrapper batches them."""
    q = jnp.zeros((3, 1, 128, 2, 64), jnp.bfloat16)
    attend = lambda q: mosaic_flash.attention(base.make_args(q, q, q, is_causal=True))[0]  # noqa: E731
    fwd = _export(jax.vmap(attend), ["cuda"], q).mlir_module()
    grad = _export(jax.vmap(jax.grad(lambda q: attend(q).astype(jnp.float32).sum())), ["cuda"], q)
    assert fwd.count("custom_call @mosaic_gpu") == 1
    assert grad.mlir_module().count("custom_call @mosaic_gpu") == 3


@needs_interpret
@pytest.mark.parametrize(
    "case, seed, config, bwd_config",
    [
        # 64-key forward steps over a ring of three; 128-wide backward steps over a ring of three
        (
            Case("float16", "top_left", 256, 384, 64, 2, K=1, B=1),
            5,
            mosaic_flash.Config(block_kv=64, stages=3),
            mosaic_flash.BwdConfig(block_kv_dq=128, block_q_dkv=128, stages=3),
        ),
        # a boolean mask under 192-key forward / dQ blocks and 192-query dK / dV blocks (the mask
        # rings' 64-byte swizzle)
        pytest.param(
            Case("bfloat16", "none", 200, 384, 64, 2, K=1, B=1, mask="bool"),
            8,
            mosaic_flash.Config(block_kv=192),
            mosaic_flash.BwdConfig(block_kv_dq=192, block_q_dkv=192),
            marks=pytest.mark.extended,
        ),
    ],
    ids=["rings_of_three", "mask_192_wide"],
)
def test_other_tile_configs_match_the_reference(case, seed, config, bwd_config):
    """Configs other than the defaults: forward and gradients against the float32 reference."""
    run = functools.partial(mosaic_flash.attention, interpret=True, config=config, bwd_config=bwd_config)

    class Check(AttentionTestBase):
        impl = staticmethod(run)

    Check().check(make_case(case, seed=seed))


_OVERLAP = mosaic_flash.Config(overlap=True)


@needs_interpret
@pytest.mark.parametrize(
    "case, config, change",
    [
        # one block: the pipeline's head and tail, no step between (a fixed range)
        (Case("bfloat16", "none", 128, 100, 64, 1, K=1, B=1), _OVERLAP, None),
        # causal over a ring of two reused across five blocks (traced ranges, masked last blocks)
        (Case("float16", "top_left", 384, 640, 128, 1, K=1, B=1), _OVERLAP, None),
        # ragged lengths, 64-key steps over a ring of three, GQA
        (
            Case("bfloat16", "none", 200, 333, 64, 2, K=1, B=2, extra="lengths"),
            mosaic_flash.Config(block_kv=64, stages=3, overlap=True),
            None,
        ),
        # a query length of 0 and a key length of 0: tiles with no block (neither head nor tail runs)
        (Case("bfloat16", "top_left", 200, 260, 64, 2, K=1, B=3), _OVERLAP, "empty_batches"),
        # a local window (a masked block before the band's mask-free ones)
        (Case("bfloat16", "none", 640, 640, 64, 1, K=1, B=1), _OVERLAP, "window"),
        # rows with no key (bottom-right, T > S), soft cap and head dim 256 (64-key steps)
        (
            Case("float16", "lower_right", 200, 130, 256, 1, K=1, B=1, extra="softcap"),
            mosaic_flash.Config(block_kv=64, overlap=True),
            None,
        ),
        # an additive bias with dropout and lengths (64-key steps: shared memory)
        (
            Case(
                "bfloat16",
                "top_left",
                300,
                300,
                64,
                2,
                K=1,
                B=2,
                mask="additive",
                dropout=0.25,
                extra="lengths",
            ),
            mosaic_flash.Config(block_kv=64, overlap=True),
            None,
        ),
    ],
    ids=["one_block", "causal_ring", "lengths", "empty_batches", "window", "softcap_h256", "bias_dropout"],
)
def test_overlapped_forward_matches_the_reference(case, config, change):
    """``Config(overlap=True)`` (the next block's ``Q K^T`` issued with the previous block's ``P V``):
    the forward against the float32 reference, as the GPU interpreter runs its order of steps and its
    barriers (the compiled program, whose softmax runs while ``P V`` is in flight, is in the GPU lane)."""
    args = make_case(case, seed=case.T + case.S)
    if change == "empty_batches":
        args = args.replace(
            q_seq_lengths=jnp.asarray([0, 200, 150], jnp.int32),
            kv_seq_lengths=jnp.asarray([260, 0, 70], jnp.int32),
        )
    elif change == "window":
        args = args.replace(window=(130, 70))
    run = functools.partial(mosaic_flash.attention, interpret=True, config=config)

    class Check(AttentionTestBase):
        impl = staticmethod(run)

    Check().check(args, grads=False)


@pytest.mark.parametrize("extra", ["none", "causal_lengths", "bias_dropout_softcap", "window_h256"])
def test_overlapped_forward_lowers_for_cuda(extra):
    """``Config(overlap=True)`` lowers for CUDA (a fixed block range; causal with lengths; a bias with
    dropout and a soft cap; a window at head dim 256): its accumulator read leaves one WGMMA group in
    flight (``wgmma.wait_group ... 1``, legible in the module from jax 0.11.2), which the default
    kernel never does."""
    if not mosaic_flash.overlap_available():
        pytest.skip("this JAX has no plgpu.wgmma_accumulator_load")
    H = 256 if extra == "window_h256" else 128
    q = jnp.zeros((2, 256, 4, H), jnp.bfloat16)
    k = jnp.zeros((2, 384, 2, H), jnp.bfloat16)
    kw = {
        "none": {},
        "causal_lengths": dict(is_causal=True, q_seq_lengths=jnp.asarray([256, 100], jnp.int32)),
        "bias_dropout_softcap": dict(
            bias=jnp.zeros((1, 4, 256, 384), jnp.bfloat16),
            dropout_rate=0.1,
            dropout_rng=jax.random.key(0),
            logits_soft_cap=30.0,
        ),
        "window_h256": dict(window=(100, 30)),
    }[extra]
    args = base.make_args(q, k, k, **kw)
    block_kv = 128 if extra in ("none", "causal_lengths") else 64

    def forward(overlap):
        config = mosaic_flash.Config(block_kv=block_kv, overlap=overlap)
        return lambda q, k, v: mosaic_flash.forward(args.replace(q=q, k=k, v=v), config=config)

    text = _export(forward(True), ["cuda"], q, k, k).mlir_module()
    default = _export(forward(False), ["cuda"], q, k, k).mlir_module()
    assert text.count("custom_call @mosaic_gpu") == 1 and text != default
    if jax.__version_info__ >= (0, 11, 2):  # the wait's inline PTX is legible in this JAX's module
        assert "wait_group.sync.aligned 1" in text and "wait_group.sync.aligned 1" not in default


def test_overlap_is_in_the_search_space_where_it_applies():
    """The sweep tries ``overlap`` with the 64- and 128-key tiles where it changes the kernel (not with
    segment ids or a boolean mask), unless told not to; ``Config.overlap`` is validated."""
    args = make_case(Case("bfloat16", "none", 256, 256, 128, 1, K=1, B=1))
    space = mosaic_flash.Config.search_space(args)
    if mosaic_flash.overlap_available():
        plain = {c for c in space if not c.overlap}
        overlapped = {dataclasses.replace(c, overlap=False) for c in space if c.overlap}
        assert overlapped == {c for c in plain if c.block_kv <= 128} and len(overlapped) == 4
    else:
        assert not any(c.overlap for c in space)
    masked = make_case(Case("bfloat16", "none", 256, 256, 128, 1, K=1, B=1, extra="segments"))
    assert not any(c.overlap for c in mosaic_flash.Config.search_space(masked))
    assert not any(c.overlap for c in mosaic_flash.Config.search_space(args, overlap=False))
    with pytest.raises(TypeError, match="overlap"):
        mosaic_flash.Config(overlap=1)


def test_block_ranges_are_the_first_and_last_visible_blocks():
    """``_append_ranges``: per tile, the first block with a visible pair and one past the last (0, 0
    where none); for the dK / dV kernel (``group`` > 1) the union over a kv head's query heads."""
    rng = np.random.default_rng(0)
    for shape, group in [((2, 4, 5, 7), 2), ((1, 1, 3, 6), 1), ((2, 6, 4, 5), 3), ((1, 1, 4, 5), 2)]:
        flags = (rng.random(shape) < 0.3).astype(np.int32)
        flags[0, :, 0] = 0  # tiles with no visible block
        got = np.asarray(mosaic_flash._append_ranges(jnp.asarray(flags), group=group))
        np.testing.assert_array_equal(got[..., :-2], flags)
        for b, n, t in np.ndindex(*shape[:3]):
            heads = [n] if shape[1] == 1 else list(range(n // group * group, (n // group + 1) * group))
            seen = np.nonzero(flags[b, heads, t].any(axis=0))[0]
            want = (seen[0], seen[-1] + 1) if seen.size else (0, 0)
            assert tuple(got[b, n, t, -2:]) == want, (shape, group, b, n, t)


def _packed_or_masked(what: str):
    """Five packed sequences per row (sorted segment ids), or a per-head block-diagonal mask (the
    second head of each kv head's pair shifted by 64 keys, under a causal diagonal), GQA."""
    case = Case("bfloat16", "none" if what == "segments" else "top_left", 512, 512, 64, 2, K=1, B=1)
    args = make_case(case, seed=9)
    docs = jnp.arange(512, dtype=jnp.int32) * 5 // 512  # ~102 rows each: tiles span two
    if what == "segments":
        return args.replace(q_segment_ids=docs[None], kv_segment_ids=docs[None])
    m0 = docs[:, None] == docs[None, :]
    m1 = docs[:, None] == ((jnp.arange(512) + 64) % 512 * 5 // 512)[None, :]
    return args.replace(mask=jnp.stack([m0, m1])[None])


@needs_interpret
@pytest.mark.parametrize("what", ["segments", pytest.param("mask", marks=pytest.mark.extended)])
def test_block_ranges_match_the_reference(what):
    """``Config`` / ``BwdConfig(block_ranges=True)``: each tile streams and walks only its range of
    blocks with a visible pair (the forward's and dQ kernel's over key blocks, the dK / dV kernel's
    over query blocks of every head of the group), and most ranges are narrower than the ring; forward
    and gradients against the float32 reference."""
    args = _packed_or_masked(what)
    cfg = mosaic_flash.Config(block_ranges=True)
    bwd = mosaic_flash.BwdConfig(block_ranges=True)
    s = dataclasses.replace(mosaic_flash._shape(args, cfg), block_ranges=True)
    extras = mosaic_flash._kernel_extras(mosaic_flash._extras(args), s, args.num_heads)
    for flags in (
        mosaic_flash._with_flags(extras, s, 64, cfg.block_kv)[-1],
        mosaic_flash._with_flags(extras, s, 64, bwd.block_kv_dq)[-1],
        mosaic_flash._dkv_extras(extras, s, bwd.block_q_dkv)[-1],
    ):
        lo, hi = np.asarray(flags[..., -2]), np.asarray(flags[..., -1])
        blocks = flags.shape[-1] - 2
        assert (hi - lo).mean() <= 0.6 * blocks and ((lo > 0) | (hi < blocks)).mean() > 0.5, (lo, hi)
    run = functools.partial(mosaic_flash.attention, interpret=True, config=cfg, bwd_config=bwd)

    class Check(AttentionTestBase):
        impl = staticmethod(run)

    Check().check(args)


@pytest.mark.parametrize("what", ["segments", "mask"])
def test_block_ranges_lower_for_cuda(what):
    """``block_ranges`` lowers for CUDA in all three kernels, and changes them (the ranges are read
    from the flags operand); without segment ids or a mask it changes nothing."""
    args = _packed_or_masked(what)

    def loss(block_ranges, args):
        cfg = mosaic_flash.Config(block_ranges=block_ranges)
        bwd = mosaic_flash.BwdConfig(block_ranges=block_ranges)

        def f(q, k, v):
            out, lse = mosaic_flash.attention(args.replace(q=q, k=k, v=v), config=cfg, bwd_config=bwd)
            return out.astype(jnp.float32).sum() + lse.sum()

        return jax.value_and_grad(f, (0, 1, 2))

    qkv = (args.q, args.k, args.v)
    assert _export(loss(True, args), ["cuda"], *qkv).mlir_module().count("custom_call @mosaic_gpu") == 3

    def program(block_ranges, args):  # the kernels' jaxprs (jax 0.11's exported modules vary by run)
        with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
            return str(jax.make_jaxpr(loss(block_ranges, args))(*qkv))

    assert program(True, args) != program(False, args)
    plain = args.replace(q_segment_ids=None, kv_segment_ids=None, mask=None)
    assert program(True, plain) == program(False, plain)


def test_block_ranges_are_in_the_search_space_where_they_apply():
    """The sweeps try ``block_ranges`` with every other config where it changes the kernels (segment
    ids or a boolean mask), and only there; the fields are validated."""
    plain = make_case(Case("bfloat16", "none", 256, 256, 128, 1, K=1, B=1))
    masked = make_case(Case("bfloat16", "none", 256, 256, 128, 1, K=1, B=1, extra="segments"))
    for kind in (mosaic_flash.Config, mosaic_flash.BwdConfig):
        assert not any(c.block_ranges for c in kind.search_space(plain))
        space = kind.search_space(masked)
        ranged = {dataclasses.replace(c, block_ranges=False) for c in space if c.block_ranges}
        assert ranged and ranged == {c for c in space if not c.block_ranges}
        with pytest.raises(TypeError, match="block_ranges"):
            kind(block_ranges=1)


def test_public_api_selects_it_by_flag_and_exports_for_cpu_and_cuda():
    """flash_cuda_kernel='mosaic' under a cpu + cuda export: the module carries the Mosaic GPU kernel
    and its CPU branch (the blockwise XLA flash: a portable artifact) runs here."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 128, 2, 64)), jnp.bfloat16)

    def f(q):
        flags = jb.with_backends(flash_cuda_kernel="mosaic", flash_cpu_kernel="xla")
        with flags, jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return jb.dot_product_attention(q, q, q, is_causal=True)

    exp = _export(f, ["cpu", "cuda"], q)
    assert "mosaic_gpu" in exp.mlir_module()
    got = exp.call(q)
    want = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_gradient_exports_for_cpu_and_cuda_and_runs_on_cpu():
    """The backward under a cpu + cuda export: the cotangents are operands of both branches (a
    closure would make a tracer a constant of the CPU branch), and the CPU branch runs here."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 128, 2, 64)), jnp.bfloat16)

    def attend(q):
        flags = jb.with_backends(flash_cuda_kernel="mosaic", flash_cpu_kernel="xla")
        with flags, jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return jb.dot_product_attention(q, q, q, is_causal=True)

    grad = jax.grad(lambda q: attend(q).astype(jnp.float32).sum())
    exp = _export(grad, ["cpu", "cuda"], q)
    assert exp.mlir_module().count("custom_call @mosaic_gpu") == 3
    want = jax.grad(
        lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True).astype(jnp.float32).sum()
    )(q)
    np.testing.assert_allclose(np.asarray(exp.call(q), np.float32), np.asarray(want, np.float32), atol=5e-2)


def test_dropout_under_a_cpu_and_cuda_export_drops_what_math_drops():
    """The CPU branch of a cpu + cuda export gets the kernel's dropout words as its key and offsets:
    it must drop exactly what MATH drops with the same key (forward and gradient)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 128, 2, 64)), jnp.bfloat16)
    key = jax.random.key(5)

    def attend(q, backend, **flags):
        with jb.with_backends(**flags), jb.sdpa_kernel([backend]):
            return jb.dot_product_attention(q, q, q, is_causal=True, dropout_rate=0.5, dropout_rng=key)

    def value_and_grad(backend, **flags):
        loss = lambda q: (attend(q, backend, **flags).astype(jnp.float32) ** 2).sum()  # noqa: E731
        return lambda q: (attend(q, backend, **flags), jax.grad(loss)(q))

    f = value_and_grad(SDPBackend.FLASH_ATTENTION, flash_cuda_kernel="mosaic", flash_cpu_kernel="xla")
    exp = _export(f, ["cpu", "cuda"], q)
    assert "custom_call @mosaic_gpu" in exp.mlir_module()
    got_out, got_grad = exp.call(q)
    want_out, want_grad = value_and_grad(SDPBackend.MATH)(q.astype(jnp.float32))  # float32 math
    for got, want in ((got_out, want_out), (got_grad, want_grad)):
        want = np.asarray(want)  # bfloat16 rounding only; a different keep-mask is off by O(max |want|)
        err = np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()
        assert err < 0.1, err  # the same key: ~2e-3 (output), ~2e-2 (gradient); another key: ~0.9


def test_flash_cuda_kernel_filters_the_cuda_list():
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    kw = dict(is_causal=True, platform="cuda", compute_capability=9.0)
    with jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        e = jb.explain(q, q, q, **kw)  # auto: the Mosaic GPU kernel ahead of Triton's flash on sm90
        assert e.implementation == "mosaic_flash" and "not triton_flash: lower priority" in e.kernel
        e = jb.explain(q, q, q, local_window_size=(8, 0), **kw)  # windows: Triton's until the lane ran them
        assert e.implementation == "triton_flash" and "keeps local windows" in e.kernel
        e = jb.explain(q, q, q, **dict(kw, compute_capability=8.0))  # an A100: the Triton kernel
        assert e.implementation == "triton_flash" and "needs sm90" in e.kernel
        qf = q.astype(jnp.float32)
        e = jb.explain(qf, qf, qf, **kw)  # float32: the Triton kernel
        assert e.implementation == "triton_flash" and "mosaic_flash" in e.kernel
        with jb.with_backends(flash_cuda_kernel="mosaic"):
            e = jb.explain(q, q, q, **kw)
            assert e.implementation == "mosaic_flash"
            assert "flash_cuda_kernel='mosaic'" in e.kernel
            # Segment ids, dropout, lengths, a local window, a boolean mask and a bias run in it too.
            seg = jnp.zeros((1, 256), jnp.int32)
            e = jb.explain(
                q,
                q,
                q,
                segment_ids=seg,
                dropout_rate=0.1,
                dropout_rng=jax.random.key(0),
                key_value_seq_lengths=jnp.asarray([100]),
                local_window_size=(8, 0),
                mask=jnp.ones((1, 1, 256, 256), bool),
                bias=jnp.zeros((1, 2, 256, 256), q.dtype),
                **kw,
            )
            assert e.implementation == "mosaic_flash", e
            # A call it cannot run: FLASH is unavailable, and the reason is the kernel's.
            e = jb.explain(q, q, q, bias=jnp.zeros((1, 1, 256, 256), jnp.float32), **kw)
            assert e.chosen is None and "float32" in e.reasons[SDPBackend.FLASH_ATTENTION]
        with jb.with_backends(flash_cuda_kernel="triton"):
            e = jb.explain(q, q, q, **kw)
            assert e.implementation == "triton_flash" and "flash_cuda_kernel='triton'" in e.kernel
    with pytest.raises(ValueError, match="flash_cuda_kernel"):
        with jb.with_backends(flash_cuda_kernel="cutlass"):
            pass


def test_explain_takes_the_other_device_facts():
    """explain's device facts reach each kernel's check as it takes them (the cuDNN version is not the
    Mosaic kernel's)."""
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    with jb.with_backends(flash_cuda_kernel="mosaic"), jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        e = jb.explain(q, q, q, platform="cuda", compute_capability=9.0, cudnn_version=90100)
    assert e.implementation == "mosaic_flash"


def test_without_the_triton_backend_it_runs_alone(monkeypatch):
    """A JAX without the Pallas Triton backend (deprecated since jax 0.11): FLASH then runs on the Mosaic
    kernel alone, 'auto' or by flag, with its own backward at head dims 64 and 128; at 256 the backward
    is Triton's, so it refuses."""
    from pallas_kernels import triton_backend

    monkeypatch.setattr(triton_backend, "missing", lambda: ["the installed JAX has no Pallas Triton backend"])
    q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    kw = dict(is_causal=True, platform="cuda", compute_capability=9.0)
    with jb.sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert jb.explain(q, q, q, **kw).implementation == "mosaic_flash"
        with jb.with_backends(flash_cuda_kernel="mosaic"):
            assert jb.explain(q, q, q, **kw).implementation == "mosaic_flash"
            q256 = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)
            e = jb.explain(q256, q256, q256, **kw)
    assert e.chosen is None and "backward pass is the Triton" in e.reasons[SDPBackend.FLASH_ATTENTION]
