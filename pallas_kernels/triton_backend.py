"""Our Pallas Triton kernels on a JAX whose Pallas Triton backend is deprecated (jax >= 0.11).

JAX 0.11 deprecated the Pallas Triton backend ("migrate to the Mosaic GPU backend") and warns at
every lowering of a Triton ``pallas_call``. That warning is addressed to the authors of Triton
kernels, which is us, not to the users of jbackends: our kernels pass :class:`CompilerParams`, whose
lowering runs JAX's own Triton lowering with that one warning silenced. Everything else (other
warnings, JAX's accelerated deprecations, which raise) passes through unchanged.

Dispatch keeps Triton as the Pallas path for GPUs that Mosaic GPU does not target (below sm90), and
:func:`unsupported_reason` tells it when the installed JAX has no Triton backend at all.

Example:
  >>> from pallas_kernels import triton_backend
  >>> triton_backend.CompilerParams(num_warps=4, num_stages=2).num_warps
  4
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

from pallas_kernels import gpu

__all__ = ["CompilerParams", "AVAILABLE", "unsupported_reason"]

#: Whether the installed JAX ships the Pallas Triton backend.
AVAILABLE = gpu.has_triton_backend()

_DEPRECATION = r"The Pallas Triton backend is deprecated"

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


if AVAILABLE:
  CompilerParams = _quiet_params_class()
else:
  @dataclasses.dataclass(frozen=True)
  class CompilerParams:  # type: ignore[no-redef]
    """Placeholder: the installed JAX has no Pallas Triton backend (see :func:`unsupported_reason`)."""
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None


def unsupported_reason() -> Optional[str]:
  """Why no Triton kernel can run with the installed JAX (None when one can)."""
  if AVAILABLE:
    return None
  import jax  # noqa: PLC0415
  return (f"the installed JAX ({jax.__version__}) has no Pallas Triton backend "
          "(jax.experimental.pallas.triton)")
