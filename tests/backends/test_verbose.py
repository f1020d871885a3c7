"""jb.verbose / jb.mkl.verbose / jb.mkldnn.verbose: scoped, nested, one line per event, silent outside."""

import logging
import re

import jax
import jax.numpy as jnp
import pytest

import jbackends as jb
from jbackends._src import verbose as verbose_mod

LINE = re.compile(r"^jbackends (dispatch|trace|retrace|lower|compile|call) (\w+=\S+)( \w+=.*)*$")


def _msgs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "jbackends"]


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="jbackends")
    return caplog


def test_compile_trace_and_retrace_lines_only_inside(log):
    def my_fun(x):
        return x * 3 + 1

    jax.jit(my_fun)(jnp.float32(1))  # outside: nothing reported
    assert _msgs(log) == []
    with jb.verbose(1):
        jax.jit(my_fun)(jnp.ones(3))  # a new shape: trace, lower, compile, and a retrace of my_fun
    msgs = _msgs(log)
    assert all(LINE.match(m) for m in msgs), msgs
    kinds = [m.split()[1] for m in msgs if "my_fun" in m]
    assert kinds[:4] == ["trace", "retrace", "lower", "compile"], msgs
    assert any(re.fullmatch(r"jbackends compile fun=jit\(my_fun\) secs=\d+\.\d+", m) for m in msgs)
    assert any(m == "jbackends retrace fun=my_fun count=2" for m in msgs)
    log.clear()
    jax.jit(my_fun)(jnp.ones(4))
    assert _msgs(log) == []


def test_scopes_nest_and_restore(log):
    assert jb.current_flags().verbose == 0
    with jb.mkl.verbose(jb.mkl.VERBOSE_ON):
        assert jb.current_flags().verbose == 1
        with jb.mkldnn.verbose(jb.mkldnn.VERBOSE_ON_CREATION):
            assert jb.current_flags().verbose == 2
            with jb.verbose(0):
                verbose_mod.report_dispatch("op", "x", {})
                assert _msgs(log) == []
            verbose_mod.report_dispatch("op", "x", {"y": "because"}, ((2, 3),), ("float32",))
        assert jb.current_flags().verbose == 1  # restored (torch's mkl.verbose resets to OFF)
    assert jb.current_flags().verbose == 0
    assert _msgs(log) == ["jbackends dispatch op=op chosen=x shapes=2x3 dtypes=float32 rejected=y: because"]


def test_level_two_adds_call_times(log):
    f = jb.timed(jax.jit(lambda x: x + 1), name="plus_one")
    x = jnp.ones(8)
    with jb.verbose(1):
        f(x)
        jb.fft.rfft(x)
    assert not [m for m in _msgs(log) if m.startswith("jbackends call")]
    with jb.verbose(2):
        f(x)
        jb.fft.rfft(x)
        jb.einsum("i,i->", x, x)
        jb.linalg.eigvals(jnp.eye(2))
        jb.nn.attention_fn(jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)))
        jax.jit(lambda x: jb.einsum("i,i->", x, x))(x)  # traced: no per-call line from inside a trace
    calls = [m for m in _msgs(log) if m.startswith("jbackends call")]
    assert [c.split()[2] for c in calls] == [
        "op=plus_one",
        "op=fft.rfft",
        "op=einsum",
        "op=linalg.eig",
        "op=mha",
    ]
    assert all(re.fullmatch(r"jbackends call op=\S+ secs=\d+\.\d+", c) for c in calls)
    jb.cuda.cufft_plan_cache.clear()


def test_dispatch_lines_from_jbackends_ops(log):
    with jb.verbose(1):
        jb.conv.conv_general_dilated(jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 3, 3)), (1, 1), "VALID")
    assert any(
        m.startswith(
            "jbackends dispatch op=conv chosen=precision=DEFAULT shapes=1x1x4x4,1x1x3x3 "
            "dtypes=float32,float32"
        )
        for m in _msgs(log)
    )


def test_bad_levels():
    with pytest.raises(ValueError, match="0 \\(off\\), 1 or 2"):
        jb.verbose(3)
    with pytest.raises(TypeError, match="int"):
        jb.verbose("on")


def test_listener_registered_once():
    import importlib

    before = jax.monitoring._jbackends_verbose_listener
    importlib.reload(verbose_mod)
    assert jax.monitoring._jbackends_verbose_listener is before


def test_unconfigured_logging_still_shows_the_region_on_stderr_only_inside():
    import os
    import subprocess
    import sys

    script = (
        "import jax, jax.numpy as jnp, jbackends as jb\n"
        "def before(x): return x - 1\n"
        "def inside(x): return x * 5\n"
        "def after(x): return x * 7\n"
        "jax.jit(before)(jnp.float32(1))\n"
        "with jb.verbose(1):\n"
        "    jax.jit(inside)(jnp.float32(3))\n"
        "jax.jit(after)(jnp.float32(2))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [l for l in res.stderr.splitlines() if l.startswith("jbackends ")]
    assert lines and all(LINE.match(l) for l in lines), res.stderr
    assert {l.split()[1] for l in lines} >= {"trace", "lower", "compile"}
    funs = {l.split()[2] for l in lines}
    assert funs == {"fun=inside", "fun=jit(inside)"}, lines
