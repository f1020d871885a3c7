"""preferred_linalg_library -> jb.linalg eig implementation; cudnn.allow_tf32 -> jb.conv precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jbackends as jb
from jbackends._src import linalg as linalg_mod


@pytest.mark.parametrize(
    "pref, want",
    [
        ("default", None),
        ("cusolver", lax.linalg.EigImplementation.CUSOLVER),
        ("magma", lax.linalg.EigImplementation.MAGMA),
    ],
)
def test_eig_implementation_on_gpu_is_in_the_jaxpr(pref, want):
    x = np.eye(3, dtype=np.float32)
    with jb.with_backends(preferred_linalg_library=pref):
        jaxpr = jax.make_jaxpr(lambda a: linalg_mod._eig(a, vectors=True, platform="gpu"))(x)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "eig"]
    assert eqn.params["implementation"] == want
    assert linalg_mod.eig_implementation(pref, "cpu")[0] is None


def test_eig_on_cpu_matches_numpy_and_reports(caplog):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 5)).astype(np.float32)
    caplog.set_level("INFO", logger="jbackends")
    with jb.with_backends(preferred_linalg_library="magma"), jb.verbose(1):
        w, v = jb.linalg.eig(a)
        wv = jb.linalg.eigvals(a)
    np.testing.assert_allclose(
        np.sort_complex(np.asarray(w)),
        np.sort_complex(np.linalg.eigvals(a.astype(np.float64))),
        rtol=1e-4,
        atol=1e-4,
    )
    np.testing.assert_allclose(np.asarray(a @ v), np.asarray(v * w[None, :]), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.sort_complex(np.asarray(wv)), np.sort_complex(np.asarray(w)), atol=1e-4)
    lines = [r.getMessage() for r in caplog.records if "op=linalg.eig" in r.getMessage()]
    assert lines and "rejected=magma: cpu has only the LAPACK eigensolver" in lines[0]
    with pytest.raises(ValueError, match="square"):
        jb.linalg.eig(np.ones((2, 3), np.float32))


@pytest.mark.parametrize("pref", ["cusolver", "magma"])
def test_eig_picks_the_solver_per_lowering_platform(pref):
    """The GPU solver goes in a per-platform branch: a computation lowered for the CPU (an array on
    the host of a GPU machine, `jax.jit(..., backend="cpu")`) gets LAPACK, whatever the default backend."""
    x = np.eye(3, dtype=np.float32)
    with jb.with_backends(preferred_linalg_library=pref):
        jaxpr = jax.make_jaxpr(jb.linalg.eigvals)(x)
        (index,) = [e for e in jaxpr.eqns if e.primitive.name == "platform_index"]
        (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        got = jb.linalg.eigvals(x)  # lowered for the CPU here: LAPACK
    assert ("cuda", "rocm") in index.params["platforms"]
    impls = {
        e.params["implementation"]
        for br in cond.params["branches"]
        for e in br.jaxpr.eqns
        if e.primitive.name == "eig"
    }
    assert impls == {None, getattr(lax.linalg.EigImplementation, pref.upper())}
    np.testing.assert_allclose(np.asarray(got), np.ones(3))


def test_eig_takes_integer_and_bool_matrices_and_names_its_results_like_jnp():
    for m in (np.array([[2, 1], [0, 3]]), np.array([[True, False], [True, True]])):
        want, got = jnp.linalg.eig(m), jb.linalg.eig(m)
        assert got.eigenvalues.dtype == want.eigenvalues.dtype
        np.testing.assert_allclose(
            np.sort_complex(np.asarray(got.eigenvalues)), np.sort_complex(np.asarray(want.eigenvalues))
        )
        np.testing.assert_allclose(
            np.sort_complex(np.asarray(jb.linalg.eigvals(m))), np.sort_complex(np.asarray(want.eigenvalues))
        )
        w, v = got  # still a (w, v) pair
        np.testing.assert_allclose(np.asarray(m @ v), np.asarray(v * w[None, :]), atol=1e-5)
    for fn in ("eig", "eigvals"):  # a nested list is refused, as jnp.linalg refuses it
        with pytest.raises(TypeError, match=f"^jb.linalg.{fn} requires an array or a scalar for a, got list"):
            getattr(jb.linalg, fn)([[2.0, 1.0], [0.0, 3.0]])


def _conv_precisions(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return [
        line.split("precision_config = ")[1].split("]")[0]
        for line in text.splitlines()
        if "stablehlo.convolution" in line
    ]


def test_conv_precision_follows_cudnn_allow_tf32():
    x, w = jnp.ones((1, 2, 6, 6)), jnp.ones((3, 2, 3, 3))
    conv = lambda x, w: jb.conv.conv_general_dilated(x, w, (1, 1), "SAME")
    assert jb.cudnn.allow_tf32 is True
    assert "DEFAULT" in _conv_precisions(conv, x, w)[0]
    with jb.cudnn.flags(allow_tf32=False):
        assert "HIGHEST" in _conv_precisions(conv, x, w)[0]
        explicit = lambda x, w: jb.conv.conv_general_dilated(
            x, w, (1, 1), "SAME", precision=lax.Precision.DEFAULT
        )
        assert "DEFAULT" in _conv_precisions(explicit, x, w)[0]
    ref = lax.conv_general_dilated(x, w, (1, 1), "SAME", precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(conv(x, w), ref)


def test_flax_conv_in_scope():
    layer = nnx.Conv(2, 3, (3, 3), conv_general_dilated=jb.conv.conv_general_dilated, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 6, 6, 2))
    with jb.cudnn.flags(allow_tf32=False):
        text = jax.jit(lambda x: layer(x)).lower(x).as_text()
    assert "precision HIGHEST" in text
    text = jax.jit(lambda x: layer(x)).lower(x).as_text()
    assert "precision HIGHEST" not in text and "precision DEFAULT" in text


def test_cudnn_flags_become_compiler_options():
    f = jb.jit(lambda x: x * 2)
    f(jnp.float32(1))
    with jb.cudnn.flags(deterministic=True, benchmark=True, benchmark_limit=3, enabled=False):
        assert jb.cudnn.deterministic and jb.cudnn.benchmark and not jb.cudnn.enabled
        opts = jb.compiler_options()
        f(jnp.float32(1))
    assert opts == {
        "xla_gpu_deterministic_ops": True,
        "xla_gpu_exhaustive_tiling_search": True,
        "xla_gpu_autotune_max_solutions": 3,
        "xla_gpu_cudnn_gemm_fusion_level": 0,
    }
    assert len(f.executables) == 2
    # At the defaults no option is passed: XLA's defaults and the user's XLA_FLAGS stand (torch's
    # deterministic=False means "not required"; benchmark_limit applies with benchmark=True only).
    assert jb.compiler_options() == {}
    with jb.cudnn.flags(benchmark_limit=3):
        assert jb.compiler_options() == {}
    with jb.cudnn.flags(benchmark=True):
        assert jb.compiler_options() == {
            "xla_gpu_exhaustive_tiling_search": True,
            "xla_gpu_autotune_max_solutions": 10,
        }
    assert tuple(sorted(opts.items())) in f.executables
    # jb.cudnn.flags: an omitted argument means unchanged (torch's would turn cuDNN off).
    with jb.cudnn.flags(deterministic=True):
        assert jb.cudnn.enabled is True
    # Every option name is accepted by the installed XLA.
    jax.jit(lambda x: x, compiler_options=opts).lower(1.0).compile()
