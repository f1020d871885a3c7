"""The state that JAX traces through: process defaults, scoped overrides, the jit key, `trace_flags`.

State model:

* Process defaults live in a module-level dict (torch semantics: they reach every thread and every later
  notebook cell, also when set inside `contextvars.copy_context().run(...)`).
* Scoped overrides live in a `contextvars.ContextVar` (the source of truth for scopes).
* A `jax.make_user_context` (created once per process; a module reload reuses it) mirrors a hashable,
  canonical tuple of the *trace-affecting* flags, so `jax.jit`, `lax.scan` body caches etc. retrace
  exactly when those flags change. Its global value mirrors the process defaults; its thread-local value
  mirrors the ContextVar of whichever scope last touched this thread. A second, global-only user context
  mirrors the process defaults alone, so a `set_flags` in one thread changes the key of every thread,
  including one whose thread-local value was computed against the old defaults (see `_JIT_KEY`).
* Scoped precision flags are bridged to JAX's thread-local `default_matmul_precision` in step with the
  jit key (`flag_precision`); process-default precision flags to JAX's global one.
* `trace_flags()` is the one accessor kernels use at trace time. It recomputes the tuple from the
  ContextVar and compares it with the jit key: under a trace, a disagreement (e.g. an asyncio task that
  resumed on a thread whose key another task set) raises `FlagsOutOfSyncError` instead of silently
  poisoning a cache entry; outside a trace it re-syncs the key and continues.

The flags are declared in `flag_declarations`; `flag_scope` changes this state (`set_flags`,
`with_backends`, `propagate`).
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import jax
from jax._src import config as _jax_config
from jax._src import core as _jax_core

from jbackends._src.flag_declarations import (
    DECLARATIONS,
    PRECISION_FLAGS,
    PRECISION_TO_JAX,
    TRACED,
    BackendFlags,
)
from jbackends._src.flag_precision import bridge_global_precision, sync_precision

__all__ = [
    "DEFAULTS",
    "IN_JB_JIT",
    "OVERRIDES",
    "FlagsOutOfSyncError",
    "current_flags",
    "defaults_lock",
    "effective",
    "explicit_defaults",
    "publish_defaults",
    "published_defaults",
    "set_thread_key",
    "sync",
    "trace_flags",
    "tracing",
]


class FlagsOutOfSyncError(RuntimeError):
    """The jit key of this thread does not match the flags of the running context (see `sync`)."""


# Process defaults are *published*: one immutable `_Publication` (values, jit key, sequence number)
# replaces the previous one under `defaults_lock`, together with the global values of the two JAX user
# contexts that make up the jit key. Readers never look at a half-updated state.
#
# JAX reads its jit key (the C++ dispatch cache, the trace cache, nested jits) at several moments of a
# call, before and while a function is traced, and another thread may publish new defaults at any of
# those moments. Two rules keep every cache entry consistent with its key:
#
# 1. One snapshot per trace. The first flag read inside a top-level trace (the outermost JAX trace of
#    this thread) pins the publication then in force: every later read in that trace (nested jits,
#    scans, `with_backends` scopes inside it) starts from the same defaults, and this thread's value of
#    `_DEFAULTS_KEY` is pinned to that publication's key until JAX drops the trace object, so nested
#    jits are looked up and filed under the pinned key too. A function calling two kernels can no
#    longer mix two flag states, nor pick up a nested executable traced under other defaults.
# 2. Keys read before the pin are retired. The key the call itself is filed under was read before its
#    first flag read, from a publication between the last one this thread saw (`last_seq`) and the
#    pinned one. Every such publication whose key differs from the pinned one is retired: its epoch is
#    bumped, so publishing those flags again later yields a new key, and the entry filed under the old
#    key is never looked up again.
#
# Retiring costs a retrace, and happens only when a publication falls between a thread's last look at
# the defaults and its next trace; flags set again later without such an overlap hit the cache as
# before. An unscoped thread never raises because another thread changed a default: it traces with
# the defaults it pinned.
#
# Scoped overrides live in a `contextvars.ContextVar`. While a scope makes the traced flags differ from
# the defaults, this thread's value of `_JIT_KEY` is a tagged tuple of the scope's traced flags (the
# entry's flags are then exactly its key, whatever the defaults); otherwise it is unset and the global
# value (the defaults' traced flags) is in force, so equal flag sets share cache entries. If another
# thread then changes the defaults under such a scope, its next trace switches it to its tagged key
# and retires the keys the call may be filed under (`_adopt_scope`).

# Process state survives `importlib.reload` (a reload re-executes this module in the same namespace):
# defaults set before the reload stay in force (and `flag_precision` keeps the JAX precision it saved).
_previous_defaults = globals().get("DEFAULTS", {})
DEFAULTS: dict[str, Any] = {f.name: f.default for f in DECLARATIONS}
DEFAULTS.update({k: v for k, v in _previous_defaults.items() if k in DEFAULTS})
del _previous_defaults
defaults_lock = globals().get("defaults_lock") or threading.RLock()
# defaults changed through set_flags (bridged to JAX where relevant)
explicit_defaults: set[str] = {n for n in globals().get("explicit_defaults", ()) if n in DEFAULTS}

_Overrides = tuple  # sorted tuple of (name, value): immutable and hashable
OVERRIDES: contextvars.ContextVar[_Overrides] = globals().get("OVERRIDES") or contextvars.ContextVar(
    "jbackends_overrides", default=()
)
_SCOPED_TAG = "jbackends-scope"  # first item of a scoped jit key: never equal to a defaults key


def _key_of(values: Mapping[str, Any]) -> tuple:
    return tuple(values[n] for n in TRACED)


@dataclasses.dataclass(frozen=True, eq=False)
class _Publication:
    """One atomic state of the process defaults and of the jit-key values published with it."""

    seq: int
    values: Mapping[str, Any]
    key: tuple  # traced flags: the global value of _JIT_KEY
    gkey: tuple  # (key, epoch): the value of _DEFAULTS_KEY
    jax_precision: str | None  # JAX's default_matmul_precision bridged from these defaults, if any


# The jit key, in two user contexts, each created once per process (`importlib.reload` re-executes this
# module in the same namespace, so existing contexts are reused rather than registering new ones):
#
# * `_JIT_KEY`: global value = the defaults' traced flags; thread-local value = a scope's tagged key.
# * `_DEFAULTS_KEY`: global only, `(defaults' traced flags, epoch)`. JAX's thread-local value shadows
#   the global one, so without it a thread inside a scope would keep its key after another thread
#   called `set_flags`; with it, every thread retraces, and the epoch lets rule 2 retire a key.
_JIT_KEY = globals().get("_JIT_KEY") or jax.make_user_context(default_value=_key_of(DEFAULTS))
_DEFAULTS_KEY = globals().get("_DEFAULTS_KEY") or jax.make_user_context(default_value=None)
_UNSET = None  # filled lazily: the marker jax uses for "no thread-local value"
# Per thread: jbackends' ownership of JAX's thread-local default_matmul_precision (`sync_precision`),
# the last publication seen (`last_seq`) and the pinned trace (`trace_ref`, `record`).
_thread_state = globals().get("_thread_state") or threading.local()

_epochs: dict[tuple, int] = globals().get("_epochs", {})
_history: collections.deque = globals().get("_history") or collections.deque(maxlen=256)
_retired_count = globals().get("_retired_count", 0)  # keys retired so far (for tests and the report)


def _make_publication(values: Mapping[str, Any]) -> _Publication:
    """Build and publish a new `_Publication` (under `defaults_lock`)."""
    global _PUB
    previous = globals().get("_PUB")
    key = _key_of(values)
    bridged = any(n in explicit_defaults for n in PRECISION_FLAGS)
    pub = _Publication(
        seq=(previous.seq + 1 if previous is not None else 0),
        values=dict(values),
        key=key,
        gkey=(key, _epochs.setdefault(key, 0)),
        jax_precision=PRECISION_TO_JAX[values["float32_matmul_precision"]] if bridged else None,
    )
    # JAX's values first, then the publication: a reader that sees `_PUB.seq == n` knows JAX's key is
    # publication n's or newer (rule 2 relies on it).
    _JIT_KEY.set_global(pub.key)
    _DEFAULTS_KEY.set_global(pub.gkey)
    _PUB = pub
    _history.append(pub)
    return pub


def _retire(gkey: tuple, keep: tuple | None = None) -> None:
    """Never publish `gkey` again (under `defaults_lock`): entries filed under it become unreachable."""
    global _retired_count
    key, epoch = gkey
    if gkey != keep and _epochs.get(key, 0) == epoch:
        _epochs[key] = epoch + 1
        _retired_count += 1


def _retire_since(lo: int | None, keep: tuple | None) -> None:
    """Retire the keys of every publication with `seq >= lo` (all of them if `lo` is None or too old)."""
    if lo is None or not _history or lo < _history[0].seq:
        for key in list(_epochs):
            _retire((key, _epochs[key]), keep)
        return
    for pub in list(_history):
        if pub.seq >= lo:
            _retire(pub.gkey, keep)


class _TraceRecord:
    """A top-level trace in progress in one thread, and the publication it pinned."""

    __slots__ = ("pub", "lo", "thread", "saved", "saved_precision")

    def __init__(self, pub: _Publication, lo: int | None):
        self.pub, self.lo, self.thread = pub, lo, threading.get_ident()
        self.saved = self.saved_precision = None

    def pin(self) -> None:
        """This thread's defaults key, and JAX's matmul precision bridged from the defaults (unless a
        scope owns it), follow the pinned publication until `release`."""
        self.saved = _DEFAULTS_KEY._obj.swap_local(self.pub.gkey)
        if self.pub.jax_precision is not None and not getattr(_thread_state, "precision_owned", False):
            self.saved_precision = (_jax_config.default_matmul_precision.swap_local(self.pub.jax_precision),)

    def release(self) -> None:
        _DEFAULTS_KEY._obj.set_local(self.saved)
        if self.saved_precision is not None:
            _jax_config.default_matmul_precision.set_local(self.saved_precision[0])
        ts = _thread_state
        if getattr(ts, "record", None) is self:
            ts.record = ts.trace_ref = None


def _end_trace(record: _TraceRecord) -> None:
    """JAX dropped the pinned trace: give this thread the global defaults key back."""
    if threading.get_ident() == record.thread and getattr(_thread_state, "record", None) is record:
        record.release()


def _outermost_trace() -> Any:
    trace = _jax_core.trace_ctx.trace
    while True:
        parent = getattr(trace, "parent_trace", None)
        if parent is None or isinstance(parent, _jax_core.EvalTrace):
            return trace
        trace = parent


def _unpin_ended() -> None:
    """Release a pin whose trace ended where its finalizer could not (another thread's GC)."""
    ts = _thread_state
    record = getattr(ts, "record", None)
    if record is not None:
        ref = ts.trace_ref
        if ref is None or ref() is None or not tracing():
            record.release()


def _trace_record() -> _TraceRecord | None:
    """This thread's record for the top-level trace in progress (pinning one at the first read)."""
    ts = _thread_state
    if not tracing():
        if getattr(ts, "record", None) is not None:
            _unpin_ended()
        return None
    outer = _outermost_trace()
    ref = getattr(ts, "trace_ref", None)
    if ref is not None and ref() is outer:
        return ts.record
    previous = getattr(ts, "record", None)
    if previous is not None:  # a pin whose finalizer has not run here: release it first
        previous.release()
    with defaults_lock:
        pub = _PUB
        lo = getattr(ts, "last_seq", None)
        if lo != pub.seq:  # JAX may have read the key of any publication since `lo`: rule 2
            _retire_since(lo, keep=pub.gkey)
        ts.last_seq = pub.seq
    record = _TraceRecord(pub, lo)
    record.pin()
    try:
        ts.trace_ref = weakref.ref(outer)
    except TypeError:  # not weak-referenceable: held, and released at this thread's next read outside it
        ts.trace_ref = lambda: outer
    else:
        weakref.finalize(outer, _end_trace, record)
    ts.record = record
    return record


_snapshot_cache: dict[tuple, Any] = {}


def effective(overrides: _Overrides, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    out = dict(_PUB.values if values is None else values)
    out.update(overrides)
    return out


def _snapshot(overrides: _Overrides, pub: _Publication) -> Any:
    cache_key = (overrides, pub.seq)
    snap = _snapshot_cache.get(cache_key)
    if snap is None:
        snap = BackendFlags(**effective(overrides, pub.values))
        if len(_snapshot_cache) > 512:
            _snapshot_cache.clear()
        _snapshot_cache[cache_key] = snap
    return snap


def _publication_in_force() -> _Publication:
    """The pinned publication under a trace, else the current one (recording it as seen)."""
    record = _trace_record()
    if record is not None:
        return record.pub
    pub = _PUB
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


def _thread_key_for(snap: Any, pub: _Publication) -> tuple:
    """The value `_JIT_KEY` must have in this thread for the flags `snap` (see the State notes)."""
    key = tuple(getattr(snap, n) for n in TRACED)
    return pub.key if key == pub.key else (_SCOPED_TAG, key)


def _expected_key() -> tuple:
    pub = _publication_in_force()
    return _thread_key_for(_snapshot(OVERRIDES.get(), pub), pub)


def set_thread_key() -> None:
    """Make this thread's jit key and JAX matmul precision mirror the ContextVar.

    The key's thread-local value is unset when the traced flags in force equal the defaults' (the global
    value is then in force, and such a scope shares cache entries with unscoped code).
    """
    global _UNSET
    overrides = dict(OVERRIDES.get())
    obj = _JIT_KEY._obj
    expected = _expected_key() if any(n in overrides for n in TRACED) else None
    # Which scope this thread's key was computed for, when that scope equals the defaults (see
    # `_adopt_scope`); an asyncio task that did not sync has other overrides.
    _thread_state.shared_for = OVERRIDES.get() if expected is not None else None
    if expected is not None and expected[:1] == (_SCOPED_TAG,):
        obj.swap_local(expected)
    else:
        if _UNSET is None:
            from jax._src.config import config_ext

            _UNSET = config_ext.unset
        obj.set_local(_UNSET)
    sync_precision(overrides, _thread_state)


with defaults_lock:
    _make_publication(DEFAULTS)
    _thread_state.last_seq = _PUB.seq


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


def _adopt_scope(record: _TraceRecord, key: tuple) -> None:
    """Under a trace: this thread's scope shared the defaults' key, and another thread changed them.

    The scope's flags win (they are what the code in the scope asked for): from now on this thread
    uses the scope's own tagged key, nested jits included. The call itself was filed under the
    defaults' key with the scope's flags, so every key it may have read is retired (rule 2) and the
    current defaults are published again under a fresh epoch.
    """
    _JIT_KEY._obj.swap_local((_SCOPED_TAG, key))
    _thread_state.shared_for = None
    with defaults_lock:
        _retire_since(record.lo, None)
        _make_publication(_PUB.values)


def tracing() -> bool:
    return not _jax_core.trace_state_clean()


def trace_flags() -> Any:
    """The flags a kernel must use while it is being traced (the one trace-time accessor).

    Under a trace, every read in one top-level trace starts from the same snapshot of the process
    defaults (pinned at the first read; see the State notes in this module), so a function calling
    several kernels never mixes two flag states, whatever other threads publish meanwhile. The scoped
    overrides of the running context apply on top. It then checks that JAX's jit key for this thread
    agrees with these flags: a disagreement means the cache entry being built would be filed under
    other flags (an asyncio task that resumed on a thread whose key another task set, or a scope that
    leaves a flag to the defaults while another thread's `set_flags` changed that flag), so it raises
    `FlagsOutOfSyncError`. A thread with no scope never raises; nor does a scope whose flags equal
    the old defaults (it shared their key): it keeps its flags under its own key from then on. Outside
    a trace it re-syncs the key silently.
    """
    record = _trace_record()
    if record is None:
        pub = _PUB
        _thread_state.last_seq = pub.seq
        snap = _snapshot(OVERRIDES.get(), pub)
        if _JIT_KEY.value != _thread_key_for(snap, pub):
            set_thread_key()
        return snap
    pub = record.pub
    snap = _snapshot(OVERRIDES.get(), pub)
    actual = _JIT_KEY.value
    key = tuple(getattr(snap, n) for n in TRACED)
    scoped = isinstance(actual, tuple) and actual[:1] == (_SCOPED_TAG,)
    # A tagged key must name exactly these flags; the defaults' key must come with the pinned defaults.
    if (
        not scoped
        and key != pub.key
        and OVERRIDES.get()
        and getattr(_thread_state, "shared_for", None) == OVERRIDES.get()
    ):
        _adopt_scope(record, key)  # a scope equal to the old defaults, which another thread changed
    elif (actual != (_SCOPED_TAG, key)) if scoped else (key != pub.key):
        raise FlagsOutOfSyncError(
            "jbackends flags in this context differ from the jit key of this thread, so a compiled "
            "function would be cached under the wrong flags. This happens when asyncio tasks (or "
            "code that sets the ContextVar directly) interleave on one thread, or when another thread "
            "changed a process default (jb.set_flags) that this thread's with_backends scope does not "
            "override: call jb.sync() before calling jitted functions (or use jb.jit, which does), or "
            "enter jb.with_backends(...) again. "
            f"context={dict(zip(TRACED, key))} "
            f"key={dict(zip(TRACED, actual[1] if scoped else pub.key))}"
        )
    return snap


# --------------------------------------------------------------------------------------------------
# Publishing new process defaults (`set_flags` / `reset_flags` change `DEFAULTS`, then call this).
# --------------------------------------------------------------------------------------------------


def publish_defaults() -> None:
    """After `DEFAULTS` changed (under `defaults_lock`): publish it, with both jit keys and JAX's precision."""
    _make_publication(DEFAULTS)
    _thread_state.last_seq = _PUB.seq
    bridge_global_precision(explicit_defaults, DEFAULTS)
    # This thread may hold a local key computed against the old defaults.
    if dict(OVERRIDES.get()):
        set_thread_key()


def published_defaults() -> Mapping[str, Any]:
    """The process defaults as last published (not the ones a trace in progress pinned)."""
    return _PUB.values


# Set while `jb.jit` runs a call (`with_backends` warns about compile-time flags outside it).
IN_JB_JIT: contextvars.ContextVar[bool] = globals().get("IN_JB_JIT") or contextvars.ContextVar(
    "jbackends_in_jit", default=False
)
