"""`torch.backends.xnnpack`, for JAX: `enabled` tells whether XLA:CPU offloads work to XNNPACK.

Read-only, as in torch. The answer is not a guess: a small float32 dot is compiled once by XLA:CPU with
this process's `XLA_FLAGS`, and `enabled` is True when the optimised HLO contains an XNNPACK or YNNPACK
(XNNPACK's successor) fusion. `libraries()` says which. To turn XNNPACK fusions off for a process, set
`XLA_FLAGS=--xla_cpu_use_xnnpack=false` (and check `libraries()`: some jaxlib builds keep YNNPACK dot
fusions regardless).

Example:
  >>> import jbackends as jb
  >>> jb.xnnpack.enabled in (True, False)
  True
"""

from __future__ import annotations

import sys as _sys
import types as _types

from jbackends._src import cpu_info as _cpu_info

__all__ = ["enabled", "libraries"]


def libraries() -> frozenset[str]:
    """The CPU libraries a probe dot is lowered to by XLA:CPU here ("xnnpack", "ynnpack", "onednn").

    Example:
      >>> import jbackends as jb
      >>> jb.xnnpack.libraries() <= {"xnnpack", "ynnpack", "onednn"}
      True
    """
    return _cpu_info.cpu_dot_libraries()


class _XnnpackModule(_types.ModuleType):
    @property
    def enabled(self) -> bool:
        """Whether XLA:CPU lowers a float32 dot to an XNNPACK/YNNPACK fusion in this process."""
        return bool({"xnnpack", "ynnpack"} & _cpu_info.cpu_dot_libraries())


_sys.modules[__name__].__class__ = _XnnpackModule
