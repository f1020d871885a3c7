"""`torch.backends.mps`, for JAX: Apple GPUs through the jax-metal PJRT plugin.

`is_built()` is True when the `jax-metal` plugin is installed; `is_available()` when JAX has a METAL
device in this process. `is_macos_or_newer(major, minor)` reads the macOS version (False elsewhere).

Example:
  >>> import jbackends as jb
  >>> jb.mps.is_available() in (True, False)
  True
"""

from __future__ import annotations

import platform as _platform

from jbackends._src import platforms as _platforms

__all__ = ["is_available", "is_built", "is_macos_or_newer", "is_macos13_or_newer"]


def is_built() -> bool:
    """Whether the jax-metal plugin (JAX's MPS backend) is installed.

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.mps.is_built(), bool)
      True
    """
    return _platforms.metal_built()


def is_available() -> bool:
    """Whether JAX has a METAL device in this process (jax-metal installed and working).

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.mps.is_available(), bool)
      True
    """
    return bool(_platforms.devices("METAL") or _platforms.devices("metal"))


def is_macos_or_newer(major: int, minor: int) -> bool:
    """Whether this is macOS `major.minor` or newer (False on other systems).

    Example:
      >>> import jbackends as jb
      >>> jb.mps.is_macos_or_newer(13, 0) in (True, False)
      True
    """
    for name, v in (("major", major), ("minor", minor)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    release = _platform.mac_ver()[0]
    if not release:
        return False
    parts = [int(p) for p in release.split(".")[:2] if p.isdigit()] + [0, 0]
    return (parts[0], parts[1]) >= (major, minor)


def is_macos13_or_newer(minor: int = 0) -> bool:
    """torch's older spelling of `is_macos_or_newer(13, minor)`."""
    return is_macos_or_newer(13, minor)
