"""Which accelerator plugins are installed (built) and which have devices (available).

"Built" in torch means the binary was compiled with the backend; the JAX equivalent is that the PJRT
plugin package (or a jaxlib with the backend inside) is installed. "Available" means JAX can create a
device of that platform in this process. Device queries initialise JAX backends, as any jax.devices()
call does; failures (no driver, no device) are answered with False, never raised.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from typing import Any

import jax

_CUDA_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jaxlib.cuda")
_CUDA_PJRT = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def distributions_with_prefix(prefix: str) -> tuple[str, ...]:
    """Installed distribution names (normalised to '-') starting with `prefix`."""
    names = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name.startswith(prefix):
            names.add(name)
    return tuple(sorted(names))


def cuda_built() -> bool:
    """A CUDA jaxlib plugin (jax-cuda12/13-plugin + pjrt) is installed."""
    return any(_find(m) for m in _CUDA_MODULES + _CUDA_PJRT)


def rocm_built() -> bool:
    """A ROCm jaxlib plugin (jax-rocm*-plugin) is installed."""
    return bool(distributions_with_prefix("jax-rocm"))


def metal_built() -> bool:
    """The jax-metal plugin is installed."""
    return bool(distributions_with_prefix("jax-metal"))


def devices(platform: str) -> list[Any]:
    """`jax.devices(platform)`, or [] when the platform is unknown or has no device."""
    try:
        return list(jax.devices(platform))
    except RuntimeError:
        return []


def cuda_versions() -> Any | None:
    """The `_versions` module of the CUDA plugin (the one jax itself loads), or None."""
    from jax._src import lib as _lib

    return getattr(_lib, "cuda_versions", None)


def cudnn_version() -> int | None:
    """cuDNN version as an int (e.g. 91000 for 9.10.0) from the installed CUDA plugin, or None."""
    versions = cuda_versions()
    if versions is None:
        return None
    try:
        return int(versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - libcudnn missing or not loadable: "not available", as torch says
        return None
