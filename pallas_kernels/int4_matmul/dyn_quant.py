"""Torch's dynamic-quant numerics of the int4 matmul, bit for bit: the int8 activation quantization
(KleidiAI ``qai8dx`` as torch's x86 kernel runs it), the exact int32 group dots and the float tail
(groups summed in order, no fused multiply-add), and torch's bfloat16 truncation.

Plain ``jnp``, used by the reference (`base`, which re-exports these names) and by every engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "quantize_activations",
    "rounded_mul",
    "group_dots",
    "accumulate_groups",
    "truncate_to_bfloat16",
]

_INT32_MIN = np.iinfo(np.int32).min


def _round_half_away(y: jax.Array) -> jax.Array:
    # std::round. y - trunc(y) is exact in floating point.
    t = jnp.trunc(y)
    return t + jnp.where(jnp.abs(y - t) >= 0.5, jnp.sign(y), 0).astype(y.dtype)


def _torch_row_range(x: jax.Array, skip_nan: bool = False) -> tuple[jax.Array, jax.Array]:
    """The ``(min, max)`` torch's kernel finds scanning a row with ``std::min`` / ``std::max``.

    float32 input: ``max0 = std::max(x[k], max0)`` is ``x[k] < max0 ? max0 :
    x[k]``: a NaN replaces the running value and the next element replaces the
    NaN, so the scan only sees the elements after the row's last NaN (none:
    ``+inf`` / ``-inf`` here, which the ``min(0, .)`` / ``max(0, .)`` that
    follow turn into 0, as torch's NaN does). bfloat16 input (``skip_nan``):
    torch's bfloat16 kernel keeps the running value over a NaN, so the range
    is that of the row's other elements.
    """
    idx = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    if skip_nan:
        seen = ~jnp.isnan(x)
    else:
        last_nan = jnp.max(jnp.where(jnp.isnan(x), idx, -1), axis=-1, initial=-1)
        seen = idx > last_nan[..., None]
    mn = jnp.min(jnp.where(seen, x, np.inf), axis=-1, initial=np.inf)
    mx = jnp.max(jnp.where(seen, x, -np.inf), axis=-1, initial=-np.inf)
    return mn, mx


def _x86_to_int32(y: jax.Array) -> jax.Array:
    """float32 -> int32 as torch's x86 build converts with ``(int32_t)`` (``cvttss2si``).

    ``y`` is already an integer value; NaN, +-inf and anything outside the
    int32 range become INT32_MIN (x86's "integer indefinite"), where XLA's
    convert would give 0 or saturate.
    """
    ok = jnp.isfinite(y) & (y >= -(2.0**31)) & (y < 2.0**31)
    return jnp.where(ok, jnp.where(ok, y, 0).astype(jnp.int32), jnp.int32(_INT32_MIN))


def quantize_activations(x: jax.Array, channelwise: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """KleidiAI ``qai8dx`` per row of ``x[..., K]`` (float32 math), as torch's x86 kernels run it
    (its float32 kernel for float32 ``x``, its bfloat16 one for bfloat16 ``x``: they differ only in how
    a NaN enters the row's range).

    Returns ``(qa int32 [..., K] in -128..127, zp int32 [...], recip f32 [...])``
    with ``x ~= (qa - zp) * recip``. The zero-point test is written as torch
    writes it: ``(qmin + dmin) + (qmax + dmax) > 0`` in its channel-wise kernel,
    ``((qmin + dmin) + qmax) + dmax > 0`` in its group-wise one.

    Non-finite input follows torch bit for bit (`_torch_row_range`,
    `_x86_to_int32`): the row's range comes from the elements after its last
    NaN (float32) or from its elements other than NaN (bfloat16); a NaN, an infinity or a value beyond int32 after scaling quantizes to
    INT32_MIN + zp (integer wrap-around) clamped, i.e. -128 when ``zp >= 0``
    and 127 when ``zp < 0``; a NaN zero point (a row holding -inf or +inf:
    scale 0) is 0 (``lrintf`` returns a 64-bit long there).
    """
    skip_nan = x.dtype == jnp.bfloat16
    x = x.astype(jnp.float32)
    qmin, qmax = jnp.float32(-128), jnp.float32(127)
    mn, mx = _torch_row_range(x, skip_nan)
    rmin = jnp.minimum(jnp.float32(0), mn)
    rmax = jnp.maximum(jnp.float32(0), mx)
    scale = jnp.where(rmin == rmax, jnp.float32(1), (qmax - qmin) / (rmax - rmin))
    recip = jnp.where(scale != 0, jnp.float32(1) / scale, jnp.float32(0))
    dmin = rmin * scale
    dmax = rmax * scale
    if channelwise:
        from_min = (qmin + dmin) + (qmax + dmax) > 0
    else:
        from_min = ((qmin + dmin) + qmax) + dmax > 0
    zpf = jnp.clip(jnp.where(from_min, qmin - dmin, qmax - dmax), qmin, qmax)
    # torch's ``int32_t zp = lrintf(zpf)``: ties to even; lrintf returns a 64-bit long on x86-64, so a
    # NaN gives its integer indefinite 0x8000000000000000, whose low 32 bits are 0 (zpf is otherwise
    # within [-128, 127]).
    zp = jnp.where(jnp.isnan(zpf), jnp.float32(0), jnp.round(zpf)).astype(jnp.int32)
    v = _x86_to_int32(_round_half_away(x * scale[..., None]))
    qa = jnp.clip(v + zp[..., None], -128, 127)  # int32 add wraps, as in torch's build
    return qa, zp, recip


def rounded_mul(a: jax.Array, b: jax.Array, guard: jax.Array) -> jax.Array:
    """``a * b`` rounded to float32 on its own: never fused into an FMA.

    XLA (CPU and GPU) and Triton contract ``a * b + c`` inside a fusion. The
    product goes through an integer ``or`` with a runtime value that is always
    0 (``guard == INT32_MIN`` never holds for the int32 sums passed as guard),
    which the compiler cannot see through.
    """
    p = lax.bitcast_convert_type(a * b, jnp.int32)
    p = p | (guard == _INT32_MIN).astype(jnp.int32)
    return lax.bitcast_convert_type(p, jnp.float32)


def group_dots(qa: jax.Array, zp: jax.Array, q: jax.Array, groupsize: int) -> jax.Array:
    """Exact int32 ``sum_{k in g} (qa_k - zp) * q[n, k]``: ``[M, N, G]``."""
    M, K = qa.shape
    N = q.shape[0]
    G = K // groupsize
    a = (qa - zp[:, None]).reshape(M, 1, G, groupsize)
    return jnp.sum(a * q.reshape(1, N, G, groupsize), axis=-1, dtype=jnp.int32)


def accumulate_groups(
    idots: jax.Array,
    scales: jax.Array,
    recip: jax.Array,
    zp: jax.Array,
    bias: jax.Array | None,
    channelwise: bool,
) -> jax.Array:
    """The float tail of the dyn-quant matmul, in torch's order, no FMA.

    Args:
      idots: int32 ``[M, N, G]`` group sums.
      scales: float32 ``[N, G]``.
      recip: float32 ``[M]`` (1 / activation scale).
      zp: int32 ``[M]`` (only a runtime guard for `rounded_mul`).
      bias: float32 ``[N]`` or None.
      channelwise: ``G == 1`` with torch's channel-wise kernel (no ``0 +``).
    """
    G = idots.shape[-1]
    fd = idots.astype(jnp.float32)
    if channelwise:
        acc = rounded_mul(fd[..., 0], scales[None, :, 0], idots[..., 0])
    else:
        prods = rounded_mul(fd, scales[None], idots)
        acc = jnp.zeros(prods.shape[:-1], jnp.float32)
        if G <= 1024:
            for g in range(G):
                acc = acc + prods[..., g]
        else:
            acc = lax.fori_loop(0, G, lambda g, a: a + lax.dynamic_index_in_dim(prods, g, -1, False), acc)
    zpb = jnp.broadcast_to(zp[:, None], acc.shape)
    if bias is None:
        out = acc * recip[:, None]
    else:
        out = rounded_mul(acc, recip[:, None], zpb) + bias[None, :]
    return jnp.clip(out, -np.finfo(np.float32).max, np.finfo(np.float32).max)


def truncate_to_bfloat16(x: jax.Array) -> jax.Array:
    """float32 -> bfloat16 by dropping the low 16 bits (torch's fallback)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) >> 16
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)
