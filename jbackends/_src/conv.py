"""`jb.conv.conv_general_dilated`: float32 convolution precision follows `jb.cudnn.allow_tf32`.

torch.backends.cudnn.allow_tf32 (default True) lets cuDNN convolutions use TF32. The JAX meaning is the
`precision` of `lax.conv_general_dilated`, chosen at trace time from the flag in force:

    jb.cudnn.allow_tf32   precision passed           effect on float32 inputs
    True (default)        lax.Precision.DEFAULT      GPU may use TF32 (Ampere+); CPU computes in fp32
    False                 lax.Precision.HIGHEST      full fp32 everywhere

The precision shows in the HLO (`precision_config`). An explicit `precision=` argument wins. To use it in
flax, pass it to the module: `nnx.Conv(..., conv_general_dilated=jb.conv.conv_general_dilated)`.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from jbackends._src import flag_state as _flag_state
from jbackends._src import verbose as _verbose


def precision_for_flags(flags: Any) -> lax.Precision:
    """The convolution precision the cuDNN TF32 flag maps to."""
    return lax.Precision.DEFAULT if flags.cudnn_allow_tf32 else lax.Precision.HIGHEST


def conv_general_dilated(
    lhs: Any,
    rhs: Any,
    window_strides: Any,
    padding: Any,
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> Any:
    """`lax.conv_general_dilated` whose default precision follows `jb.cudnn.allow_tf32`.

    Same arguments as `lax.conv_general_dilated` (extra keywords such as `out_sharding` pass through).

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> x, w = jnp.ones((1, 1, 5, 5)), jnp.ones((1, 1, 3, 3))
      >>> with jb.cudnn.flags(allow_tf32=False):
      ...     float(jb.conv.conv_general_dilated(x, w, (1, 1), "VALID")[0, 0, 0, 0])
      9.0
    """
    if precision is None:
        precision = precision_for_flags(_flag_state.trace_flags())
        chosen, reasons = f"precision={precision.name}", {"caller": "no precision= given"}
    else:
        chosen, reasons = "precision=explicit", {"flags": "precision= given by the caller"}
    _verbose.report_dispatch(
        "conv",
        chosen,
        reasons,
        (getattr(lhs, "shape", ()), getattr(rhs, "shape", ())),
        (getattr(lhs, "dtype", None), getattr(rhs, "dtype", None)),
    )
    return _verbose.call(
        "conv",
        lax.conv_general_dilated,
        lhs,
        rhs,
        window_strides,
        padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
    )
