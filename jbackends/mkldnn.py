"""`torch.backends.mkldnn`, for JAX: the scoped `verbose(level)` region.

XLA's CPU backend does not call oneDNN through torch's hooks, so torch's library-level verbose has no
JAX counterpart; `verbose(level)` reports what jbackends controls instead: every dispatch decision
(and, with the verbose module, compilations), to the `jbackends` logger. Unlike torch's, it nests and
restores the previous level on exit.
"""

from jbackends._src.flags import with_backends as _with_backends

VERBOSE_OFF = 0
VERBOSE_ON = 1
VERBOSE_ON_CREATION = 2


def verbose(level: int) -> _with_backends:
    """Scoped verbosity: `with jb.mkldnn.verbose(jb.mkldnn.VERBOSE_ON): ...` (also a decorator)."""
    return _with_backends(verbose=level)
