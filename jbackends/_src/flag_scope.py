"""Changing the flags: process defaults (`set_flags`, freezing) and scopes (`with_backends`, `propagate`).

Both validate against the declarations (`flag_declarations`) and write the state that JAX traces
through (`flag_state`): `set_flags` publishes new process defaults, a `with_backends` scope sets the
ContextVar of scoped overrides and re-syncs this thread's jit key.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from jbackends._src import flag_state as _state
from jbackends._src.flag_declarations import COMPILE_TIME, DECLARATIONS, FLAGS, flags_doc

__all__ = [
    "FlagsFrozenError",
    "FlagsTracingError",
    "disable_global_flags",
    "enable_global_flags",
    "flags_frozen",
    "propagate",
    "reset_flags",
    "set_flags",
    "with_backends",
]


class FlagsFrozenError(RuntimeError):
    """Raised when a process default is changed after `disable_global_flags()`."""


class FlagsTracingError(RuntimeError):
    """A process default was changed while JAX traces a function: use `with_backends` there."""


# Survives `importlib.reload` like the process state in `flag_state`.
_frozen = globals().get("_frozen", False)


# --------------------------------------------------------------------------------------------------
# Validation, process defaults.
# --------------------------------------------------------------------------------------------------


def _validate(updates: Mapping[str, Any], where: str, base: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [k for k in updates if k not in FLAGS]
    if unknown:
        raise TypeError(f"{where}() got unknown flag(s) {unknown}; valid flags are: {sorted(FLAGS)}")
    parsed = {k: FLAGS[k].parse(k, v) for k, v in updates.items()}
    if "allow_tf32" in parsed and "float32_matmul_precision" in parsed:
        if parsed["allow_tf32"] != (parsed["float32_matmul_precision"] != "highest"):
            raise ValueError(
                f"{where}(): allow_tf32={parsed['allow_tf32']!r} contradicts "
                f"float32_matmul_precision={parsed['float32_matmul_precision']!r} (torch keeps them consistent: "
                "allow_tf32=True means precision 'high' or 'medium', False means 'highest')"
            )
    implied: dict[str, Any] = {}
    for k, v in parsed.items():
        if FLAGS[k].implies is not None:
            implied.update(FLAGS[k].implies(v))
    implied.update(parsed)
    after = {**base, **implied}
    for k in parsed:
        if FLAGS[k].requires is not None and (problem := FLAGS[k].requires(parsed[k], after)):
            raise ValueError(f"{where}(): {k}={parsed[k]!r}: {problem}")
    for k, v in implied.items():
        try:
            hash(v)
        except TypeError:
            raise TypeError(f"flag {k!r} value must be hashable, got {type(v).__name__}") from None
    return implied


def set_flags(**flags: Any) -> None:
    """Set process defaults (torch semantics: every thread and later notebook cell sees them).

    Omitted flags are unchanged. The new defaults are published atomically: a trace running in another
    thread keeps the defaults it started with, and its cache entry is never reused under other flags.

    Raises:
      FlagsFrozenError: after `disable_global_flags()`.
      FlagsTracingError: called while JAX traces a function (use `with_backends` there).
      TypeError / ValueError: an unknown flag or a bad value (the message names the flag).

    Example:
      >>> import jbackends as jb
      >>> jb.set_flags(flash=False); jb.current_flags().flash
      False
      >>> jb.reset_flags()
    """
    _refuse_under_trace("set_flags", flags)
    parsed = _validate(flags, "set_flags", _state.DEFAULTS)
    if _frozen:
        raise FlagsFrozenError(
            f"process defaults are frozen (jb.disable_global_flags()); use `with jb.with_backends("
            f"{', '.join(f'{k}={v!r}' for k, v in flags.items())}):` instead"
        )
    with _state.defaults_lock:
        _state.DEFAULTS.update(parsed)
        _state.explicit_defaults.update(parsed)
        _state.publish_defaults()


def reset_flags() -> None:
    """Restore every process default to its declared (torch) default (not allowed under a trace)."""
    _refuse_under_trace("reset_flags", {})
    if _frozen:
        raise FlagsFrozenError("process defaults are frozen (jb.disable_global_flags())")
    with _state.defaults_lock:
        _state.DEFAULTS.clear()
        _state.DEFAULTS.update({f.name: f.default for f in DECLARATIONS})
        _state.explicit_defaults.clear()
        _state.publish_defaults()


def _refuse_under_trace(where: str, flags: Mapping[str, Any]) -> None:
    if _state.tracing():
        scoped = ", ".join(f"{k}={v!r}" for k, v in flags.items()) or "..."
        raise FlagsTracingError(
            f"jb.{where}() called while JAX is tracing a function (inside jax.jit, grad, vmap, scan, ...). "
            "A process default set here would change at trace time only (not when the compiled function "
            "runs, and not at all on a cache hit) and would leak to every other thread. Use a scope "
            f"inside the function instead: `with jb.with_backends({scoped}): ...`, or call "
            f"jb.{where}() before tracing."
        )


def disable_global_flags() -> None:
    """Freeze process defaults (torch's test guard): bare mutation raises; scoped overrides still work."""
    global _frozen
    _frozen = True


def enable_global_flags() -> None:
    """Undo `disable_global_flags()`."""
    global _frozen
    _frozen = False


def flags_frozen() -> bool:
    """Whether `disable_global_flags()` is in force."""
    return _frozen


# --------------------------------------------------------------------------------------------------
# with_backends: the scoped override, a context manager and a decorator.
# --------------------------------------------------------------------------------------------------


# The tokens of the scopes entered in this context (thread, asyncio task), innermost last, each with
# its `with_backends` object: one object may be entered by several threads or tasks at once (a
# module-level scope reused), so its exit resets the token this context's entry got.
_SCOPE_TOKENS: contextvars.ContextVar = globals().get("_SCOPE_TOKENS") or contextvars.ContextVar(
    "jbackends_scope_tokens", default=()
)


class with_backends:
    """Override backend flags for a scope: a context manager and a decorator.

    Flags in force when a function is *traced* decide its kernels; a change of flags makes `jax.jit`
    retrace (never a stale executable). Omitted flags are unchanged. Scopes nest, restore on exceptions,
    and are per thread / per asyncio task (`contextvars`).

    Example:
      >>> import jax, jax.numpy as jnp, jbackends as jb
      >>> @jb.with_backends(flash=True, math=False)
      ... @jax.jit
      ... def f(x):
      ...     return x * 2
      >>> with jb.with_backends(deterministic=True):
      ...     jb.current_flags().deterministic
      True

    Args (all keyword-only, all optional):
    {flags}

    Raises:
      TypeError: an unknown flag name (the message lists the valid ones) or a value of the wrong type.
      ValueError: a value outside the allowed set (the message lists it).
    """

    __slots__ = ("_updates",)

    def __init__(self, **flags: Any):
        self._updates = _validate(flags, "with_backends", _state.effective(_state.OVERRIDES.get()))

    def __enter__(self) -> Any:
        new = dict(_state.OVERRIDES.get())
        new.update(self._updates)
        token = _state.OVERRIDES.set(tuple(sorted(new.items())))
        if _state.tracing() and any(n in self._updates for n in COMPILE_TIME) and not _state.IN_JB_JIT.get():
            warnings.warn(
                f"with_backends({', '.join(n for n in self._updates if n in COMPILE_TIME)}=...) inside a "
                "function traced by plain jax.jit: compile-time flags only take effect through jb.jit "
                "(they become XLA compiler options of the top-level jit)",
                stacklevel=2,
            )
        _SCOPE_TOKENS.set(_SCOPE_TOKENS.get() + ((self, token),))
        _state.set_thread_key()  # the jit key and JAX's matmul precision follow the ContextVar
        return _state.current_flags()

    def __exit__(self, *exc) -> None:
        entries = _SCOPE_TOKENS.get()
        mine = [i for i, (scope, _) in enumerate(entries) if scope is self]
        if not mine:
            raise RuntimeError("with_backends: __exit__ without an __enter__ of this scope in this context")
        i = mine[-1]
        _SCOPE_TOKENS.set(entries[:i] + entries[i + 1 :])
        _state.OVERRIDES.reset(entries[i][1])
        _state.set_thread_key()

    def __call__(self, fun: Callable) -> Callable:
        """Decorate `fun`: every call runs in the scope (see the class docstring).

        Coroutine functions hold the scope for the whole coroutine. Generator and async generator
        functions hold it while their body runs, from the first `next()` to the end (also in the
        `finally` blocks run by `close()`), and not while the consumer runs between two items.
        """
        updates = self._updates
        if inspect.isgeneratorfunction(fun):

            @functools.wraps(fun)
            def generator_wrapper(*args, **kwargs):
                scope = with_backends(**updates)
                with scope:
                    gen = fun(*args, **kwargs)
                send, error = None, None
                while True:
                    try:
                        with scope:
                            item = gen.send(send) if error is None else gen.throw(error)
                    except StopIteration as stop:
                        return stop.value
                    finally:
                        error = None
                    try:
                        send = yield item
                    except GeneratorExit:
                        if _state is None:  # interpreter shutdown: this module's globals are gone
                            gen.close()
                            raise
                        with scope:
                            gen.close()
                        raise
                    except BaseException as e:  # thrown in by the consumer: deliver it in the scope
                        send, error = None, e

            return generator_wrapper

        if inspect.isasyncgenfunction(fun):

            @functools.wraps(fun)
            async def async_generator_wrapper(*args, **kwargs):
                scope = with_backends(**updates)
                with scope:
                    agen = fun(*args, **kwargs)
                send, error = None, None
                while True:
                    try:
                        with scope:
                            item = await (agen.asend(send) if error is None else agen.athrow(error))
                    except StopAsyncIteration:
                        return
                    finally:
                        error = None
                    try:
                        send = yield item
                    except GeneratorExit:
                        with scope:
                            await agen.aclose()
                        raise
                    except BaseException as e:
                        send, error = None, e

            return async_generator_wrapper

        if inspect.iscoroutinefunction(fun):

            @functools.wraps(fun)
            async def async_wrapper(*args, **kwargs):
                with with_backends(**updates):
                    return await fun(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fun)
        def wrapper(*args, **kwargs):
            with with_backends(**updates):
                return fun(*args, **kwargs)

        return wrapper

    def __repr__(self) -> str:
        return f"with_backends({', '.join(f'{k}={v!r}' for k, v in self._updates.items())})"


with_backends.__doc__ = with_backends.__doc__.replace("{flags}", flags_doc())


def propagate(fun: Callable) -> Callable:
    """Carry the caller's scoped flags into another thread (e.g. a `ThreadPoolExecutor` worker).

    Process defaults reach every thread anyway; scoped overrides are per context and do not cross a
    thread boundary unless a function is wrapped with `propagate` *in the scope*.

    Example:
      >>> import concurrent.futures, jbackends as jb
      >>> with jb.with_backends(flash=False):
      ...     work = jb.propagate(lambda: jb.current_flags().flash)
      >>> concurrent.futures.ThreadPoolExecutor(1).submit(work).result()
      False
    """
    captured = dict(_state.OVERRIDES.get())

    @functools.wraps(fun)
    def wrapper(*args, **kwargs):
        token = _state.OVERRIDES.set(tuple(sorted({**dict(_state.OVERRIDES.get()), **captured}.items())))
        _state.set_thread_key()
        try:
            return fun(*args, **kwargs)
        finally:
            _state.OVERRIDES.reset(token)
            _state.set_thread_key()

    return wrapper
