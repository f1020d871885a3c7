"""The state that JAX traces through: process defaults, scoped overrides, the jit key, `trace_flags`.

State model:

* Process defaults live in a module-level dict (torch semantics: they reach every thread and every later
  notebook cell, also when set inside `contextvars.copy_context().run(...)`). They are *published*
  (`flag_publication`: one immutable publication at a time, and one pinned per top-level trace).
* Scoped overrides live in a `contextvars.ContextVar` (the source of truth for scopes).
* A `jax.make_user_context` (created once per process; a module reload reuses it) mirrors a hashable,
  canonical tuple of the *trace-affecting* flags, so `jax.jit`, `lax.scan` body caches etc. retrace
  exactly when those flags change. Its global value mirrors the process defaults; its thread-local value
  mirrors the ContextVar of whichever scope last touched this thread. A second, global-only user context
  mirrors the process defaults alone, so a `set_flags` in one thread changes the key of every thread,
  including one whose thread-local value was computed against the old defaults (see
  `flag_publication.JIT_KEY`). This module sets the thread-local value for scopes.
* Scoped precision flags are bridged to JAX's thread-local `default_matmul_precision` in step with the
  jit key (`flag_precision`); process-default precision flags to JAX's global one.
* `trace_flags()` is the one accessor kernels use at trace time. It recomputes the tuple from the
  ContextVar and compares it with the jit key: under a trace, a disagreement (e.g. an asyncio task that
  resumed on a thread whose key another task set) raises `FlagsOutOfSyncError` instead of silently
  poisoning a cache entry; outside a trace it re-syncs the key and continues.

The flags are declared in `flag_declarations`; `flag_publication` holds the process defaults and
their publications; `flag_scope` changes this state (`set_flags`, `with_backends`, `propagate`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

from jbackends._src import flag_publication as _publication
from jbackends._src.flag_declarations import TRACED, BackendFlags
from jbackends._src.flag_precision import bridge_global_precision, sync_precision
from jbackends._src.flag_publication import tracing

__all__ = [
    "DEFAULTS",
    "IN_JB_JIT",
    "OVERRIDES",
    "FlagsOutOfSyncError",
    "current_flags",
    "defaults_lock",
    "effective",
    "explicit_defaults",
    "flags_for",
    "key_for",
    "publish_defaults",
    "published_defaults",
    "set_thread_key",
    "sync",
    "synced_publication",
    "trace_flags",
    "tracing",
]


class FlagsOutOfSyncError(RuntimeError):
    """The jit key of this thread does not match the flags of the running context (see `sync`)."""


# The process defaults, their publication and the pin of one publication per trace (rules 1 and 2)
# are `flag_publication`'s; the names below are bound here too (tests and `flag_scope` read them).
DEFAULTS = _publication.DEFAULTS
defaults_lock = _publication.defaults_lock
explicit_defaults = _publication.explicit_defaults
_JIT_KEY = _publication.JIT_KEY
_DEFAULTS_KEY = _publication.DEFAULTS_KEY
_thread_state = _publication.thread_state
_key_of = _publication.key_of

# Scoped overrides live in a `contextvars.ContextVar`. While a scope overrides a traced flag, this
# thread's value of `_JIT_KEY` is a tagged tuple of the scope's *overrides* of traced flags: with
# `DEFAULTS_KEY` (the defaults' traced flags and epoch) it names the flags in force exactly, whatever
# another thread publishes later (a publication changes `DEFAULTS_KEY`, so the scope retraces with the
# new defaults under its overrides). Otherwise it is unset and the global value (the defaults' traced
# flags) is in force. A scope that sets a flag to its default value therefore has entries of its own
# (one more trace per function): a key shared with unscoped code would follow the defaults when
# another thread changes them, and the scope's next call could hit an entry compiled for them.

_Overrides = tuple  # sorted tuple of (name, value): immutable and hashable
OVERRIDES: contextvars.ContextVar[_Overrides] = globals().get("OVERRIDES") or contextvars.ContextVar(
    "jbackends_overrides", default=()
)
_SCOPED_TAG = "jbackends-scope"  # first item of a scoped jit key: never equal to a defaults key


_snapshot_cache: dict[tuple, Any] = {}


def effective(overrides: _Overrides, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    out = dict(_publication.current().values if values is None else values)
    out.update(overrides)
    return out


def _snapshot(overrides: _Overrides, pub: _publication.Publication) -> Any:
    cache_key = (overrides, pub.seq)
    snap = _snapshot_cache.get(cache_key)
    if snap is None:
        snap = BackendFlags(**effective(overrides, pub.values))
        if len(_snapshot_cache) > 512:
            _snapshot_cache.clear()
        _snapshot_cache[cache_key] = snap
    return snap


def flags_for(overrides: _Overrides, pub: _publication.Publication) -> Any:
    """The `BackendFlags` of the scoped ``overrides`` over the defaults of ``pub``."""
    return _snapshot(overrides, pub)


def synced_publication() -> _publication.Publication:
    """The pinned publication under a trace; else the current one, with this thread's jit key synced to
    it (another thread may publish between a sync and a read: then again, a few times at most)."""
    for _ in range(16):
        trace_flags()  # outside a trace: re-syncs the key when it disagrees
        pub = _publication_in_force()
        if tracing() or _JIT_KEY.value == key_for(OVERRIDES.get(), pub):
            return pub
    return pub


def key_for(overrides: _Overrides, pub: _publication.Publication) -> tuple:
    """The jit key a thread with the scoped ``overrides`` has under the defaults of ``pub``."""
    return _thread_key_for(overrides, pub)


def _publication_in_force() -> _publication.Publication:
    """The pinned publication under a trace, else the current one (recording it as seen)."""
    record = _publication.trace_record()
    if record is not None:
        return record.pub
    pub = _publication.current()
    _thread_state.last_seq = pub.seq
    return pub


def current_flags() -> Any:
    """The flags in force in the current context, as a frozen, hashable `BackendFlags`.

    Under a trace these are the flags the trace pinned (see `trace_flags`).

    Example:
      >>> import jbackends as jb
      >>> with jb.with_backends(flash=False):
      ...     jb.current_flags().flash
      False
    """
    return _snapshot(OVERRIDES.get(), _publication_in_force())


def _tagged(overrides: _Overrides) -> tuple:
    """A scope's own jit key: its overrides of traced flags (with the defaults' key, its flags)."""
    return (_SCOPED_TAG, tuple((n, v) for n, v in overrides if n in _TRACED_SET))


_TRACED_SET = frozenset(TRACED)


def _overrides_traced(overrides: _Overrides) -> bool:
    return any(n in _TRACED_SET for n, _ in overrides)


def _thread_key_for(overrides: _Overrides, pub: _publication.Publication) -> tuple:
    """The value `_JIT_KEY` must have in this thread for the scope ``overrides`` under the defaults
    of ``pub`` (see the State notes)."""
    return _tagged(overrides) if _overrides_traced(overrides) else pub.key


def _expected_key() -> tuple:
    """The jit key this thread must have for the running context (tests check it)."""
    return _thread_key_for(OVERRIDES.get(), _publication_in_force())


def set_thread_key() -> None:
    """Make this thread's jit key and JAX matmul precision mirror the ContextVar.

    The key's thread-local value is the scope's tagged key while the scope overrides a traced flag, and
    unset otherwise (the global value, the defaults' traced flags, is then in force).
    """
    overrides = OVERRIDES.get()
    obj = _JIT_KEY._obj
    if _overrides_traced(overrides):
        obj.swap_local(_tagged(overrides))
    else:
        obj.set_local(_publication.UNSET)
    sync_precision(dict(overrides), _thread_state)


def sync() -> None:
    """Re-enter this thread's jit key from the flags of the running context.

    `with_backends` keeps the two in step by itself. Call `sync()` at the top of an asyncio task body
    (and after an `await` that may have let another task change flags on this thread) before calling
    plain `jax.jit` functions: JAX's key is per thread, while the flags are per task.

    Example:
      >>> import asyncio, jbackends as jb
      >>> async def task():
      ...     jb.sync()
      ...     return jb.current_flags().flash
      >>> asyncio.run(task())
      True
    """
    set_thread_key()


def trace_flags() -> Any:
    """The flags a kernel must use while it is being traced (the one trace-time accessor).

    Under a trace, every read in one top-level trace starts from the same snapshot of the process
    defaults (pinned at the first read; see the State notes in this module), so a function calling
    several kernels never mixes two flag states, whatever other threads publish meanwhile. The scoped
    overrides of the running context apply on top. It then checks that JAX's jit key for this thread
    agrees with these flags: a disagreement means the cache entry being built would be filed under
    other flags (an asyncio task that resumed on a thread whose key another task set), so it raises
    `FlagsOutOfSyncError`. Another thread's `set_flags` never makes it raise: a thread with no scope
    traces with the new defaults, and a scope takes them under its overrides (its key names the
    overrides, and the defaults' key changed with the defaults). Outside a trace it re-syncs the key
    silently.
    """
    record = _publication.trace_record()
    overrides = OVERRIDES.get()
    if record is None:
        pub = _publication.current()
        _thread_state.last_seq = pub.seq
        snap = _snapshot(overrides, pub)
        if _JIT_KEY.value != _thread_key_for(overrides, pub):
            set_thread_key()
        return snap
    pub = record.pub
    snap = _snapshot(overrides, pub)
    actual = _JIT_KEY.value
    key = tuple(getattr(snap, n) for n in TRACED)
    scoped = isinstance(actual, tuple) and actual[:1] == (_SCOPED_TAG,)
    # A tagged key must name this context's overrides (with `DEFAULTS_KEY`, pinned to ``pub`` by
    # `trace_record`, the flags); the defaults' key (the global one: read at the call, from any
    # publication since this thread's last look, which rule 2 retires) must come with the pinned
    # defaults' traced flags.
    if (actual != _tagged(overrides)) if scoped else (key != pub.key):
        raise FlagsOutOfSyncError(
            "jbackends flags in this context differ from the jit key of this thread, so a compiled "
            "function would be cached under the wrong flags. This happens when asyncio tasks (or "
            "code that sets the ContextVar directly) interleave on one thread: call jb.sync() before "
            "calling jitted functions (or use jb.jit, which does), or enter jb.with_backends(...) "
            f"again. context={dict(zip(TRACED, key))} "
            f"key={dict(actual[1]) if scoped else dict(zip(TRACED, pub.key))}"
        )
    return snap


# --------------------------------------------------------------------------------------------------
# Publishing new process defaults (`set_flags` / `reset_flags` change `DEFAULTS`, then call this).
# --------------------------------------------------------------------------------------------------


def publish_defaults() -> None:
    """After `DEFAULTS` changed (under `defaults_lock`): publish it, with both jit keys and JAX's precision."""
    _publication.publish(DEFAULTS)
    _thread_state.last_seq = _publication.current().seq
    bridge_global_precision(explicit_defaults, DEFAULTS)
    # This thread may hold a local key computed against the old defaults.
    if dict(OVERRIDES.get()):
        set_thread_key()


def published_defaults() -> Mapping[str, Any]:
    """The process defaults as last published (not the ones a trace in progress pinned)."""
    return _publication.current().values


# Set while `jb.jit` runs a call (`with_backends` warns about compile-time flags outside it).
IN_JB_JIT: contextvars.ContextVar[bool] = globals().get("IN_JB_JIT") or contextvars.ContextVar(
    "jbackends_in_jit", default=False
)
