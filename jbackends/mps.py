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
import re as _re
import subprocess as _subprocess

from jbackends._src import platforms as _platforms

__all__ = [
    "get_core_count",
    "get_name",
    "is_available",
    "is_built",
    "is_macos_or_newer",
    "is_macos13_or_newer",
]


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


_NOT_AVAILABLE = (
    "MPS is not available: JAX reaches Apple GPUs through the jax-metal plugin "
    "(pip install jax-metal on Apple silicon macOS); jb.mps.is_available() is False here"
)


def get_name() -> str:
    """The Metal GPU's name (the METAL device's `device_kind`); `RuntimeError` when MPS is unavailable.

    Example:
      >>> import jbackends as jb
      >>> jb.mps.get_name() if jb.mps.is_available() else "no mps"  # doctest: +ELLIPSIS
      '...'
    """
    devices = _platforms.devices("METAL") or _platforms.devices("metal")
    if not devices:
        raise RuntimeError(_NOT_AVAILABLE)
    return str(devices[0].device_kind)


def get_core_count() -> int:
    """GPU core count from the macOS IORegistry (`gpu-core-count`); `RuntimeError` when unavailable.

    Example:
      >>> import jbackends as jb
      >>> jb.mps.get_core_count() > 0 if jb.mps.is_available() else True
      True
    """
    if not is_available():
        raise RuntimeError(_NOT_AVAILABLE)
    try:
        out = _subprocess.run(
            ["ioreg", "-rc", "AGXAccelerator"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, _subprocess.SubprocessError) as e:
        raise RuntimeError(f"cannot read the GPU core count from ioreg: {e}") from None
    match = _re.search(r'"gpu-core-count"\s*=\s*(\d+)', out)
    if not match:
        raise RuntimeError("ioreg lists no gpu-core-count for the AGXAccelerator")
    return int(match.group(1))
