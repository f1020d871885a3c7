"""Constraint reasons, config validation, heuristics and autotune of the Pallas attention kernels.

Reasons are given at choice time by ``unsupported(args, platform)``, which covers the backward
pass too: a call these accept never fails at grad time.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention import (
    autotune,
    base,
    triton_common as common,
    triton_decode,
    triton_flash,
    triton_flash_vjp,
    triton_mem_efficient,
)

MODULES = {"flash": triton_flash, "mem_efficient": triton_mem_efficient, "decode": triton_decode}


def _args(T=8, S=8, H=16, dtype=jnp.bfloat16, **kw):
    q = jax.ShapeDtypeStruct((1, T, 2, H), dtype)  # abstract: float64 without enabling x64
    k = jax.ShapeDtypeStruct((1, S, 1, H), dtype)
    return base.make_args(q, k, k, **kw)


@pytest.mark.parametrize("name", list(MODULES))
def test_supported_call_has_no_reasons(name):
    args = _args(
        is_causal=True,
        window=(2, 0),
        logits_soft_cap=3.0,
        dropout_rate=0.1,
        dropout_rng=jax.random.key(0),
        q_seq_lengths=jnp.array([3], jnp.int32),
    )
    assert MODULES[name].unsupported(args, "cuda") == []
    assert MODULES[name].unsupported(args, "gpu") == []


@pytest.mark.parametrize("name", list(MODULES))
def test_reasons_name_each_constraint(name):
    mod = MODULES[name]
    assert any("CUDA GPU" in r and "cpu" in r for r in mod.unsupported(_args(), "cpu"))
    assert any("float64" in r for r in mod.unsupported(_args(dtype=jnp.float64), "cuda"))
    assert any("head_dim=320 > 256" in r for r in mod.unsupported(_args(H=320), "cuda"))
    sds = jax.ShapeDtypeStruct
    wide_v = base.make_args(
        sds((1, 8, 2, 16), jnp.bfloat16), sds((1, 8, 1, 16), jnp.bfloat16), sds((1, 8, 1, 300), jnp.bfloat16)
    )
    assert any("value head_dim=300" in r for r in mod.unsupported(wide_v, "cuda"))


def test_bias_and_mask_reasons_per_kernel():
    with_bias = _args(bias=jnp.zeros((1, 1, 8, 8)))
    with_mask = _args(mask=jnp.ones((1, 1, 8, 8), bool))
    assert any("bias" in r for r in triton_flash.unsupported(with_bias, "cuda"))
    assert any("mask" in r for r in triton_flash.unsupported(with_mask, "cuda"))
    assert any("bias" in r for r in triton_decode.unsupported(with_bias, "cuda"))
    assert any("mask" in r for r in triton_decode.unsupported(with_mask, "cuda"))
    assert triton_mem_efficient.unsupported(with_bias, "cuda") == []
    assert triton_mem_efficient.unsupported(with_mask, "cuda") == []
    assert any("T=17 > 16" in r for r in triton_decode.unsupported(_args(T=17), "cuda"))


@pytest.mark.parametrize("name", list(MODULES))
def test_attention_raises_at_call_time_not_grad_time(name):
    args = _args(H=320, T=4)
    with pytest.raises(ValueError, match="head_dim=320"):
        MODULES[name].attention(args, interpret=True)  # the forward refuses: nothing to differentiate


def test_config_validation_messages():
    concrete = base.make_args(*(jnp.zeros((1, 20, 1, 16), jnp.bfloat16),) * 3)
    with pytest.raises(ValueError, match="block_q must be a power of two >= 16"):
        triton_flash.Config(block_q=24)
    with pytest.raises(ValueError, match="block_k"):
        triton_flash.Config(block_k=8)
    with pytest.raises(ValueError, match="num_warps"):
        triton_flash.Config(num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        triton_flash_vjp.Config(num_stages=0)
    with pytest.raises(ValueError, match="block_q"):
        triton_flash_vjp.Config(block_q=100)
    with pytest.raises(ValueError, match="num_splits"):
        triton_decode.Config(num_splits=-1)
    with pytest.raises(TypeError, match="config"):
        triton_flash.attention(concrete, config=triton_decode.Config(), interpret=True)
    with pytest.raises(TypeError, match="bwd_config"):
        triton_flash.attention(
            concrete, config=triton_flash.Config(16, 16), bwd_config=triton_flash.Config(), interpret=True
        )
    with pytest.raises(AttributeError):
        triton_flash.Config().block_q = 32  # frozen


@pytest.mark.parametrize("cc", [75, 80, 90])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_heuristics_are_valid_and_fit_shared_memory(cc, head_dim, dtype):
    cfg = triton_flash.heuristics(head_dim, dtype, cc)
    bwd = triton_flash_vjp.heuristics(head_dim, dtype, cc)
    dec = triton_decode.heuristics(head_dim, dtype, cc, batch_kv_heads=4, kv_len=8192)
    hp = max(16, 1 << (head_dim - 1).bit_length())
    item = jnp.dtype(dtype).itemsize
    smem = {75: 64, 80: 164, 90: 228}[cc] * 1024
    # Forward: Q tile + (K, V) tiles per pipeline stage.
    assert (cfg.block_q + 2 * cfg.block_k * cfg.num_stages) * hp * item <= smem
    # Backward: K, V, and per stage a Q / dO tile.
    assert (2 * bwd.block_k + 2 * bwd.block_q * bwd.num_stages) * hp * item <= smem
    assert dec.num_splits >= 1 and dec.block_k >= 16


def test_autotune_interpret_picks_a_candidate_and_caches():
    autotune.clear_cache()
    x = jax.random.normal(jax.random.key(0), (1, 20, 1, 16))
    args = base.make_args(x, x, x, is_causal=True)
    cands = [
        triton_flash.Config(16, 16),
        triton_flash.Config(32, 16),
        triton_flash.Config(block_q=16, block_k=128),
    ]
    best = autotune.autotune(args, "flash", candidates=cands, interpret=True, repeats=1)
    assert best in cands
    key = autotune.shape_class(args, "flash", interpret=True)
    assert autotune.cache()[key] == best
    # Cached: no candidate is run again (an empty candidate list would otherwise fail).
    assert autotune.autotune(args, "flash", candidates=[], interpret=True) == best
    with pytest.raises(ValueError, match="kernel"):
        autotune.autotune(args, "nope", interpret=True)
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="GPU"):
            autotune.autotune(args, "flash")
    assert all(isinstance(c, triton_flash_vjp.Config) for c in autotune.candidates("flash_bwd", 128))
    assert all(isinstance(c, triton_decode.Config) for c in autotune.candidates("decode", 64))
    autotune.clear_cache()


def test_statics_is_one_hashable_record_every_path_extends():
    sds = jax.ShapeDtypeStruct
    args = base.make_args(
        sds((2, 8, 4, 16), jnp.bfloat16),
        sds((2, 12, 2, 16), jnp.bfloat16),
        sds((2, 12, 2, 24), jnp.bfloat16),
        bias=jnp.zeros((1, 4, 8, 1)),
        is_causal=True,
        window=(3, 1),
        logits_soft_cap=5.0,
        q_seq_lengths=jnp.array([3, 8], jnp.int32),
    )
    st = args.statics()
    assert (st.B, st.T, st.S, st.N, st.K, st.H, st.Hv, st.G) == (2, 8, 12, 4, 2, 16, 24, 2)
    assert (st.causal, st.window, st.softcap, st.dtype) == (True, (3, 1), 5.0, "bfloat16")
    assert (st.bias_shape, st.bias_dtype, st.mask_shape) == ((1, 4, 8, 1), "float32", None)
    assert (st.has_q_len, st.has_kv_len, st.has_segments) == (True, False, False)
    assert hash(st) == hash(args.statics()) and st == args.statics()
    assert st != args.replace(causal=False).statics()
    spec = common.Spec.of(args, allow_tf32=True)
    assert isinstance(spec, base.Statics) and spec.fields() == st.fields()
    assert not spec.allow_tf32  # TF32 applies to float32 inputs only


def test_every_triton_config_follows_the_tuning_protocol():
    args = _args(H=64, S=4096)
    dev = {"compute_capability": 9.0}
    assert triton_flash.Config.heuristics(args, dev) == triton_flash.heuristics(64, jnp.bfloat16, 90)
    assert triton_flash_vjp.Config.heuristics(args, dev) == triton_flash_vjp.heuristics(64, jnp.bfloat16, 90)
    assert triton_decode.Config.heuristics(args, {"compute_capability": 75, "num_sms": 40}) == (
        triton_decode.heuristics(64, jnp.bfloat16, 75, batch_kv_heads=1, kv_len=4096, num_sms=40)
    )
    for name, cls in autotune.CONFIGS.items():
        space = cls.search_space(args)
        assert space and all(isinstance(c, cls) for c in space), name
        assert len(set(space)) == len(space), name
    assert triton_mem_efficient.Config is triton_flash.Config
