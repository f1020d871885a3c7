"""`torch.backends.mkl`, for JAX: the scoped `verbose(level)` region.

XLA's CPU backend does not call MKL, so torch's library-level verbose has no
JAX counterpart; `verbose(level)` reports what jbackends controls instead: every dispatch decision
(and, with the verbose module, compilations), to the `jbackends` logger. Unlike torch's, it nests and
restores the previous level on exit.
"""

from jbackends._src import verbose as _verbose
from jbackends._src.flag_scope import with_backends as _with_backends

__all__ = ["VERBOSE_OFF", "VERBOSE_ON", "is_available", "verbose"]

VERBOSE_OFF = 0
VERBOSE_ON = 1


def verbose(level: int) -> _with_backends:
    """Scoped verbosity: `with jb.mkl.verbose(jb.mkl.VERBOSE_ON): ...` (also a decorator).

    The same region as `jb.verbose(level)`: dispatch decisions and compilations go to the `jbackends`
    logger; level 2 adds per-call times. Nests and restores the previous level on exit.

    Example:
      >>> import jbackends as jb
      >>> with jb.mkl.verbose(jb.mkl.VERBOSE_ON):
      ...     jb.current_flags().verbose
      1
    """
    return _verbose.verbose(level)


def is_available() -> bool:
    """False: jaxlib's XLA:CPU does not link Intel MKL (it uses Eigen and XNNPACK/YNNPACK; see `jb.xnnpack`).

    Example:
      >>> import jbackends as jb
      >>> jb.mkl.is_available()
      False
    """
    return False
