"""The scoped verbose mode (`jb.verbose(level)`, `jb.mkl.verbose(level)`, `jb.mkldnn.verbose(level)`).

torch's RFC 63212 verbose, for JAX. Inside `with jb.verbose(1):` (or any `with_backends(verbose=n)`)
every event below is one line on the `jbackends` logger (level INFO); outside it nothing is emitted.
Scopes nest and restore the previous level (they are `with_backends` scopes), unlike torch's.

Line format (one event per line; fields are `key=value`, values never contain spaces except `rejected`,
which is last):

    jbackends dispatch op=<op> chosen=<backend> shapes=<2x3,3x4> dtypes=<float32,float32> rejected=<name: why; ...|->
    jbackends trace fun=<name> secs=<s>            level >= 1: JAX traced a function to a jaxpr
    jbackends retrace fun=<name> count=<n>         level >= 1: the n-th trace of a function of that name
    jbackends lower fun=<name> secs=<s>            level >= 1: jaxpr -> StableHLO
    jbackends compile fun=<name> secs=<s>          level >= 1: XLA backend compilation
    jbackends call op=<op> secs=<s>                level >= 2: one eager call of a jbackends op (jb.fft.*,
                                                   jb.einsum, jb.linalg, jb.conv, jb.nn.attention_fn) or of
                                                   a `jb.timed` function, timed to completion
                                                   (`block_until_ready`: device time plus dispatch); calls
                                                   inside a trace are not timed (the trace has no device)

Compilation events come from `jax.monitoring` duration listeners registered once per process. When the
flag is 0, `report_dispatch` is one attribute read and each listener call (compile time only, never per
executed call) one attribute read plus a dictionary increment. A "retrace" is counted by function
name over the process lifetime, so two different lambdas count as one name.

If nothing would show INFO lines (no handler on the `jbackends` logger or the root logger, level
unset), the first emitted line installs a stderr handler and sets the logger to INFO: asking for verbose
output shows it. Configure `logging` yourself to route it elsewhere.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jbackends._src import flag_scope as _flag_scope
from jbackends._src import flag_state as _flag_state

logger = logging.getLogger("jbackends")

_STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_TRACE_COUNTS: dict[str, int] = {}
_TRACE_COUNTS_MAX = 4096
_lock = threading.Lock()


def _ensure_visible() -> None:
    if logger.level == logging.NOTSET and not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers and logger.propagate:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def level() -> int:
    """The verbose level in force here (0 = off)."""
    return _flag_state.current_flags().verbose


def report_dispatch(
    op: str, chosen: str, reasons: Mapping[str, str], shapes: tuple = (), dtypes: tuple = ()
) -> None:
    """Log one dispatch decision if verbose is on (no cost beyond a flag read when off).

    Args:
      op: the operation, e.g. "sdpa" or "int4_matmul".
      chosen: the backend that will run.
      reasons: for each backend not taken, why.
      shapes: the argument shapes (tuples), in argument order.
      dtypes: the argument dtypes, in argument order.
    """
    if not _flag_state.current_flags().verbose:
        return
    _ensure_visible()
    rejected = "; ".join(f"{name}: {why}" for name, why in reasons.items()) or "-"
    shapes_s = ",".join("x".join(map(str, s)) if isinstance(s, tuple) else str(s) for s in shapes) or "-"
    dtypes_s = ",".join(str(d) for d in dtypes) or "-"
    logger.info(
        "jbackends dispatch op=%s chosen=%s shapes=%s dtypes=%s rejected=%s",
        op,
        chosen,
        shapes_s,
        dtypes_s,
        rejected,
    )


def _on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
    stage = _STAGES.get(event)
    if stage is None:
        return
    fun = str(kwargs.get("fun_name", "?")).replace(" ", "_")
    count = 0
    if stage == "trace":
        with _lock:
            if len(_TRACE_COUNTS) >= _TRACE_COUNTS_MAX and fun not in _TRACE_COUNTS:
                _TRACE_COUNTS.clear()
            count = _TRACE_COUNTS[fun] = _TRACE_COUNTS.get(fun, 0) + 1
    if not _flag_state.current_flags().verbose:
        return
    _ensure_visible()
    logger.info("jbackends %s fun=%s secs=%.6f", stage, fun, duration_secs)
    if count > 1:
        logger.info("jbackends retrace fun=%s count=%d", fun, count)


def _register_once() -> None:
    # The flag lives on the jax.monitoring module so a reload of this module does not register twice.
    if getattr(jax.monitoring, "_jbackends_verbose_listener", None) is not None:
        return
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring._jbackends_verbose_listener = _on_duration  # type: ignore[attr-defined]


_register_once()


def report_call(op: str, secs: float) -> None:
    """Log one timed call (level >= 2)."""
    if _flag_state.current_flags().verbose < 2:
        return
    _ensure_visible()
    logger.info("jbackends call op=%s secs=%.6f", op, secs)


def call(op: str, fun: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run `fun(*args, **kwargs)`; at verbose level >= 2 (and outside a trace) time it to completion."""
    if _flag_state.current_flags().verbose < 2 or _flag_state.tracing():
        return fun(*args, **kwargs)
    start = time.perf_counter()
    out = jax.block_until_ready(fun(*args, **kwargs))
    report_call(op, time.perf_counter() - start)
    return out


def timed(fun: Callable | None = None, /, *, name: str | None = None) -> Callable:
    """Wrap a function so each call is timed to completion at verbose level >= 2 (free otherwise).

    Use it on a `jax.jit` / `jb.jit` function to get one `jbackends call op=<name> secs=<s>` line per
    call inside `jb.verbose(2)`. The time includes dispatch; the call blocks until the result is ready
    (only at level >= 2).

    Example:
      >>> import jax, jax.numpy as jnp, jbackends as jb
      >>> f = jb.timed(jax.jit(lambda x: x * 2), name="double")
      >>> with jb.verbose(2):
      ...     float(f(jnp.float32(2)))
      4.0
    """
    if fun is None:
        return functools.partial(timed, name=name)
    op = name or getattr(fun, "__name__", "call")

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return call(op, fun, *args, **kwargs)

    return wrapper


def verbose(level: int) -> Any:
    """Scoped verbose region: report dispatch decisions and compilations to the `jbackends` logger.

    `level` 0 is off, 1 reports dispatch decisions, traces, retraces, lowerings and XLA compilations,
    2 adds per-call times for eager calls of jbackends ops (`jb.fft.*`, `jb.einsum`, `jb.linalg`,
    `jb.conv`, `jb.nn.attention_fn`) and of functions wrapped with `jb.timed`.
    A context manager and a decorator; nests and restores the previous level.

    Example:
      >>> import jax, jax.numpy as jnp, jbackends as jb
      >>> with jb.verbose(1):
      ...     _ = jax.jit(lambda x: x + 1)(jnp.float32(1))  # logs trace, lower and compile lines
    """
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"verbose level must be an int (0 off, 1, 2), got {type(level).__name__} {level!r}")
    if level not in (0, 1, 2):
        raise ValueError(f"verbose level must be 0 (off), 1 or 2, got {level}")
    return _flag_scope.with_backends(verbose=level)
