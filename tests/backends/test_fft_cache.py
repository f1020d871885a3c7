"""jb.fft and jb.cuda.cufft_plan_cache: an LRU of compiled FFT executables per device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends._src import fft as fft_mod


@pytest.fixture
def cache():
    c = jb.cuda.cufft_plan_cache
    c.clear()
    old = c.max_size
    yield c
    c.max_size = old
    c.clear()
    for i in range(len(jax.devices())):
        c[i].clear()
        c[i].max_size = fft_mod.DEFAULT_MAX_SIZE


def test_results_match_numpy(cache):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_allclose(jb.fft.rfft(x), np.fft.rfft(x.astype(np.float64)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        jb.fft.fft(x, n=8, axis=0, norm="ortho"),
        np.fft.fft(x.astype(np.float64), n=8, axis=0, norm="ortho"),
        rtol=1e-4,
        atol=1e-4,
    )
    np.testing.assert_allclose(jb.fft.irfft2(np.fft.rfft2(x)), x, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        jb.fft.fftn(x, norm="forward"), np.fft.fftn(x, norm="forward"), rtol=1e-4, atol=1e-5
    )


def test_hits_misses_and_key(cache):
    x = jnp.ones((4, 16), jnp.float32)
    jb.fft.rfft(x)
    jb.fft.rfft(x)
    jb.fft.rfft(x, axis=1)  # same key as axis=-1 after canonicalisation
    assert cache.size == 1
    per = cache[0]
    assert (per.hits, per.misses) == (2, 1)
    jb.fft.rfft(x, norm="ortho")
    jb.fft.rfft(x.astype(jnp.float16).astype(jnp.float32)[:2])  # other shape
    jb.fft.fft(x)  # other function
    assert cache.size == 4
    key = per.keys()[0]
    assert key[:6] == ("rfft", (4, 16), "float32", None, 1, None) and key[6] == jax.devices()[0]


def test_lru_eviction_and_max_size(cache):
    cache.max_size = 2
    a, b, c = jnp.ones(8), jnp.ones(16), jnp.ones(32)
    jb.fft.fft(a)
    jb.fft.fft(b)
    jb.fft.fft(a)  # a becomes most recent
    jb.fft.fft(c)  # evicts b
    assert cache.size == 2
    shapes = [k[1] for k in cache[0].keys()]
    assert shapes == [(8,), (32,)]
    cache.max_size = 1
    assert cache.size == 1 and cache[0].keys()[0][1] == (32,)
    cache.max_size = 0  # torch: 0 disables the cache
    jb.fft.fft(a)
    assert cache.size == 0
    with pytest.raises(ValueError, match="max_size"):
        cache.max_size = -1
    with pytest.raises(TypeError, match="max_size"):
        cache.max_size = 1.5


def test_clear_and_per_device(cache):
    assert len(jax.devices()) >= 2
    x0 = jax.device_put(jnp.ones(8), jax.devices()[0])
    x1 = jax.device_put(jnp.ones(8), jax.devices()[1])
    jb.fft.fft(x0)
    jb.fft.fft(x1)
    jb.fft.ifft(x1)
    assert cache[0].size == 1 and cache[1].size == 2 and cache.size == 1
    out = jb.fft.fft(x1)
    assert out.devices() == {jax.devices()[1]}
    cache[1].max_size = 1
    assert cache[1].size == 1 and cache[0].max_size == fft_mod.DEFAULT_MAX_SIZE
    cache[1].clear()
    assert cache[1].size == 0 and cache[0].size == 1
    cache.clear()
    assert cache.size == 0
    assert cache[jax.devices()[1]] is cache[1]
    with pytest.raises(IndexError, match="out of range"):
        cache[len(jax.devices())]
    with pytest.raises(TypeError, match="index"):
        cache["cuda:0"]


def test_traced_calls_do_not_touch_the_cache(cache):
    f = jax.jit(lambda x: jb.fft.rfft(x))
    np.testing.assert_allclose(f(jnp.ones(8)), np.fft.rfft(np.ones(8)), atol=1e-5)
    assert cache.size == 0
    g = jax.grad(lambda x: jnp.sum(jnp.abs(jb.fft.rfft(x)) ** 2))(jnp.arange(8.0))
    assert g.shape == (8,) and cache.size == 0


def test_bad_arguments(cache):
    with pytest.raises(ValueError, match="norm"):
        jb.fft.fft(jnp.ones(8), norm="unitary")
    with pytest.raises(ValueError, match="axis"):
        jb.fft.fft(jnp.ones(8), axis=3)


def test_sizes_and_axes_take_numpy_integers_and_refuse_floats_like_jnp(cache):
    """``n`` / ``axis`` / ``s`` / ``axes`` as jnp.fft takes them (NumPy integers, integer arrays);
    a float or a bool is a TypeError naming the argument (``int()`` truncated 2.9 to 2 before)."""
    x = jnp.arange(24.0).reshape(4, 6)
    np.testing.assert_allclose(jb.fft.fft(x, n=np.int64(4)), jnp.fft.fft(x, n=4))
    np.testing.assert_allclose(jb.fft.fft(x, axis=np.int32(0)), jnp.fft.fft(x, axis=0))
    np.testing.assert_allclose(jb.fft.rfftn(x, s=np.array([4, 6])), jnp.fft.rfftn(x, s=(4, 6)), atol=1e-4)
    np.testing.assert_allclose(
        jb.fft.fftn(x, s=[3, 5], axes=[1, 0]), jnp.fft.fftn(x, s=(3, 5), axes=(1, 0)), atol=1e-4
    )
    for kw, name in ((dict(s=(2.9, 6)), "s"), (dict(axes=(0.9,)), "axes"), (dict(s=(True, 6)), "s")):
        with pytest.raises(TypeError, match=f"^{name} must be an int"):
            jb.fft.fftn(x, **kw)
    with pytest.raises(TypeError, match="^n must be an int"):
        jb.fft.fft(x, n=4.0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        jb.fft.fft(x, axis=2)


@pytest.mark.parametrize("fn", ["fft", "rfft", "fftn", "irfftn", "hfft", "ihfft"])
def test_the_input_is_taken_like_jnp_arrays_and_scalars_not_lists(cache, fn):
    """A list or tuple input is a TypeError, as in jnp.fft (it used to be converted silently); NumPy
    arrays, NumPy scalars and objects with ``__jax_array__`` run."""
    x = np.arange(8.0, dtype=np.float32)
    np.testing.assert_allclose(getattr(jb.fft, fn)(x), getattr(jnp.fft, fn)(x), rtol=1e-5, atol=1e-4)

    class Wrapped:
        def __jax_array__(self):
            return jnp.asarray(x)

    np.testing.assert_allclose(getattr(jb.fft, fn)(Wrapped()), getattr(jnp.fft, fn)(x), rtol=1e-5, atol=1e-4)
    for bad in (x.tolist(), tuple(x.tolist())):
        with pytest.raises(TypeError, match=f"^jb.fft.{fn} requires an array or a scalar for a, got"):
            getattr(jb.fft, fn)(bad)
