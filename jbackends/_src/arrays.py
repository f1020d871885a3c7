"""Array arguments taken the way `jax.numpy` takes them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def check_arraylike(fn_name: str, name: str, value: Any) -> None:
    """Refuse what `jax.numpy` refuses: an array argument must be an array (JAX or NumPy), a scalar, or
    an object with ``__jax_array__``; a list or tuple is a `TypeError` (jnp will not guess a dtype from
    Python containers, and neither do we)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return
    if hasattr(value, "__jax_array__"):
        return
    raise TypeError(
        f"{fn_name} requires an array or a scalar for {name}, got {type(value).__name__}; "
        "convert it with jnp.asarray first (as jax.numpy requires)"
    )
