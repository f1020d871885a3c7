"""jb.einsum / jb.einsum_path follow jb.opt_einsum (enabled, strategy) at trace time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends._src.einsum import left_to_right_path

SUBS = "ab,bc,cd,de->ae"
SHAPES = [(2, 30), (30, 40), (40, 5), (5, 60)]


@pytest.fixture
def ops():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _dot_shapes(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [tuple(e.outvars[0].aval.shape) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_strategies_give_different_orders_and_equal_results(ops):
    ref = np.einsum(SUBS, *[o.astype(np.float64) for o in ops])
    paths, results, dots = {}, {}, {}
    for strategy in ("greedy", "optimal"):
        with jb.with_backends(opt_einsum_strategy=strategy):
            paths[strategy] = jb.einsum_path(SUBS, *ops)[0]
            results[strategy] = np.asarray(jb.einsum(SUBS, *ops))
            dots[strategy] = _dot_shapes(lambda *o: jb.einsum(SUBS, *o), *ops)
    assert paths["greedy"] == [(1, 2), (0, 2), (0, 1)]
    assert paths["optimal"] == [(0, 1), (0, 2), (0, 1)]
    # The order is visible in the jaxpr: greedy contracts B C first (30x5), optimal A B (2x40 or 40x2).
    assert sorted(dots["greedy"][0]) == [5, 30]
    assert sorted(dots["optimal"][0]) == [2, 40]
    for strategy, got in results.items():
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-4, err_msg=strategy)


def test_disabled_contracts_left_to_right(ops):
    subs = "ab,bc,cd->ad"
    a, b, c = np.ones((2, 30)), np.ones((30, 40)), np.ones((40, 5))
    with jb.with_backends(opt_einsum_enabled=False):
        assert jb.einsum_path(subs, a, b, c)[0] == [(0, 1), (0, 1)]
        path, info = jb.einsum_path(SUBS, *ops)
        assert path == left_to_right_path(4) == [(0, 1), (0, 2), (0, 1)]
        dots = _dot_shapes(lambda *o: jb.einsum("ab,cd,bc,de->ae", *o), ops[0], ops[2], ops[1], ops[3])
    # ((A C) B) D would be an outer product first: left to right really is positional.
    assert len(dots[0]) == 4 and sorted(dots[0]) == [2, 5, 30, 40]
    with jb.with_backends(opt_einsum_enabled=True, opt_einsum_strategy="optimal"):
        dots_opt = _dot_shapes(lambda *o: jb.einsum("ab,cd,bc,de->ae", *o), ops[0], ops[2], ops[1], ops[3])
    assert all(len(s) == 2 for s in dots_opt)
    assert left_to_right_path(1) == [(0,)] and left_to_right_path(2) == [(0, 1)]
    assert "FLOP" in str(info)


def test_jit_retraces_when_strategy_changes(ops):
    traces = []

    @jax.jit
    def f(*o):
        traces.append(jb.current_flags().opt_einsum_strategy)
        return jb.einsum(SUBS, *o)

    with jb.with_backends(opt_einsum_strategy="greedy"):
        g = f(*ops)
        f(*ops)
    with jb.with_backends(opt_einsum_strategy="optimal"):
        o = f(*ops)
    assert traces == ["greedy", "optimal"]
    np.testing.assert_allclose(g, o, rtol=2e-5, atol=2e-4)


def test_strategy_validation_and_torch_error_when_disabled():
    with pytest.raises(ValueError, match="greedy"):
        jb.with_backends(opt_einsum_strategy="fastest")
    with pytest.raises(ValueError, match="not enabled"):
        jb.with_backends(opt_einsum_enabled=False, opt_einsum_strategy="greedy")
    assert jb.opt_einsum.is_available() and jb.opt_einsum.get_opt_einsum().__name__ == "opt_einsum"


def test_call_forms_and_errors():
    a = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(jb.einsum("ij->ji", a), a.T)
    np.testing.assert_allclose(jb.einsum(a, [0, 1], a.T, [1, 2]), a @ a.T)
    np.testing.assert_allclose(jb.einsum("ij,jk", a, a.T, optimize="greedy"), a @ a.T)
    with pytest.raises(ValueError, match="out"):
        jb.einsum("ij->ji", a, out=a)
    with pytest.raises(ValueError):
        jb.einsum("ij,jk->ik", a, a)


def test_verbose_reports_the_path_choice(ops, caplog):
    caplog.set_level("INFO", logger="jbackends")
    with jb.verbose(1), jb.with_backends(opt_einsum_enabled=False):
        jb.einsum(SUBS, *ops)
    lines = [r.getMessage() for r in caplog.records if "op=einsum" in r.getMessage()]
    assert lines == [
        "jbackends dispatch op=einsum chosen=left_to_right shapes=2x30,30x40,40x5,5x60 "
        "dtypes=float32,float32,float32,float32 rejected=opt_einsum: jb.opt_einsum.enabled is False"
    ]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_einsum_path_with_optimize_false_is_the_path_einsum_runs(n):
    """``optimize=False`` reaches jnp.einsum, which contracts pairwise in list order; opt_einsum
    itself would read it as one contraction of every operand, which jb.einsum never runs."""
    subs = ",".join(["ab", "bc", "cd", "de", "ef"][:n]) + "->a" + "bcdef"[n - 1]
    ops = [np.ones((3, 3), np.float32)] * n
    path = jb.einsum_path(subs, *ops, optimize=False)[0]
    assert path == [tuple(p) for p in jnp.einsum_path(subs, *ops, optimize=False)[0]]
    assert all(len(p) == 2 for p in path)
    jaxpr = jax.make_jaxpr(lambda *o: jb.einsum(subs, *o, optimize=False))(*ops)
    assert sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) == len(path)
