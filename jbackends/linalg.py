"""`jb.linalg`: eigensolvers that follow `jb.cuda.preferred_linalg_library` (see `_src/linalg.py`).

Example:
  >>> import jax.numpy as jnp, jbackends as jb
  >>> jb.linalg.eigvals(jnp.eye(2)).shape
  (2,)
"""

from jbackends._src.linalg import eig as eig
from jbackends._src.linalg import eigvals as eigvals
