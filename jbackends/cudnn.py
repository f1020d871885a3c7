"""`torch.backends.cudnn`, for JAX: `enabled`, `allow_tf32`, `deterministic`, `benchmark`, `benchmark_limit`.

Attributes are generated from the flag registry: reading gives the value in force, assigning sets the
process default. `flags(...)` is a scoped override whose omitted arguments mean "unchanged" (unlike
torch's, which turns cuDNN off when `enabled` is omitted).
"""

import sys as _sys

from jbackends._src import mirror as _mirror
from jbackends._src.flags import with_backends as _with_backends


def flags(enabled=None, benchmark=None, benchmark_limit=None, deterministic=None, allow_tf32=None):
    """Scoped cuDNN flags, like `torch.backends.cudnn.flags`; omitted (None) arguments are unchanged.

    Example:
      >>> import jbackends as jb
      >>> with jb.cudnn.flags(deterministic=True):
      ...     jb.cudnn.deterministic
      True
    """
    given = {"cudnn_enabled": enabled, "benchmark": benchmark, "benchmark_limit": benchmark_limit,
             "deterministic": deterministic, "cudnn_allow_tf32": allow_tf32}
    return _with_backends(**{k: v for k, v in given.items() if v is not None})

_mirror.install(_sys.modules[__name__])
