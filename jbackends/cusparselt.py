"""`torch.backends.cusparselt`, for JAX: not available, truthfully.

No jaxlib plugin binds NVIDIA cuSPARSELt (2:4 structured-sparse GEMM), so `is_available()` is False and
`version()` is None (torch's answers when it is absent). For sparse arrays use `jax.experimental.sparse`
(BCOO/BCSR; on GPU it calls cuSPARSE, not cuSPARSELt); for 2:4 weights there is no fused kernel in
jbackends.

Example:
  >>> import jbackends as jb
  >>> jb.cusparselt.is_available(), jb.cusparselt.version()
  (False, None)
"""

from __future__ import annotations

__all__ = ["get_max_alg_id", "is_available", "version"]


def is_available() -> bool:
    """False: there is no cuSPARSELt binding in JAX/XLA.

    Example:
      >>> import jbackends as jb
      >>> jb.cusparselt.is_available()
      False
    """
    return False


def version() -> None:
    """None, as torch answers when cuSPARSELt is absent.

    Example:
      >>> import jbackends as jb
      >>> jb.cusparselt.version() is None
      True
    """
    return None


def get_max_alg_id() -> None:
    """None, as torch answers when cuSPARSELt is absent."""
    return None
