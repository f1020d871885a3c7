"""The backend flags' public names, in one place (a facade over the modules that implement them).

* `flag_declarations`: every flag declared once (`Flag`, `FLAGS`) and the `BackendFlags` snapshot class.
* `flag_state`: the state JAX traces through (the ContextVar of scoped overrides, this thread's jit
  key, `current_flags`, `trace_flags`, `sync`). `flag_publication` holds the process defaults, the
  jit-key user contexts and the publication and pin model (described there). `flag_precision`
  bridges the precision flags to JAX's `default_matmul_precision`.
* `flag_scope`: changing the flags (`set_flags`, `reset_flags`, freezing, `with_backends`, `propagate`).
* `jit`: `jb.jit` and `compiler_options`.
"""

from __future__ import annotations

from jbackends._src.flag_declarations import FLAGS, BackendFlags, Flag
from jbackends._src.flag_scope import (
    FlagsFrozenError,
    FlagsTracingError,
    disable_global_flags,
    enable_global_flags,
    flags_frozen,
    propagate,
    reset_flags,
    set_flags,
    with_backends,
)
from jbackends._src.flag_state import FlagsOutOfSyncError, current_flags, sync, trace_flags
from jbackends._src.jit import compiler_options, jit

__all__ = [
    "BackendFlags",
    "Flag",
    "FlagsFrozenError",
    "FlagsOutOfSyncError",
    "FlagsTracingError",
    "current_flags",
    "disable_global_flags",
    "enable_global_flags",
    "flags_frozen",
    "jit",
    "propagate",
    "reset_flags",
    "set_flags",
    "sync",
    "trace_flags",
    "with_backends",
]
