"""`torch.backends.miopen`, for JAX (ROCm): `is_available()` and an honest `immediate`.

`is_available()` is True when a jax-rocm plugin is installed and JAX has a ROCm device. torch's
`immediate` (MIOpen immediate mode: use the first applicable algorithm without searching) has no XLA
switch; XLA chooses MIOpen algorithms through its autotuner, which `jb.cudnn.benchmark` /
`jb.cudnn.benchmark_limit` control through `jb.jit` (autotune level and candidate count). Reading
`immediate` gives False; assigning `True` raises `RuntimeError` saying so, assigning `False` is accepted.

Example:
  >>> import jbackends as jb
  >>> jb.miopen.immediate
  False
"""

from __future__ import annotations

import sys as _sys
import types as _types

from jbackends._src import platforms as _platforms

__all__ = ["immediate", "is_available"]


def is_available() -> bool:
    """Whether a jax-rocm plugin is installed and JAX has a ROCm device here.

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.miopen.is_available(), bool)
      True
    """
    return _platforms.rocm_built() and bool(_platforms.devices("rocm"))


class _MiopenModule(_types.ModuleType):
    @property
    def immediate(self) -> bool:
        """Always False: XLA has no MIOpen immediate mode (use jb.cudnn.benchmark=False instead)."""
        return False

    @immediate.setter
    def immediate(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"immediate must be a bool, got {type(value).__name__} {value!r}")
        if value:
            raise RuntimeError(
                "XLA has no MIOpen immediate mode; to skip algorithm search pass "
                "compiler_options={'xla_gpu_autotune_level': 0} to jb.jit (with jb.cudnn.benchmark=True, jb.cudnn.benchmark_limit bounds it)"
            )


_sys.modules[__name__].__class__ = _MiopenModule
