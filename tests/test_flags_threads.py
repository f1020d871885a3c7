"""Process defaults changed by one thread (or asyncio task) while another traces.

Thread A alternates `jb.set_flags(<only MATH>)` / `jb.set_flags(<only FLASH>)`; thread B traces a function
that reads the flags twice (two kernels, one of them behind a nested `jax.jit`) on hundreds of new
shapes. Afterwards, single-threaded, every cache entry B left behind is looked up under each flag
state and compared with what that state must give. Before the fix ~40 of 200 traces were served
under the other flags and some traces mixed the two states; an unscoped thread also raised
`FlagsOutOfSyncError`.

Each test is bounded (small shapes, a few seconds); `JBACKENDS_STRESS_TRACES` raises the trace count.
"""

import asyncio
import concurrent.futures
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from jbackends._src import flag_publication, flag_state
from jbackends._src.flags import trace_flags

MATH = dict(math=True, flash=False, mem_efficient=False, cudnn=False)
FLASH = dict(math=False, flash=True, mem_efficient=False, cudnn=False)
TRACES = int(os.environ.get("JBACKENDS_STRESS_TRACES", "200"))


@pytest.fixture
def defaults():
    yield
    jb.enable_global_flags()
    jb.reset_flags()


def _kernel(x):
    """Reads the flags at trace time: x2 under FLASH, x3 under MATH (exact in float32)."""
    f = trace_flags()
    assert f.flash != f.math, f  # only the two published states exist in these tests
    return x * (2.0 if f.flash else 3.0)


_nested = jax.jit(_kernel)


def _two_kernels(x):
    return _nested(_kernel(x))  # 4x under FLASH, 9x under MATH, 6x if one trace mixed the two


_EXPECTED = {"math": 9.0, "flash": 4.0}


def _constant_of(traced) -> float:
    """The product of the two constants in a traced `_two_kernels` (structure only; no compile)."""
    text = str(traced.jaxpr)
    consts = [
        c
        for c in (2.0, 3.0)
        for _ in range(text.count(f"mul a {c}") + text.count(f"mul b {c}") + text.count(f"mul c {c}"))
    ]
    assert len(consts) == 2, text
    return consts[0] * consts[1]


class _Flipper:
    """Thread A: publishes MATH / FLASH alternately until stopped; counts its publications."""

    def __init__(self):
        self.stop = threading.Event()
        self.count = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            jb.set_flags(**(FLASH if self.count % 2 else MATH))
            self.count += 1
            time.sleep(0.0002)  # a publication every few hundred microseconds

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


def _stale_traces(fn, shapes) -> dict:
    """Single-threaded: look up every shape's cached trace under each state; count wrong ones."""
    stale = {}
    for name, mode in (("math", MATH), ("flash", FLASH)):
        jb.set_flags(**mode)
        stale[name] = sum(_constant_of(fn.trace(s)) != _EXPECTED[name] for s in shapes)
    return stale


def _stale_calls(fn, xs) -> dict:
    """Single-threaded: run every cached executable under each state; compare bit for bit."""
    stale = {}
    for name, mode in (("math", MATH), ("flash", FLASH)):
        jb.set_flags(**mode)
        stale[name] = sum(not np.array_equal(np.asarray(fn(x)), _EXPECTED[name] * np.asarray(x)) for x in xs)
    return stale


def test_kernel_states_are_distinguishable(defaults):
    x = jnp.arange(1.0, 5.0, dtype=jnp.float32)
    jb.set_flags(**MATH)
    math = np.asarray(jax.jit(_two_kernels)(x))
    jb.set_flags(**FLASH)
    flash = np.asarray(jax.jit(_two_kernels)(x))
    np.testing.assert_array_equal(math, 9 * np.asarray(x))
    np.testing.assert_array_equal(flash, 4 * np.asarray(x))


def test_set_flags_in_one_thread_never_splits_or_misfiles_a_trace_in_another(defaults):
    traced = jax.jit(_two_kernels)
    called = jax.jit(lambda x: _two_kernels(x) + 0.0)  # another function: its own cache entries
    shapes = [jax.ShapeDtypeStruct((n + 1,), jnp.float32) for n in range(TRACES)]
    xs = [jnp.arange(1.0, n + 2.0, dtype=jnp.float32) for n in range(12)]  # exact small integers
    errors, other, mixed = [], [], []
    jb.set_flags(**MATH)

    def thread_b():  # never opens a scope
        for i, s in enumerate(shapes):
            try:
                c = _constant_of(traced.trace(s))
                if c not in (4.0, 9.0):
                    mixed.append(c)
                if i < len(xs):
                    y = np.asarray(called(xs[i]))
                    if not any(np.array_equal(y, k * np.asarray(xs[i])) for k in (4.0, 9.0)):
                        mixed.append(y)
            except jb.FlagsOutOfSyncError as e:
                errors.append(e)
            except Exception as e:  # noqa: BLE001 - reported below
                other.append(e)

    with _Flipper() as flipper:
        b = threading.Thread(target=thread_b)
        b.start()
        b.join(120)
    assert not other, other[:3]
    assert flipper.count > 20, "the race did not happen: the flipper hardly ran"
    assert errors == [], f"{len(errors)} spurious FlagsOutOfSyncError in an unscoped thread: {errors[0]}"
    assert mixed == [], f"{len(mixed)} traces mixed MATH and FLASH"
    assert _stale_traces(traced, shapes) == {"math": 0, "flash": 0}
    assert _stale_calls(called, xs) == {"math": 0, "flash": 0}


def test_asyncio_tasks_set_flags_while_others_trace(defaults):
    """Tasks on one loop: one publishes defaults, others trace on the loop and in worker threads."""
    traced = jax.jit(_two_kernels)
    n = max(TRACES // 2, 60)
    shapes = [jax.ShapeDtypeStruct((n + 1, 1), jnp.float32) for n in range(n)]
    errors, mixed = [], []
    jb.set_flags(**MATH)

    def trace(s):
        try:
            c = _constant_of(traced.trace(s))
            if c not in (4.0, 9.0):
                mixed.append(c)
        except jb.FlagsOutOfSyncError as e:
            errors.append(e)

    async def main():
        stop = asyncio.Event()
        published = 0

        async def flipper():
            nonlocal published
            while not stop.is_set():
                jb.set_flags(**(FLASH if published % 2 else MATH))
                published += 1
                await asyncio.sleep(0)

        async def tracer(part, in_thread):
            for s in part:
                if in_thread:
                    await asyncio.to_thread(trace, s)  # runs while the flipper task publishes
                else:
                    trace(s)
                    await asyncio.sleep(0)

        flip = asyncio.ensure_future(flipper())
        await asyncio.gather(
            tracer(shapes[0::3], True), tracer(shapes[1::3], True), tracer(shapes[2::3], False)
        )
        stop.set()
        await flip
        return published

    published = asyncio.run(main())
    assert published > 20
    assert errors == [], f"{len(errors)} spurious FlagsOutOfSyncError in unscoped tasks: {errors[0]}"
    assert mixed == []
    assert _stale_traces(traced, shapes) == {"math": 0, "flash": 0}


# ------------------------------------------------------------------------------------- the mechanism,
# deterministically: a publication at each point of a trace where the race can land


def _publish_from_another_thread(**flags):
    t = threading.Thread(target=jb.set_flags, kwargs=flags)
    t.start()
    t.join()


def test_publication_between_the_key_read_and_the_first_flag_read(defaults):
    """JAX read the MATH key, the trace pins FLASH: the entry must never be served under MATH."""
    jb.set_flags(**MATH)
    first = [True]

    def fn(x):
        if first[0]:  # before the first flag read: JAX has already read this call's key
            first[0] = False
            _publish_from_another_thread(**FLASH)
        return _two_kernels(x)

    f = jax.jit(fn)
    x = jnp.arange(1.0, 4.0, dtype=jnp.float32)
    np.testing.assert_array_equal(f(x), 4 * np.asarray(x))  # traced under FLASH, pinned at the read
    jb.set_flags(**MATH)
    np.testing.assert_array_equal(f(x), 9 * np.asarray(x))  # not the FLASH executable
    jb.set_flags(**FLASH)
    np.testing.assert_array_equal(f(x), 4 * np.asarray(x))


def test_publication_between_two_kernels_of_one_trace(defaults):
    """The second kernel (behind a nested jit already cached under FLASH) keeps the pinned MATH."""
    x = jnp.arange(1.0, 4.0, dtype=jnp.float32)
    jb.set_flags(**FLASH)
    np.testing.assert_array_equal(_nested(x), 2 * np.asarray(x))  # _nested cached under FLASH
    jb.set_flags(**MATH)

    def fn(x):
        y = _kernel(x)  # pins MATH
        _publish_from_another_thread(**FLASH)
        return _nested(y)  # a lookup under FLASH's key would bring 2x: one executable, two states

    f = jax.jit(fn)
    np.testing.assert_array_equal(f(x), 9 * np.asarray(x))
    assert jb.current_flags().flash  # the publication itself took effect
    np.testing.assert_array_equal(f(x), 4 * np.asarray(x))  # retraced under FLASH
    jb.set_flags(**MATH)
    np.testing.assert_array_equal(f(x), 9 * np.asarray(x))


def test_flags_read_twice_in_one_trace_agree(defaults):
    seen = []

    def fn(x):
        seen.append(jb.current_flags().flash)
        _publish_from_another_thread(flash=not seen[-1], math=seen[-1])
        seen.append(trace_flags().flash)
        seen.append(jb.current_flags().flash)
        return x

    jax.jit(fn)(1.0)
    assert seen[0] == seen[1] == seen[2]


def test_the_pin_is_released_when_the_trace_ends(defaults):
    jb.set_flags(**MATH)
    jax.jit(_two_kernels)(jnp.ones(2))  # pins, then JAX drops the trace
    assert getattr(flag_state._thread_state, "record", None) is None
    jb.set_flags(**FLASH)
    # the global key is in force again
    assert flag_state._DEFAULTS_KEY.value == flag_publication.current().gkey


def test_no_retirement_without_overlap(defaults):
    """Flags set again later hit the cache when no publication overlapped a trace."""
    traces = []

    def fn(x):
        traces.append(1)
        return _kernel(x)

    f = jax.jit(fn)
    x = jnp.ones(3)
    for mode in (MATH, FLASH, MATH, FLASH):
        jb.set_flags(**mode)
        f(x)
    assert len(traces) == 2


# ------------------------------------------------------------------------------------- the probe:
# two attention calls per function, MATH against FLASH


def _attention_twice(q):
    a = jb.dot_product_attention(q, q, q, platforms="cpu")
    return jb.dot_product_attention(a, a, a, platforms="cpu")


def _primitives(jaxpr) -> tuple:
    """Primitive names of a jaxpr and its sub-jaxprs, in order: the same for every shape of one state."""
    names = []

    def walk(j):
        j = j if hasattr(j, "eqns") else j.jaxpr  # a Jaxpr, or a ClosedJaxpr (jax < 0.12)
        for eqn in j.eqns:
            names.append(eqn.primitive.name)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub)

    walk(jaxpr)
    return tuple(names)


def test_attention_twice_under_concurrent_set_flags(defaults):
    """The probe: thread A flips MATH / FLASH, thread B traces two attention calls per function."""
    key = jax.random.key(0)
    shape = lambda t: (1, t, 1, 8)  # noqa: E731
    q = jax.random.normal(key, shape(5))
    # The two states give different bits on CPU, and different programs.
    out, sig = {}, {}
    for name, mode in (("math", MATH), ("flash", FLASH)):
        jb.set_flags(**mode)
        out[name] = np.asarray(jax.jit(_attention_twice)(q))
        sig[name] = {
            _primitives(jax.jit(_attention_twice).trace(jax.ShapeDtypeStruct(shape(t), jnp.float32)).jaxpr)
            for t in (3, 4)
        }
    assert not np.array_equal(out["math"], out["flash"])
    assert len(sig["math"]) == len(sig["flash"]) == 1 and sig["math"] != sig["flash"]
    sig = {k: next(iter(v)) for k, v in sig.items()}

    fn = jax.jit(_attention_twice)
    n = max(TRACES // 12, 16)  # a flash trace costs ~0.1 s here
    shapes = [jax.ShapeDtypeStruct(shape(t), jnp.float32) for t in range(5, 5 + n)]  # shapes[0]: q's
    errors, mixed = [], []
    jb.set_flags(**MATH)

    def thread_b():
        for s in shapes:
            try:
                if _primitives(fn.trace(s).jaxpr) not in sig.values():
                    mixed.append(s)
            except jb.FlagsOutOfSyncError as e:
                errors.append(e)

    with _Flipper():
        b = threading.Thread(target=thread_b)
        b.start()
        b.join(120)
    assert errors == [] and mixed == [], (len(errors), len(mixed))
    stale = {}
    for name, mode in (("math", MATH), ("flash", FLASH)):
        jb.set_flags(**mode)
        stale[name] = sum(_primitives(fn.trace(s).jaxpr) != sig[name] for s in shapes)
    assert stale == {"math": 0, "flash": 0}
    # and the executables B left for q's shape: bit-exact against the single-threaded references
    for name, mode in (("math", MATH), ("flash", FLASH)):
        jb.set_flags(**mode)
        np.testing.assert_array_equal(np.asarray(fn(q)), out[name])


def test_scope_equal_to_the_defaults_keeps_its_flags_when_another_thread_changes_them(defaults):
    """A scope sets flash=True while that is the default (so it shares the unscoped cache entries);
    another thread then sets the default flash=False. The scope's code keeps flash=True, without
    an error, and unscoped code gets flash=False: neither is served the other's executable."""
    traces = []

    def fn(x):
        traces.append(1)
        return _kernel(x)

    f = jax.jit(fn)
    x = jnp.arange(1.0, 4.0, dtype=jnp.float32)
    jb.set_flags(**FLASH)
    entered, changed, results = threading.Event(), threading.Event(), {}

    def worker():
        with jb.with_backends(flash=True, math=False):  # equal to the defaults now
            results["before"] = np.asarray(f(x))
            entered.set()
            changed.wait(30)
            results["after"] = np.asarray(f(x))  # the defaults are MATH now; the scope says FLASH
            results["again"] = np.asarray(f(x))
        results["outside"] = np.asarray(f(x))

    t = threading.Thread(target=worker)
    t.start()
    entered.wait(30)
    jb.set_flags(**MATH)
    changed.set()
    t.join(60)
    np.testing.assert_array_equal(results["before"], 2 * np.asarray(x))
    np.testing.assert_array_equal(results["after"], 2 * np.asarray(x))
    np.testing.assert_array_equal(results["again"], 2 * np.asarray(x))
    np.testing.assert_array_equal(results["outside"], 3 * np.asarray(x))
    np.testing.assert_array_equal(f(x), 3 * np.asarray(x))  # unscoped, here: MATH
    jb.set_flags(**FLASH)
    np.testing.assert_array_equal(f(x), 2 * np.asarray(x))


def test_default_matmul_precision_is_pinned_with_the_trace(defaults):
    """Process-default precision is bridged to JAX's global matmul precision; a trace keeps the one of
    the defaults it pinned, so its two matmuls agree and its entry matches its key."""

    def fn(a):
        trace_flags()  # the first read pins the defaults (and JAX's bridged precision)
        return (a @ a) @ a

    def precisions(traced) -> list:
        return [str(e.params["precision"]) for e in traced.jaxpr.eqns if e.primitive.name == "dot_general"]

    expected = {
        "highest": str((jax.lax.Precision.HIGHEST,) * 2),
        "medium": str((jax.lax.Precision.DEFAULT,) * 2),
    }
    traced = jax.jit(fn)
    shapes = [jax.ShapeDtypeStruct((n + 2, n + 2), jnp.float32) for n in range(max(TRACES // 2, 60))]
    mixed, errors = [], []
    stop = threading.Event()

    def flipper():
        i = 0
        while not stop.is_set():
            jb.set_float32_matmul_precision("medium" if i % 2 else "highest")
            i += 1
            time.sleep(0.0002)

    def thread_b():
        for s in shapes:
            try:
                p = precisions(traced.trace(s))
                if len(p) != 2 or p[0] != p[1]:
                    mixed.append(p)
            except jb.FlagsOutOfSyncError as e:
                errors.append(e)

    a = threading.Thread(target=flipper)
    b = threading.Thread(target=thread_b)
    a.start()
    b.start()
    b.join(120)
    stop.set()
    a.join(30)
    assert errors == [] and mixed == [], (len(errors), mixed[:3])
    for name in ("highest", "medium"):
        jb.set_float32_matmul_precision(name)
        wrong = [s.shape for s in shapes if precisions(traced.trace(s)) != [expected[name]] * 2]
        assert wrong == [], (name, len(wrong))


def test_one_scope_object_entered_by_overlapping_threads_and_tasks():
    """A `with_backends` object reused (module-level) may be entered by several threads or asyncio tasks
    at once: each exit restores its own context's flags, and nothing leaks into later work on a pooled
    thread (the object once kept one stack of tokens for all of them: the first thread out reset the
    second one's token)."""
    scope = jb.with_backends(flash=False, deterministic=True)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with scope:
            first_in.set()
            assert second_in.wait(timeout=30)
            seen = jb.current_flags()
        first_out.set()  # leaves while the second thread is still inside
        return (seen.flash, seen.deterministic), jb.current_flags().flash

    def second():
        assert first_in.wait(timeout=30)
        with scope:
            second_in.set()
            assert first_out.wait(timeout=30)
            seen = jb.current_flags()
        return (seen.flash, seen.deterministic), jb.current_flags().flash

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(first), pool.submit(second)]]
        later = [
            f.result(timeout=60) for f in [pool.submit(lambda: jb.current_flags().flash) for _ in range(4)]
        ]
    assert results == [((False, True), True)] * 2
    assert later == [True] * 4

    async def in_task(mine, other):
        with scope:
            mine.set()
            await other.wait()
            seen = jb.current_flags().flash
        return seen, jb.current_flags().flash

    async def main():
        a, b = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(in_task(a, b), in_task(b, a))

    assert asyncio.run(main()) == [(False, True)] * 2
    with scope:  # nested reuse in one context
        with scope:
            pass
        assert not jb.current_flags().flash
    assert jb.current_flags().flash
