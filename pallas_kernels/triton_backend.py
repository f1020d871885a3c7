"""Our Pallas Triton kernels on a JAX whose Pallas Triton backend is deprecated (jax >= 0.11).

JAX 0.11 deprecated the Pallas Triton backend ("migrate to the Mosaic GPU backend") and warns at
every lowering of a Triton ``pallas_call``. That warning is addressed to the authors of Triton
kernels, which is us, not to the users of jbackends: our kernels pass :class:`CompilerParams`, whose
lowering runs JAX's own Triton lowering with that one warning silenced. Everything else (other
warnings, JAX's accelerated deprecations, which raise) passes through unchanged.

On a JAX without the backend, :func:`available` is False, ``CompilerParams`` is None, and the
dispatcher gives every Triton implementation the reason "the installed JAX has no Pallas Triton
backend", so calls route to cuDNN or XLA (no JAX released so far lacks it).

Example:
  >>> from pallas_kernels import triton_backend
  >>> triton_backend.CompilerParams(num_warps=4, num_stages=2).num_warps
  4
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings

__all__ = ["CompilerParams", "available", "missing"]

_DEPRECATION = r"The Pallas Triton backend is deprecated"


@functools.cache
def available() -> bool:
    """Whether the installed JAX has the Pallas Triton backend (``jax.experimental.pallas.triton``)."""
    try:
        return importlib.util.find_spec("jax.experimental.pallas.triton") is not None
    except ImportError:
        return False


def missing() -> list:
    """``[]`` where the Pallas Triton backend exists, else the one reason every Triton kernel gives."""
    return [] if available() else ["the installed JAX has no Pallas Triton backend"]


def _quiet_params_class():
    """A CompilerParams subclass whose GPU lowering is JAX's Triton rule with the deprecation silenced.

    JAX picks a pallas_call's GPU lowering by the type of its compiler params (a registry keyed by the
    params class, in JAX's private ``pallas.core``). Where that registry is not found (another JAX
    layout), this returns JAX's own class, so kernels still lower, with JAX's warning.
    """
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415

    try:
        from jax._src.pallas import core as pallas_core  # noqa: PLC0415
        from jax._src.pallas.triton import pallas_call_registration as triton_reg  # noqa: PLC0415

        register, rule = pallas_core.register_lowering_rule, triton_reg.pallas_call_lowering
    except (ImportError, AttributeError):
        return plgpu.CompilerParams

    @dataclasses.dataclass(frozen=True)
    class CompilerParams(plgpu.CompilerParams):
        """``jax.experimental.pallas.triton.CompilerParams`` for this package's kernels (see the module)."""

    def quiet_rule(ctx, *args, **params):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
            return rule(ctx, *args, **params)

    register(CompilerParams, quiet_rule, "gpu")
    return CompilerParams


CompilerParams = _quiet_params_class() if available() else None
