"""The bridge from the precision flags to JAX's `default_matmul_precision`.

`flag_state` calls it: scoped precision flags go to JAX's thread-local setting in step with the jit key
(`sync_precision`), process-default precision flags to JAX's global one (`bridge_global_precision`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import jax
from jax._src import config as _jax_config

from jbackends._src.flag_declarations import PRECISION_FLAGS, PRECISION_TO_JAX

__all__ = ["bridge_global_precision", "sync_precision"]


def sync_precision(overrides: Mapping[str, Any], ts: Any) -> None:
    """Bridge scoped precision flags to JAX's (thread-local) `default_matmul_precision`.

    JAX's setting is per thread while scopes are per context (asyncio task, `propagate`d worker), so it
    is re-applied from the ContextVar whenever the jit key is (`with_backends`, `sync`, `propagate`).
    jbackends only touches it while a scope overrides a precision flag: it saves what the thread had
    before and restores it when no such scope is in force. A scope that does not change the precision
    leaves JAX's setting alone (so a user's own `jax.default_matmul_precision(...)` inside it stands).

    `ts` is the thread's state in `flag_state`: its `precision_owned`, `precision_saved` and
    `precision_applied` record that ownership (a trace's pin reads `precision_owned`).
    """
    state = _jax_config.default_matmul_precision
    owned = getattr(ts, "precision_owned", False)
    if any(n in overrides for n in PRECISION_FLAGS):
        want = PRECISION_TO_JAX[overrides["float32_matmul_precision"]]
        if not owned:
            ts.precision_saved = state.swap_local(want)
            ts.precision_owned, ts.precision_applied = True, want
        elif ts.precision_applied != want:
            state.set_local(want)
            ts.precision_applied = want
    elif owned:
        state.set_local(ts.precision_saved)
        ts.precision_owned = False


# JAX's own default_matmul_precision is bridged only when a precision flag was set explicitly
# (an omitted flag means "unchanged": importing jbackends never changes JAX's behaviour).
# Like `flag_state`'s process state, the saved precision survives `importlib.reload`.
_jax_precision_before: list = globals().get("_jax_precision_before", [])


def bridge_global_precision(explicit_defaults: Collection[str], defaults: Mapping[str, Any]) -> None:
    if any(n in explicit_defaults for n in PRECISION_FLAGS):
        if not _jax_precision_before:
            # The global value: `jax.config.jax_default_matmul_precision` reads this thread's, which
            # a scope (or the user's `with jax.default_matmul_precision(...)`) may have set.
            _jax_precision_before.append(_jax_config.default_matmul_precision.get_global())
        jax.config.update(
            "jax_default_matmul_precision", PRECISION_TO_JAX[defaults["float32_matmul_precision"]]
        )
    elif _jax_precision_before:
        jax.config.update("jax_default_matmul_precision", _jax_precision_before.pop())
