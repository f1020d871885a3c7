"""`jb.conv`: convolutions whose float32 precision follows `jb.cudnn.allow_tf32` (see `_src/conv.py`).

Example:
  >>> import jax.numpy as jnp, jbackends as jb
  >>> jb.conv.conv_general_dilated(jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 3, 3)), (1, 1), "VALID").shape
  (1, 1, 2, 2)
"""

from jbackends._src.conv import conv_general_dilated as conv_general_dilated
