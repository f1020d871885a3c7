"""`jb.jit`: compile-time flags become XLA compiler options chosen at call time.

The flags whose `Flag.compiler_options` is set (see `flag_declarations`) change how XLA compiles, not
what is traced; `jb.jit` keeps one `jax.jit` per distinct option set and marks the calls it runs
(`flag_state.IN_JB_JIT`), so `with_backends` can warn where such a flag would be lost.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax._src import core as _jax_core

from jbackends._src import verbose
from jbackends._src.flag_declarations import COMPILE_TIME, FLAGS
from jbackends._src.flag_publication import PIN_FOR_CALL
from jbackends._src.flag_state import (
    IN_JB_JIT,
    OVERRIDES,
    current_flags,
    flags_for,
    key_for,
    synced_publication,
    tracing,
)

__all__ = ["compiler_options", "jit"]


# The start of JAX's error for compiler options on a jit that is not top-level (jax 0.10 - 0.12).
_JAX_OPTIONS_REFUSAL = "`compiler_options` can only be passed to top-level `jax.jit`"


def _staging() -> bool:
    """Whether a jit called now would be staged into an enclosing jaxpr (not compiled top-level)."""
    if not tracing():
        return False
    from jax._src.interpreters import partial_eval as pe

    trace = _jax_core.trace_ctx.trace
    while trace is not None and not isinstance(trace, _jax_core.EvalTrace):
        if isinstance(trace, pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def compiler_options(flags: Any | None = None) -> dict[str, Any]:
    """The XLA compiler options the compile-time flags map to (what `jb.jit` passes).

    A flag at its default maps to none (XLA's own default, or the user's ``XLA_FLAGS``, stands), and
    ``benchmark_limit`` only applies with ``benchmark=True`` (as torch's).
    """
    flags = flags if flags is not None else current_flags()
    opts: dict[str, Any] = {}
    for name in COMPILE_TIME:
        opts.update(FLAGS[name].compiler_options(getattr(flags, name), flags))
    return opts


def jit(fun: Callable | None = None, /, **jit_kwargs: Any) -> Callable:
    """Like `jax.jit`, with compile-time flags turned into XLA compiler options at call time.

    `deterministic`, `benchmark`, `benchmark_limit`, `cudnn_enabled` and `preferred_blas_library` change
    how XLA compiles (`cudnn_enabled` and `deterministic` also take part in tracing, e.g. the SDPA
    choice). `jb.jit` keeps one `jax.jit` per distinct option set, so two flag settings never share an
    executable. Options given in `compiler_options=` win.

    `.lower`, `.trace` and `.eval_shape` work as on `jax.jit`, for the flags in force where they are
    called; `.clear_cache()` clears every option set's executables.

    XLA takes compiler options for a top-level compilation only. Where a `jb.jit` function is called
    matters:

    * at top level, under an eager `jax.vmap` or `jax.jvp`, and (jax >= 0.12) under an eager
      `jax.grad` / `jax.vjp`, whose pieces JAX compiles as top-level jits: the options apply;
    * inside an outer `jb.jit`: a plain inner jit, and the outer one carries the same options;
    * staged into a plain `jax.jit`, `lax.scan`, `jax.make_jaxpr`, ... (and under an eager `jax.grad`
      on jax <= 0.10, which refuses the options there): a plain inner jit, with a warning naming the
      options that are lost when any are set. JAX's refusal is recognised by its exact message for
      these options, so a `ValueError` raised by the function itself propagates unchanged.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> f = jb.jit(lambda x: x + 1)
      >>> with jb.with_backends(deterministic=True):
      ...     float(f(jnp.float32(1)))
      2.0
    """
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    user_options = dict(jit_kwargs.pop("compiler_options", None) or {})
    jitted: dict[tuple, Callable] = {}
    _options_of: dict[int, dict] = {}

    def _is_options_refusal(e: ValueError, f: Callable) -> bool:
        opts = _options_of.get(id(f))
        return (
            bool(opts) and str(e).startswith(_JAX_OPTIONS_REFUSAL) and f"compiler_options={opts!r}" in str(e)
        )

    lock = threading.Lock()

    def _for_current() -> tuple[Callable, Callable, list]:
        """The `jax.jit` for the options of the flags in force, and the publication chooser of the call.

        Another thread's `set_flags` may publish defaults between this choice and the trace's first
        flag read, which pins the defaults the trace follows. Where the newest defaults (under this
        call's scopes) map to other options than the chosen jit's, or to another jit key than the
        one this thread's scope was synced to, the trace pins the publication the choice came from
        instead (`PIN_FOR_CALL`): it is compiled with the options of the flags it follows, and filed
        under their key. ``fun`` itself is what JAX traces, so its caches stay shared."""
        overrides, pub = OVERRIDES.get(), synced_publication()
        opts = {**compiler_options(flags_for(overrides, pub)), **user_options}
        key = tuple(sorted(opts.items()))
        f = jitted.get(key)
        if f is None:
            with lock:
                f = jitted.setdefault(key, jax.jit(fun, compiler_options=opts, **jit_kwargs))
                _options_of[id(f)] = opts
        scope_key = key_for(overrides, pub)
        active = [True]  # the call is running (a context copied during it must not keep choosing)

        def choose(newest):
            if newest is pub or not active[0]:
                return newest
            if {**compiler_options(flags_for(overrides, newest)), **user_options} != opts:
                return pub
            if scope_key != pub.key and key_for(overrides, newest) != scope_key:
                return pub  # a scope's own (tagged) key, synced to ``pub``: the newest would not match it
            return newest

        return f, choose, active

    def _pinned(run: Callable) -> Any:
        """``run(jit for the options in force)``, any trace it starts pinned as `_for_current` says."""
        f, choose, active = _for_current()
        token = PIN_FOR_CALL.set(choose)
        try:
            return run(f)
        finally:
            active[0] = False
            PIN_FOR_CALL.reset(token)

    name = getattr(fun, "__name__", "jit")

    def _plain() -> Callable:
        f = jitted.get(None)
        if f is None:
            with lock:
                f = jitted.setdefault(None, jax.jit(fun, **jit_kwargs))
        return f

    def _warn_lost(reason: str) -> None:
        changed = [n for n in COMPILE_TIME if getattr(current_flags(), n) != FLAGS[n].default]
        if changed or user_options:
            warnings.warn(
                f"jb.jit({name}) runs {reason}: XLA compiler options only apply to a top-level jit, so "
                f"{', '.join(changed + sorted(user_options))} will not take effect here; make the "
                "outer function a jb.jit",
                stacklevel=3,
            )

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        if tracing() and IN_JB_JIT.get():
            # Inside an outer jb.jit, which carries the same options (JAX accepts compiler options on
            # top-level jits only): a plain inner jit.
            return _plain()(*args, **kwargs)
        if _staging():
            # Staged into another jaxpr (jax.jit, lax.scan, make_jaxpr, ...): JAX would trace the
            # function, then refuse the options. Go straight to a plain jit and say what is lost.
            _warn_lost("inside a function staged by jax.jit (or lax.scan, make_jaxpr, ...)")
            return _plain()(*args, **kwargs)
        token = IN_JB_JIT.set(True)
        try:
            return _pinned(lambda f: _call(f, *args, **kwargs))
        finally:
            IN_JB_JIT.reset(token)

    def _call(f: Callable, *args, **kwargs):
        try:
            if current_flags().verbose >= 2:  # per-call device time, inside jb.verbose(2) only
                return verbose.call(name, f, *args, **kwargs)
            return f(*args, **kwargs)
        except ValueError as e:
            # Under an eager transformation JAX may stage the jit after all (jax <= 0.10 refuses under
            # an eager grad; jax 0.12 compiles each piece as a top-level jit, with the options). Only
            # JAX's own refusal of *these* options falls back; any other ValueError is the caller's.
            if not _is_options_refusal(e, f):
                raise
            _warn_lost("under another trace (an eager grad / vjp on this JAX version)")
            return _plain()(*args, **kwargs)

    def _aot(method: str) -> Callable:
        """`jax.jit`'s ``method`` on the jit of the flags in force, traced as a call would be (an inner
        `jb.jit` is a plain jit under the outer one's options)."""

        def run(*args, **kwargs):
            token = IN_JB_JIT.set(True)
            try:
                return _pinned(lambda f: getattr(f, method)(*args, **kwargs))
            finally:
                IN_JB_JIT.reset(token)

        run.__name__ = method
        return run

    wrapper.lower = _aot("lower")  # type: ignore[attr-defined]
    wrapper.trace = _aot("trace")  # type: ignore[attr-defined]
    wrapper.eval_shape = _aot("eval_shape")  # type: ignore[attr-defined]

    def clear_cache() -> None:
        """Drop every option set's compiled executables (`jax.jit(...).clear_cache` on each)."""
        with lock:
            for f in jitted.values():
                f.clear_cache()

    wrapper.clear_cache = clear_cache  # type: ignore[attr-defined]
    wrapper.executables = jitted  # type: ignore[attr-defined]  (option tuple -> jax.jit), for tests
    return wrapper
