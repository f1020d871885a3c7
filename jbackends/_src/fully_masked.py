"""jax.nn's answer for fully masked query rows, substituted after the kernels ran.

`jb.dot_product_attention(..., fully_masked_rows="jax")` (the default) gives what
``jax.nn.dot_product_attention`` gives for a query row whose every key is masked; every kernel returns
output 0 and LSE ``-inf`` there (torch's answer, kept with ``fully_masked_rows="zero"``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import base

__all__ = ["JAXNN_LARGE_NEGATIVE", "check_fully_masked_rows", "fix_fully_masked_rows"]

#: jax.nn's masking value (``_get_large_negative``: capped at the float32 range): the LSE residual of
#: a fully masked row is this number (log S vanishes next to it) in the query's dtype.
JAXNN_LARGE_NEGATIVE = float(np.asarray(-0.7 * np.finfo(np.float32).max, np.float32))


def check_fully_masked_rows(mode) -> str:
    """``mode`` if it is a valid ``fully_masked_rows`` value, else a ValueError naming the argument."""
    if mode not in ("jax", "zero"):
        raise ValueError(
            f"`fully_masked_rows` must be 'jax' (jax.nn's answer: the mean of V) or 'zero'; got {mode!r}"
        )
    return mode


def fix_fully_masked_rows(args, out, lse, mode):
    """jax.nn's answer for rows without a key (the kernels give output 0 and LSE -inf there).

    The rows are found from the kernels' LSE (``-inf`` iff no key is left), so this costs
    ``O(B * N * T)`` on top of the kernel and needs nothing from the kernels themselves. The
    substituted mean of V carries jax.nn's gradient (1 / S per key) through ``jnp.where``; the
    kernels' zero output there carries none.
    """
    if check_fully_masked_rows(mode) == "zero" or args.kv_len == 0:
        return out, lse
    if args.bias is None and not base.rows_can_lack_keys(args):
        # No mask can leave a row without a key (none at all, or a causal / window structure that leaves
        # every row one, e.g. jax.nn's top-left causal): no pass over the output. (A row whose LSE is
        # -inf only because its inputs are infinite keeps the kernel's answer there.)
        return out, lse
    masked = args.mask is not None or args.has_index_masks
    empty = lse == -jnp.inf  # [B, N, T]
    rows = jnp.swapaxes(empty, 1, 2)[..., None]  # [B, T, N, 1]
    if not masked:  # only a -inf bias removed the keys: jax.nn's softmax of all -inf is NaN
        return jnp.where(rows, jnp.asarray(jnp.nan, out.dtype), out), lse
    if args.q_seq_lengths is not None:  # jax.nn zeroes the rows beyond the query length
        valid = jnp.arange(args.q_len, dtype=jnp.int32)[None, :] < args.q_seq_lengths[:, None]
        rows = rows & valid[:, :, None, None]
    vmean = jnp.mean(args.v.astype(jnp.promote_types(args.v.dtype, jnp.float32)), axis=1)
    vmean = jnp.repeat(vmean, args.groups, axis=1)  # [B, N, Hv]: query head n reads kv head n // G
    out = jnp.where(rows, vmean[:, None].astype(out.dtype), out)
    return out, jnp.where(empty, jnp.asarray(JAXNN_LARGE_NEGATIVE, lse.dtype), lse)
