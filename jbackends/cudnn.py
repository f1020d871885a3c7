"""`torch.backends.cudnn`, for JAX: `enabled`, `allow_tf32`, `deterministic`, `benchmark`, `benchmark_limit`.

Attributes are generated from the flag registry: reading gives the value in force, assigning sets the
process default. `flags(...)` is a scoped override whose omitted arguments mean "unchanged" (unlike
torch's, which turns cuDNN off when `enabled` is omitted).
"""

import sys as _sys

from jbackends._src import mirror as _mirror
from jbackends._src import platforms as _platforms
from jbackends._src.flag_scope import with_backends as _with_backends


def flags(enabled=None, benchmark=None, benchmark_limit=None, deterministic=None, allow_tf32=None):
    """Scoped cuDNN flags, like `torch.backends.cudnn.flags`; omitted (None) arguments are unchanged.

    Example:
      >>> import jbackends as jb
      >>> with jb.cudnn.flags(deterministic=True):
      ...     jb.cudnn.deterministic
      True
    """
    given = {
        "cudnn_enabled": enabled,
        "benchmark": benchmark,
        "benchmark_limit": benchmark_limit,
        "deterministic": deterministic,
        "cudnn_allow_tf32": allow_tf32,
    }
    return _with_backends(**{k: v for k, v in given.items() if v is not None})


# --- non-flag rows of torch.backends.cudnn ---


def version() -> int | None:
    """cuDNN version of the installed CUDA plugin as an int (e.g. 91000 for 9.10.0), or None.

    Read from the plugin JAX itself loads (`jax_cuda12_plugin._versions.cudnn_get_version()`); None when
    no CUDA plugin is installed or libcudnn cannot be loaded, as torch answers without cuDNN.

    Example:
      >>> import jbackends as jb
      >>> jb.cudnn.version() is None or jb.cudnn.version() > 0
      True
    """
    return _platforms.cudnn_version()


def is_available() -> bool:
    """Whether cuDNN can be used: a CUDA plugin with a loadable cuDNN and a CUDA device.

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.cudnn.is_available(), bool)
      True
    """
    return version() is not None and bool(_platforms.devices("cuda"))


def is_acceptable(tensor) -> bool:
    """torch's check that cuDNN can take `tensor`: a float16/bfloat16/float32/float64 array on a CUDA device.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> jb.cudnn.is_acceptable(jnp.ones(2))  # a CPU array
      False
    """
    import jax.numpy as jnp

    dtype = getattr(tensor, "dtype", None)
    if dtype is None or jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        return False
    try:
        devices = tensor.devices()
    except AttributeError:
        return False
    return is_available() and all(d.platform == "gpu" for d in devices)


_mirror.install(_sys.modules[__name__])
