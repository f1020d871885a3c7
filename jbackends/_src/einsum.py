"""`jb.einsum` / `jb.einsum_path`: `jnp.einsum` whose contraction order follows `jb.opt_einsum`.

torch.backends.opt_einsum semantics, for JAX:

* `enabled` (flag `opt_einsum_enabled`) True: the contraction path is computed by opt_einsum with the
  `strategy` in force (flag `opt_einsum_strategy`: "auto", "greedy", "optimal", "dp", "branch-2", ...).
* `enabled` False: operands are contracted left to right, ((A B) C) D, as torch does without opt_einsum.

The flags are read with `trace_flags()` when the call is traced, and both are part of the jit key, so a
jitted function retraces when they change. The path is computed from shapes only and handed to
`jnp.einsum(optimize=path)`, so the contraction order is visible in the jaxpr (the order of
`dot_general`s) and through `jb.einsum_path`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import opt_einsum as _oe
from jax import lax

from jbackends._src import flag_state as _flag_state
from jbackends._src import verbose as _verbose

Path = list[tuple[int, ...]]


def left_to_right_path(num_operands: int) -> Path:
    """The opt_einsum-format path that contracts ((op0 op1) op2) ... left to right.

    opt_einsum appends each intermediate at the end of the operand list, so after the first pair the
    running result sits last: step k contracts the next original operand (now at 0) with it.

    Example:
      >>> left_to_right_path(4)
      [(0, 1), (0, 2), (0, 1)]
    """
    if num_operands < 1:
        raise ValueError(f"einsum needs at least one operand, got {num_operands}")
    if num_operands == 1:
        return [(0,)]
    return [(0, 1)] + [(0, num_operands - 1 - k) for k in range(1, num_operands - 1)]


def _split(subscripts: Any, operands: Sequence[Any]) -> tuple[str, list[Any]]:
    """Canonicalise the two einsum call forms to (subscripts string, operands)."""
    if isinstance(subscripts, str):
        return subscripts, list(operands)
    # Interleaved form: einsum(op0, sublist0, op1, sublist1, ..., [sublist_out]).
    subs, ops = _oe.parser.convert_interleaved_input((subscripts, *operands))
    return subs, list(ops)


def _choose(subscripts: str, operands: Sequence[Any], optimize: Any) -> tuple[Any, str, dict[str, str]]:
    """(path or optimize value for jnp.einsum, chosen label, reasons others were not taken)."""
    if optimize is not None:
        return optimize, "explicit", {"flags": "optimize= given by the caller"}
    flags = _flag_state.trace_flags()
    if len(operands) <= 2:
        # One contraction: every strategy gives the same path.
        path = left_to_right_path(len(operands))
        return path, "single_contraction", {}
    if not flags.opt_einsum_enabled:
        return (
            left_to_right_path(len(operands)),
            "left_to_right",
            {"opt_einsum": "jb.opt_einsum.enabled is False"},
        )
    shapes = [np.shape(op) for op in operands]
    path, _ = _oe.contract_path(subscripts, *shapes, optimize=flags.opt_einsum_strategy, shapes=True)
    return (
        [tuple(p) for p in path],
        f"opt_einsum:{flags.opt_einsum_strategy}",
        {"left_to_right": "jb.opt_einsum.enabled is True"},
    )


def einsum_path(subscripts: Any, *operands: Any, optimize: Any = None) -> tuple[Path, Any]:
    """The contraction path `jb.einsum` would use here, and opt_einsum's `PathInfo` for it.

    Same call forms as `jnp.einsum_path`. With `optimize=None` the path follows the flags in force
    (`jb.opt_einsum.enabled` / `.strategy`); any other value is passed to opt_einsum as given.

    Example:
      >>> import numpy as np, jbackends as jb
      >>> a, b, c = np.ones((2, 30)), np.ones((30, 40)), np.ones((40, 5))
      >>> with jb.with_backends(opt_einsum_enabled=False):
      ...     jb.einsum_path("ab,bc,cd->ad", a, b, c)[0]
      [(0, 1), (0, 1)]
    """
    subs, ops = _split(subscripts, operands)
    path, _, _ = _choose(subs, ops, optimize)
    if path is False:  # what jnp.einsum does with it (opt_einsum reads False as "all at once")
        path = [tuple(p) for p in jnp.einsum_path(subs, *ops, optimize=False)[0]]
    shapes = [np.shape(op) for op in ops]
    path_out, info = _oe.contract_path(subs, *shapes, optimize=path, shapes=True)
    return [tuple(p) for p in path_out], info


def einsum(
    subscripts: Any,
    /,
    *operands: Any,
    out: None = None,
    optimize: Any = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    _dot_general: Any = lax.dot_general,
    out_sharding: Any = None,
) -> Any:
    """`jnp.einsum` with the contraction order chosen by `jb.opt_einsum` (torch.einsum semantics).

    Same signature as `jnp.einsum`, except that `optimize=None` (the default) means "follow the flags":
    opt_einsum with `jb.opt_einsum.strategy` when `jb.opt_einsum.enabled`, else left to right. An explicit
    `optimize` (a strategy name, bool or path) is passed through unchanged. The path is chosen at trace
    time from the flags in force (`trace_flags()`); see it with `jb.einsum_path`.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> a, b, c = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((4, 5))
      >>> with jb.with_backends(opt_einsum_strategy="greedy"):
      ...     jb.einsum("ab,bc,cd->ad", a, b, c).shape
      (2, 5)

    Raises:
      ValueError: `out` is not None (JAX arrays are immutable), or the subscripts do not match.
    """
    if out is not None:
        raise ValueError(
            "jb.einsum: the 'out' argument is not supported (JAX arrays are immutable); use the return value"
        )
    subs, ops = _split(subscripts, operands)
    path, chosen, reasons = _choose(subs, ops, optimize)
    _verbose.report_dispatch(
        "einsum",
        chosen,
        reasons,
        tuple(tuple(np.shape(o)) for o in ops),
        tuple(jnp.result_type(o) for o in ops),
    )
    kwargs = {}
    if out_sharding is not None:
        kwargs["out_sharding"] = out_sharding
    cast_back = None
    if preferred_element_type is None:
        # torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction=False: accumulate the
        # half-precision contractions in float32 and round once at the end.
        result = jnp.result_type(*ops)
        flags = _flag_state.trace_flags()
        if (result == jnp.float16 and not flags.allow_fp16_reduced_precision_reduction) or (
            result == jnp.bfloat16 and not flags.allow_bf16_reduced_precision_reduction
        ):
            preferred_element_type, cast_back = jnp.float32, result
    out = _verbose.call(
        "einsum",
        jnp.einsum,
        subs,
        *ops,
        optimize=path,
        precision=precision,
        preferred_element_type=preferred_element_type,
        _dot_general=_dot_general,
        **kwargs,
    )
    return out if cast_back is None else out.astype(cast_back)
