"""``benchmarks/kernel_resources.py``: the Triton IR of the Pallas Triton kernels captured from a CUDA
lowering on CPU (every environment), and compiled for sm90 where the `triton` package is installed (it
is not a dependency: those tests skip without it)."""

import importlib.util
import sys
from unittest import mock

import jax.numpy as jnp
import pytest

from benchmarks import kernel_resources as kr
from pallas_kernels.attention import base as attention_base, triton_flash, triton_tuning
from pallas_kernels.int4_matmul import base, triton

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs `pip install triton`"
)


def _packed(K=128, N=64, g=64):
    q, s = base.quantize_4bit(jnp.ones((N, K)), g)
    return base.PackedInt4Weight(q, s, None, g, K, N)


def test_capture_keeps_each_kernel_with_its_launch():
    p = _packed()
    cfg = triton.Config(32, 32, 64, num_warps=8, num_stages=2)
    [k] = kr.capture(lambda x: triton.dyn_quant_matmul(x, p, config=cfg), jnp.ones((40, 128)))
    assert (k.name, k.num_warps, k.num_stages, k.grid) == ("jb_int4_w4a8_fused", 8, 2, (2, 2, 1))
    assert "tt.func" in k.ttir and "tt.dot" in k.ttir
    # two kernels in one function: both, in lowering order, each with its own launch
    q = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
    args = attention_base.make_args(q, q, q)
    fwd = triton_tuning.Config(block_q=32, block_k=32, num_warps=4, num_stages=2)
    ks = kr.capture(
        lambda a: (triton_flash.forward(a, config=fwd), triton.weight_only_matmul(a.q[0, :, 0], p)), args
    )
    assert [k.name for k in ks] == ["jb_flash_fwd", "jb_int4_w4a16"]
    assert ks[0].num_warps == 4 and ks[0].grid[0] == 2  # 64 queries in blocks of 32
    # the same function again: lowered again (JAX's lowering cache is not in the way)
    f = lambda x: triton.dyn_quant_matmul(x, p, config=cfg)  # noqa: E731
    assert len(kr.capture(f, jnp.ones((40, 128)))) == len(kr.capture(f, jnp.ones((40, 128)))) == 1


def test_cli_names_the_missing_package(capsys):
    with mock.patch.dict(sys.modules, {"triton": None}), pytest.raises(SystemExit):
        kr.main(["int4", "--rows", "1"])
    assert "pip install triton" in capsys.readouterr().err


def test_config_parsing():
    cls = kr._config_class("int4", "dyn_quant")
    assert kr._parse_config(cls, ["128,64,128,1,8,2", "swap_ab"]) == triton.Config(
        128, 64, 128, 1, 8, 2, swap_ab=True
    )
    assert kr._config_class("attention", "bwd") is triton_tuning.BackwardConfig


@needs_triton
def test_swap_ab_feeds_the_weights_to_the_mma_from_registers():
    """What the option is for, read off the compiled sm90 code: the W4A16 prefill kernel's warpgroup MMAs
    take their A operand from registers with ``swap_ab`` (the dequantized weights) and from shared
    memory without it; at 16 rows ``mma.sync`` becomes a 64 x 16 warpgroup MMA."""
    p = _packed(K=512, N=256, g=128)
    seen = {}
    for M, bm in ((256, 128), (16, 16)):
        for swap in (False, True):
            cfg = triton.Config(
                bm, 128 if bm == 128 else 64, 64, num_warps=8 if bm == 128 else 4, swap_ab=swap
            )
            x = jnp.zeros((M, 512), jnp.bfloat16)
            [k] = kr.capture(lambda x: triton.weight_only_matmul(x, p, config=cfg), x)
            r = kr.compile_report(k)
            assert r["registers"] > 0 and r["spill_stores"] is not None and r["instructions"] > 100
            seen[M, swap] = set(r["mma"])
    assert all(m.startswith("HGMMA.64x128x16") and m.endswith("A:smem") for m in seen[256, False]), seen
    assert all(m.startswith("HGMMA.64x128x16") and m.endswith("A:regs") for m in seen[256, True]), seen
    assert all(m.startswith("HMMA.16816") for m in seen[16, False]), seen
    assert all(m.startswith("HGMMA.64x16x16") and m.endswith("A:regs") for m in seen[16, True]), seen


@needs_triton
def test_cli_prints_a_row_per_config(capsys):
    assert (
        kr.main(
            [
                "int4",
                "--op",
                "dyn_quant",
                "--rows",
                "256",
                "--k",
                "512",
                "--n",
                "256",
                "--config",
                "64,64,128,1,4,2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "| block_m=64 block_n=64 block_k=128" in out
        and "jb_int4_w4a8_fused" in out
        and "IGMMA.64x64x32" in out
    )


@needs_triton
def test_int4_kernels_compile_to_what_their_comments_say():
    """Read off the sm90 SASS: the W4A16 kernel converts no integer to float (the nibbles become floats
    through the mantissa of 2**23, or of 128 / 1024 in bf16 / f16 with ``scale_after_dot``: then
    packed half-precision subtractions, no conversion at all); the W4A8 prefill kernel's float tail has
    no FMA (its guard keeps ``float(sum) * scale`` rounded on its own, torch's numerics: a guard the
    compiler could bound would be folded away and the multiply-add contracted); W4A8's ``byte_planes``
    takes fewer instructions than its int32 planes at decode, and more MMAs (the weights' sums)."""
    p = _packed(K=1024, N=256, g=128)
    x16, x32 = jnp.zeros((4, 1024), jnp.bfloat16), jnp.zeros((4, 1024))
    cases = {
        "w4a16": (triton.weight_only_matmul, x16, triton.Config(16, 64, 128)),
        "w4a16_after": (triton.weight_only_matmul, x16, triton.Config(16, 64, 128, scale_after_dot=True)),
        "w4a8_fused": (
            triton.dyn_quant_matmul,
            jnp.zeros((64, 1024)),
            triton.Config(64, 64, 64, num_warps=4),
        ),
        "w4a8_decode": (triton.dyn_quant_matmul, x32, triton.Config(16, 64, 128)),
        "w4a8_decode_bytes": (triton.dyn_quant_matmul, x32, triton.Config(16, 64, 128, byte_planes=True)),
    }
    ops = {}
    for name, (fn, x, cfg) in cases.items():
        [k] = kr.capture(lambda x: fn(x, p, config=cfg), x)
        ops[name] = kr.compile_report(k)["ops"]
    assert not ops["w4a16"].get("I2F") and not ops["w4a16"].get("I2FP"), ops["w4a16"]
    assert not ops["w4a16_after"].get("F2FP") and ops["w4a16_after"].get("HADD2"), ops["w4a16_after"]
    assert ops["w4a8_fused"].get("FMUL") and not ops["w4a8_fused"].get("FFMA"), ops["w4a8_fused"]
    total = {name: sum(v.values()) for name, v in ops.items()}
    assert total["w4a8_decode_bytes"] < 0.8 * total["w4a8_decode"], total
    assert ops["w4a8_decode_bytes"]["IMMA"] > ops["w4a8_decode"]["IMMA"], ops
