"""`torch.backends.mkldnn`, for JAX: the scoped `verbose(level)` region.

XLA's CPU backend does not call oneDNN through torch's hooks, so torch's library-level verbose has no
JAX counterpart; `verbose(level)` reports what jbackends controls instead: every dispatch decision
(and, with the verbose module, compilations), to the `jbackends` logger. Unlike torch's, it nests and
restores the previous level on exit.
"""

from jbackends._src import cpu_info as _cpu_info
from jbackends._src import verbose as _verbose
from jbackends._src.flag_scope import with_backends as _with_backends

__all__ = ["VERBOSE_OFF", "VERBOSE_ON", "VERBOSE_ON_CREATION", "is_available", "verbose"]

VERBOSE_OFF = 0
VERBOSE_ON = 1
VERBOSE_ON_CREATION = 2


def verbose(level: int) -> _with_backends:
    """Scoped verbosity: `with jb.mkldnn.verbose(jb.mkldnn.VERBOSE_ON): ...` (also a decorator).

    The same region as `jb.verbose(level)`: dispatch decisions and compilations go to the `jbackends`
    logger; level 2 adds per-call times. Nests and restores the previous level on exit.

    Example:
      >>> import jbackends as jb
      >>> with jb.mkldnn.verbose(jb.mkldnn.VERBOSE_ON):
      ...     jb.current_flags().verbose
      1
    """
    return _verbose.verbose(level)


def is_available() -> bool:
    """Whether XLA:CPU routes work to oneDNN (mkldnn) in this process, from what it actually compiles.

    x86 jaxlib builds contain oneDNN, but XLA:CPU only calls it with `XLA_FLAGS=--xla_cpu_use_onednn=true`
    (default false) and where no XNNPACK/YNNPACK fusion claims the op first. A small float32 dot is
    compiled once with this process's `XLA_FLAGS`; the answer is True when its HLO calls oneDNN.

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.mkldnn.is_available(), bool)
      True
    """
    return "onednn" in _cpu_info.cpu_dot_libraries()
