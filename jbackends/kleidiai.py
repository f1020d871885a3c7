"""`torch.backends.kleidiai`, for JAX: `is_available()` is False, truthfully.

Arm's KleidiAI micro-kernels are not linked into jaxlib's XLA:CPU (on aarch64, XLA:CPU uses its own
LLVM code and XNNPACK/YNNPACK fusions). For int4 weight matmuls on CPU use `jb.quantized` /
`jb.nn.Int4Linear`.

Example:
  >>> import jbackends as jb
  >>> jb.kleidiai.is_available()
  False
"""

__all__ = ["is_available"]


def is_available() -> bool:
    """False: KleidiAI is not part of jaxlib.

    Example:
      >>> import jbackends as jb
      >>> jb.kleidiai.is_available()
      False
    """
    return False
