"""`torch.backends.nnpack`, for JAX: not available, truthfully; it can be "disabled" but not enabled.

NNPACK is not part of XLA. XLA:CPU lowers convolutions itself (Eigen, with XNNPACK/YNNPACK fusions for
some ops; see `jb.xnnpack.enabled`). So `is_available()` is False, `set_flags(False)` / `flags(False)`
are accepted (they describe the truth) and asking for `True` raises `RuntimeError` saying what to use:
`jb.conv.conv_general_dilated` (precision follows `jb.cudnn.allow_tf32`) or plain `lax.conv_general_dilated`.

Example:
  >>> import jbackends as jb
  >>> jb.nnpack.is_available()
  False
"""

from __future__ import annotations

import contextlib

__all__ = ["flags", "is_available", "set_flags"]

_WHY = (
    "NNPACK is not part of JAX/XLA (XLA:CPU lowers convolutions itself), so it cannot be enabled; "
    "use jb.conv.conv_general_dilated or jax.lax.conv_general_dilated"
)


def is_available() -> bool:
    """False: XLA has no NNPACK path.

    Example:
      >>> import jbackends as jb
      >>> jb.nnpack.is_available()
      False
    """
    return False


def set_flags(_enabled: bool) -> tuple[bool]:
    """Accepts `False` (returns the previous setting, `(False,)`); `True` raises `RuntimeError`.

    Example:
      >>> import jbackends as jb
      >>> jb.nnpack.set_flags(False)
      (False,)
    """
    if not isinstance(_enabled, bool):
        raise TypeError(f"_enabled must be a bool, got {type(_enabled).__name__} {_enabled!r}")
    if _enabled:
        raise RuntimeError(_WHY)
    return (False,)


@contextlib.contextmanager
def flags(enabled: bool = False):
    """Context manager like torch's; only `enabled=False` is possible (see `set_flags`).

    Example:
      >>> import jbackends as jb
      >>> with jb.nnpack.flags(enabled=False):
      ...     jb.nnpack.is_available()
      False
    """
    set_flags(enabled)
    yield
