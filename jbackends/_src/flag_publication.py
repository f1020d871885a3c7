"""Published process defaults and the pin of one snapshot per trace (the model `flag_state` reads).

* `DEFAULTS` (with `defaults_lock` and `explicit_defaults`): the process defaults, torch semantics
  (they reach every thread and every later notebook cell). `flag_scope.set_flags` changes them, then
  `flag_state.publish_defaults` publishes them with `publish`.
* `Publication`: one immutable state of the defaults and of the jit-key values published with it;
  `current()` is the one in force.
* `JIT_KEY` and `DEFAULTS_KEY`: the two `jax.make_user_context`s that make up the jit key (created once
  per process). `publish` sets their global values; `flag_state` sets `JIT_KEY`'s thread-local value
  for scopes, `TraceRecord.pin` sets `DEFAULTS_KEY`'s for a trace.
* `trace_record()`: under a trace, the publication the outermost trace of this thread pinned at its
  first flag read (rule 1 below), retiring the keys the call may have been filed under (rule 2).

The scoped overrides (a ContextVar), the accessors (`current_flags`, `trace_flags`) and this thread's
jit key for a scope are `flag_state`'s.
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

from jbackends._src.flag_declarations import DECLARATIONS, PRECISION_FLAGS, PRECISION_TO_JAX, TRACED

__all__ = [
    "DEFAULTS",
    "DEFAULTS_KEY",
    "JIT_KEY",
    "PIN_FOR_CALL",
    "Publication",
    "TraceRecord",
    "UNSET",
    "current",
    "defaults_lock",
    "explicit_defaults",
    "key_of",
    "publish",
    "retire_since",
    "thread_state",
    "trace_record",
    "tracing",
]


# Process defaults are *published*: one immutable `Publication` (values, jit key, sequence number)
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
#    `DEFAULTS_KEY` is pinned to that publication's key until JAX drops the trace object, so nested
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

# Process state survives `importlib.reload` (a reload re-executes this module in the same namespace):
# defaults set before the reload stay in force (and `flag_precision` keeps the JAX precision it saved).
_previous_defaults = globals().get("DEFAULTS", {})
DEFAULTS: dict[str, Any] = {f.name: f.default for f in DECLARATIONS}
DEFAULTS.update({k: v for k, v in _previous_defaults.items() if k in DEFAULTS})
del _previous_defaults
defaults_lock = globals().get("defaults_lock") or threading.RLock()
# defaults changed through set_flags (bridged to JAX where relevant)
explicit_defaults: set[str] = {n for n in globals().get("explicit_defaults", ()) if n in DEFAULTS}


def key_of(values: Mapping[str, Any]) -> tuple:
    """The traced flags of ``values``, in `TRACED` order: the global value of `JIT_KEY`."""
    return tuple(values[n] for n in TRACED)


@dataclasses.dataclass(frozen=True, eq=False)
class Publication:
    """One atomic state of the process defaults and of the jit-key values published with it."""

    seq: int
    values: Mapping[str, Any]
    key: tuple  # traced flags: the global value of JIT_KEY
    gkey: tuple  # (key, epoch): the value of DEFAULTS_KEY
    jax_precision: str | None  # JAX's default_matmul_precision bridged from these defaults, if any


# The jit key, in two user contexts, each created once per process (`importlib.reload` re-executes this
# module in the same namespace, so existing contexts are reused rather than registering new ones):
#
# * `JIT_KEY`: global value = the defaults' traced flags; thread-local value = a scope's tagged key.
# * `DEFAULTS_KEY`: global only, `(defaults' traced flags, epoch)`. JAX's thread-local value shadows
#   the global one, so without it a thread inside a scope would keep its key after another thread
#   called `set_flags`; with it, every thread retraces, and the epoch lets rule 2 retire a key.
JIT_KEY = globals().get("JIT_KEY") or jax.make_user_context(default_value=key_of(DEFAULTS))
DEFAULTS_KEY = globals().get("DEFAULTS_KEY") or jax.make_user_context(default_value=None)
# Per thread: jbackends' ownership of JAX's thread-local default_matmul_precision (`sync_precision`),
# the last publication seen (`last_seq`) and the pinned trace (`trace_ref`, `record`).
thread_state = globals().get("thread_state") or threading.local()
#: JAX's marker of a config whose thread-local value is not set (the global value is in force).
UNSET = _jax_config.config_ext.unset

_epochs: dict[tuple, int] = globals().get("_epochs", {})
_history: collections.deque = globals().get("_history") or collections.deque(maxlen=256)
_retired_count = globals().get("_retired_count", 0)  # keys retired so far (for tests and the report)


def publish(values: Mapping[str, Any]) -> Publication:
    """Build and publish a new `Publication` of ``values`` (under `defaults_lock`)."""
    global _PUB
    previous = globals().get("_PUB")
    key = key_of(values)
    bridged = any(n in explicit_defaults for n in PRECISION_FLAGS)
    pub = Publication(
        seq=(previous.seq + 1 if previous is not None else 0),
        values=dict(values),
        key=key,
        gkey=(key, _epochs.setdefault(key, 0)),
        jax_precision=PRECISION_TO_JAX[values["float32_matmul_precision"]] if bridged else None,
    )
    # JAX's values first, then the publication: a reader that sees `_PUB.seq == n` knows JAX's key is
    # publication n's or newer (rule 2 relies on it).
    JIT_KEY.set_global(pub.key)
    DEFAULTS_KEY.set_global(pub.gkey)
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


def retire_since(lo: int | None, keep: tuple | None) -> None:
    """Retire the keys of every publication with `seq >= lo` (all of them if `lo` is None or too old)."""
    if lo is None or not _history or lo < _history[0].seq:
        for key in list(_epochs):
            _retire((key, _epochs[key]), keep)
        return
    for pub in list(_history):
        if pub.seq >= lo:
            _retire(pub.gkey, keep)


#: Set by `jb.jit` while it runs a call: ``choose(pub) -> Publication``, the publication a top-level
#: trace starting now pins instead of the newest one ``pub``. `jb.jit` picks its `jax.jit` by the compiler
#: options of the flags in force; if another thread publishes defaults that map to other options before
#: the trace's first flag read, the trace would follow the new flags and be compiled with the old
#: options. ``choose`` then returns the publication the call's options came from: the whole call runs
#: as if it came before that `set_flags`. Rule 2 retires the keys JAX may have filed it under, and the
#: newest defaults are published again under a fresh epoch.
PIN_FOR_CALL: contextvars.ContextVar = globals().get("PIN_FOR_CALL") or contextvars.ContextVar(
    "jbackends_pin_for_call", default=None
)


class TraceRecord:
    """A top-level trace in progress in one thread, and the publication it pinned."""

    __slots__ = ("pub", "lo", "thread", "saved", "saved_precision")

    def __init__(self, pub: Publication, lo: int | None):
        self.pub, self.lo, self.thread = pub, lo, threading.get_ident()
        self.saved = self.saved_precision = None

    def pin(self) -> None:
        """This thread's defaults key, and JAX's matmul precision bridged from the defaults (unless a
        scope owns it), follow the pinned publication until `release`."""
        self.saved = DEFAULTS_KEY._obj.swap_local(self.pub.gkey)
        if self.pub.jax_precision is not None and not getattr(thread_state, "precision_owned", False):
            state = _jax_config.default_matmul_precision
            previous = state.swap_local(self.pub.jax_precision)
            if previous is UNSET:  # only the global (bridged) precision was in force: pin it
                self.saved_precision = (previous,)
            else:  # the user's own `jax.default_matmul_precision(...)` in this thread stands
                state.set_local(previous)

    def release(self) -> None:
        DEFAULTS_KEY._obj.set_local(self.saved)
        if self.saved_precision is not None:
            _jax_config.default_matmul_precision.set_local(self.saved_precision[0])
        ts = thread_state
        if getattr(ts, "record", None) is self:
            ts.record = ts.trace_ref = None


def _end_trace(record: TraceRecord) -> None:
    """JAX dropped the pinned trace: give this thread the global defaults key back."""
    if threading.get_ident() == record.thread and getattr(thread_state, "record", None) is record:
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
    ts = thread_state
    record = getattr(ts, "record", None)
    if record is not None:
        ref = ts.trace_ref
        if ref is None or ref() is None or not tracing():
            record.release()


def trace_record() -> TraceRecord | None:
    """This thread's record for the top-level trace in progress (pinning one at the first read)."""
    ts = thread_state
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
        choose = PIN_FOR_CALL.get()
        if choose is not None:  # a jb.jit call: the publication its compiler options came from
            pub = choose(pub)
        lo = getattr(ts, "last_seq", None)
        if lo != _PUB.seq or pub is not _PUB:  # JAX may have read the key of any publication since `lo`
            retire_since(lo, keep=pub.gkey)  # rule 2 (with `lo` None: every key)
        if pub is not _PUB:
            # The call may be filed under the newest key, which is still in force: publish the same
            # defaults again under a fresh epoch (JAX's trace cache is shared by every jit of a function,
            # whatever its compiler options).
            publish(_PUB.values)
        ts.last_seq = _PUB.seq
    record = TraceRecord(pub, lo)
    record.pin()
    try:
        ts.trace_ref = weakref.ref(outer)
    except TypeError:  # not weak-referenceable: held, and released at this thread's next read outside it
        ts.trace_ref = lambda: outer
    else:
        weakref.finalize(outer, _end_trace, record)
    ts.record = record
    return record


def current() -> Publication:
    """The publication in force now (not the one a trace in progress pinned: see `trace_record`)."""
    return _PUB


def tracing() -> bool:
    """Whether JAX is tracing in this thread."""
    return not _jax_core.trace_state_clean()


with defaults_lock:
    publish(DEFAULTS)
    thread_state.last_seq = _PUB.seq
