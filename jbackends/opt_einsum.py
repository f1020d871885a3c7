"""`torch.backends.opt_einsum`, for JAX: `enabled` and `strategy` drive `jb.einsum`'s contraction order.

torch's surface, same names: `is_available()`, `get_opt_einsum()`, the attributes `enabled` and
`strategy`, `set_flags(_enabled=None, _strategy=None)` and `flags(enabled=None, strategy=None)`.

`enabled` / `strategy` are generated from the flag registry (reading gives the value in force, assigning
sets the process default; scoped: `jb.with_backends(opt_einsum_strategy="greedy")`). `strategy` accepts
"auto", "greedy", "optimal" and opt_einsum's other path names; setting it while disabled raises, as in
torch. With `enabled` False `jb.einsum` contracts left to right. See `jb.einsum_path` for the chosen path.

Example:
  >>> import jbackends as jb
  >>> jb.opt_einsum.is_available(), jb.opt_einsum.strategy
  (True, 'auto')
"""

import sys as _sys

from jbackends._src import flag_scope as _flag_scope
from jbackends._src import flag_state as _flag_state
from jbackends._src import mirror as _mirror

# --- non-flag rows of torch.backends.opt_einsum ---


def is_available() -> bool:
    """Whether the opt_einsum package can be imported (it is a jbackends dependency, so True).

    Example:
      >>> import jbackends as jb
      >>> jb.opt_einsum.is_available()
      True
    """
    return get_opt_einsum() is not None


def get_opt_einsum():
    """The `opt_einsum` module, or None if it cannot be imported.

    Example:
      >>> import jbackends as jb
      >>> jb.opt_einsum.get_opt_einsum().__name__
      'opt_einsum'
    """
    try:
        import opt_einsum
    except ImportError:
        return None
    return opt_einsum


def set_flags(_enabled=None, _strategy=None) -> tuple:
    """Set the process defaults of `enabled` / `strategy` (None: unchanged), like torch's.

    Returns the previous process defaults as `(enabled, strategy)`, so `set_flags(*previous)` restores
    them. Values are validated first (a bool; a strategy name, refused while disabled, as in torch,
    unless this call disables it: `set_flags(False, strategy)` keeps ``strategy`` for when it is
    enabled again, which a restore of a disabled state needs; torch refuses it).

    Example:
      >>> import jbackends as jb
      >>> previous = jb.opt_einsum.set_flags(True, "greedy")
      >>> previous, jb.opt_einsum.strategy
      ((True, 'auto'), 'greedy')
      >>> _ = jb.opt_einsum.set_flags(*previous)
    """
    previous = _flag_state.published_defaults()
    orig = (previous["opt_einsum_enabled"], previous["opt_einsum_strategy"] if is_available() else None)
    given = {"opt_einsum_enabled": _enabled, "opt_einsum_strategy": _strategy}
    updates = {k: v for k, v in given.items() if v is not None}
    if updates.get("opt_einsum_enabled") is False and "opt_einsum_strategy" in updates:
        # The strategy while enabled, then disabled: one change to the process defaults for other
        # set_flags callers and traces (both take the lock).
        with _flag_state.defaults_lock:
            _flag_scope.set_flags(opt_einsum_enabled=True, opt_einsum_strategy=updates["opt_einsum_strategy"])
            _flag_scope.set_flags(opt_einsum_enabled=False)
    elif updates:
        _flag_scope.set_flags(**updates)
    return orig


def flags(enabled=None, strategy=None):
    """Scoped `enabled` / `strategy` (None: unchanged), a context manager and a decorator.

    Unlike torch's (process-global), the scope is per thread / asyncio task and restores on exit,
    like every `jb.with_backends` scope; jitted functions traced inside it see it (and retrace).

    Example:
      >>> import jbackends as jb
      >>> with jb.opt_einsum.flags(strategy="optimal"):
      ...     jb.opt_einsum.strategy
      'optimal'
    """
    given = {"opt_einsum_enabled": enabled, "opt_einsum_strategy": strategy}
    return _flag_scope.with_backends(**{k: v for k, v in given.items() if v is not None})


_mirror.install(_sys.modules[__name__])
