"""jb.mha fast path: jb.nn.attention_fn / MultiHeadAttention take the fused SDPA dispatch or the plain path."""

import importlib
import logging
import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jbackends as jb


@pytest.fixture
def sdpa(monkeypatch):
    """The real jbackends.attention when it exists; until then a stand-in with the same BTNH contract."""
    try:
        mod = importlib.import_module("jbackends.attention")
        if hasattr(mod, "dot_product_attention"):
            return "real"
    except ImportError:
        pass
    fake = types.ModuleType("jbackends.attention")
    fake.dot_product_attention = lambda q, k, v, bias=None, mask=None, *, is_causal=False, **kw: (
        jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal)
    )
    monkeypatch.setitem(sys.modules, "jbackends.attention", fake)
    return "stand-in"


def _qkv(shape_q=(2, 5, 4, 8), shape_kv=(2, 7, 2, 8), seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal(shape_q), jnp.float32)
    k = jnp.asarray(rng.standard_normal(shape_kv), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape_kv), jnp.float32)
    return q, k, v


def _reference(q, k, v, mask=None, causal=False):
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q64.shape[-2] // k64.shape[-2]
    k64, v64 = np.repeat(k64, rep, axis=-2), np.repeat(v64, rep, axis=-2)
    s = np.einsum("...qhd,...khd->...hqk", q64, k64) / np.sqrt(q64.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("...hqk,...khd->...qhd", p, v64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_fast_and_plain_paths_agree(sdpa, caplog, causal, with_mask):
    caplog.set_level(logging.INFO, logger="jbackends")
    q, k, v = _qkv(shape_kv=(2, 5, 2, 8))
    mask = jnp.asarray(np.random.default_rng(1).random((2, 1, 5, 5)) > 0.3) if with_mask else None
    if with_mask:
        mask = mask.at[..., 0].set(True)  # no fully masked rows
    with jb.verbose(1):
        fast = jb.nn.attention_fn(q, k, v, mask=mask, is_causal=causal)
        with jb.with_backends(mha_fastpath=False):
            plain = jb.nn.attention_fn(q, k, v, mask=mask, is_causal=causal)
    msgs = [r.getMessage() for r in caplog.records]
    chosen = [m.split()[3] for m in msgs if "op=mha" in m]
    assert chosen == ["chosen=fastpath:sdpa", "chosen=plain"]
    if sdpa == "real":  # the fast path went through the SDPA dispatch, the plain path did not
        sdpa_lines = [i for i, m in enumerate(msgs) if "dispatch op=sdpa" in m]
        mha_lines = [i for i, m in enumerate(msgs) if "op=mha" in m]
        assert sdpa_lines and all(mha_lines[0] < i < mha_lines[1] for i in sdpa_lines)
    chex.assert_trees_all_close(fast, plain, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(plain), _reference(q, k, v, mask, causal), atol=1e-5, rtol=1e-5)


def test_plain_path_is_explicit_weights_in_jaxpr(sdpa):
    q, k, v = _qkv()
    with jb.with_backends(mha_fastpath=False):
        jaxpr = str(jax.make_jaxpr(jb.nn.attention_fn)(q, k, v))
    assert "dot_general" in jaxpr and "exp" in jaxpr  # softmax(QK^T) V spelled out
    assert str(jax.make_jaxpr(jb.nn.attention_fn)(q, k, v)) != jaxpr  # the fast path traces differently
    jb.mha.set_fastpath_enabled(False)
    try:
        assert jb.mha.get_fastpath_enabled() is False
        again = str(jax.make_jaxpr(jb.nn.attention_fn)(q, k, v))
    finally:
        jb.mha.set_fastpath_enabled(True)
    assert again == jaxpr


def test_dropout_module_and_precision_take_the_plain_path(sdpa, caplog):
    caplog.set_level(logging.INFO, logger="jbackends")
    q, k, v = _qkv()
    with jb.verbose(1):
        jb.nn.attention_fn(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0), deterministic=False)
        jb.nn.attention_fn(q, k, v, precision=jax.lax.Precision.HIGHEST)
        jb.nn.attention_fn(q, k, v, dropout_rate=0.5, deterministic=True)  # inactive dropout: fast
    msgs = [r.getMessage() for r in caplog.records if "op=mha" in r.getMessage()]
    assert "chosen=plain" in msgs[0] and "dropout is active" in msgs[0]
    assert "chosen=plain" in msgs[1] and "precision" in msgs[1]
    assert "chosen=fastpath:sdpa" in msgs[2]


def test_multi_head_attention_matches_flax(sdpa):
    kw = dict(num_heads=4, in_features=16, qkv_features=16, num_kv_heads=2, decode=False)
    ours = jb.nn.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    assert ours.attention_fn is jb.nn.attention_fn
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 6, 16)), jnp.float32)
    want = theirs(x)
    chex.assert_trees_all_close(ours(x), want, atol=1e-5, rtol=1e-5)
    with jb.with_backends(mha_fastpath=False):
        chex.assert_trees_all_close(ours(x), want, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(nnx.jit(lambda m, x: m(x))(ours, x), want, atol=1e-5, rtol=1e-5)
    pluggable = nnx.MultiHeadAttention(**kw, attention_fn=jb.nn.attention_fn, rngs=nnx.Rngs(0))
    chex.assert_trees_all_close(pluggable(x), want, atol=1e-5, rtol=1e-5)


def test_extra_batch_dims_and_bad_shapes(sdpa):
    q, k, v = _qkv((2, 3, 5, 2, 4), (2, 3, 5, 2, 4))
    out = jb.nn.attention_fn(q, k, v)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v), atol=1e-5)
    with pytest.raises(ValueError, match="same rank"):
        jb.nn.attention_fn(q, k[0], v[0])
