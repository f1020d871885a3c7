"""`torch.backends.opt_einsum`, for JAX: `enabled` and `strategy` drive `jb.einsum`'s contraction order.

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

from jbackends._src import mirror as _mirror

# --- issue 6 (non-flag rows of torch.backends.opt_einsum) ---


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


# --- end issue 6 ---

_mirror.install(_sys.modules[__name__])
