"""The attention reference (the math backend): every backend is tested against :func:`reference`; its
VJP, and :func:`differentiable_backward`, which makes a fast backward pass differentiable (second order).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any

from pallas_kernels.attention.args import AttentionArgs
from pallas_kernels.attention.masking import (
    dropout_keep_from_words,
    dropout_threshold,
    dropout_words_of,
    index_mask,
    key_range,
    softcap,
)

__all__ = [
    "full_mask",
    "rows_can_lack_keys",
    "rows_without_keys",
    "structure_empties_rows",
    "reference",
    "reference_vjp",
    "differentiable_backward",
    "unsupported",
    "attention",
]

# ----------------------------------------------------------------------------------------------
# Reference (math) implementation.
# ----------------------------------------------------------------------------------------------


def full_mask(args: AttentionArgs):
    """The complete bool ``[B, N, T, S]``-broadcastable mask of ``args`` (None if nothing masks).

    For the reference only: it materialises ``T x S`` when an index mask is present.
    """
    B, T, S = args.batch, args.q_len, args.kv_len
    i = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    m = index_mask(i, j, causal=args.causal, diag_offset=args.diag_offset, window=args.window)
    m = None if m is None else m[None, None]
    if args.q_seq_lengths is not None:
        mq = (i[None] < args.q_seq_lengths[:, None, None])[:, None]
        m = mq if m is None else m & mq
    if args.kv_seq_lengths is not None:
        mk = (j[None] < args.kv_seq_lengths[:, None, None])[:, None]
        m = mk if m is None else m & mk
    if args.q_segment_ids is not None:
        ms = (args.q_segment_ids[:, :, None] == args.kv_segment_ids[:, None, :])[:, None]
        m = ms if m is None else m & ms
    if args.mask is not None:
        m = args.mask if m is None else m & args.mask
    del B
    return m


def structure_empties_rows(args: AttentionArgs) -> bool:
    """Whether the static structure alone (causal, diagonal offset, window) leaves some query row
    without a key; decided at trace time with numpy, ``O(T)``. A top-left causal mask (jax.nn's) never
    does; a bottom-right one with more queries than keys, or a window past the keys, does."""
    T, S = args.q_len, args.kv_len
    symbolic = jax.export.is_symbolic_dim(T) or jax.export.is_symbolic_dim(S)
    if not symbolic and S == 0:
        return T > 0
    if not args.causal and args.window is None:
        return False
    if symbolic:
        return True  # symbolic sizes (a shape-polymorphic export): it may; the rows are masked at run time
    i = np.arange(T, dtype=np.int64)
    lo, hi = key_range(i, i + 1, S, causal=args.causal, diag_offset=args.diag_offset, window=args.window)
    return bool(np.any(lo >= hi))


def rows_can_lack_keys(args: AttentionArgs) -> bool:
    """Whether the masks of ``args`` may leave some query row without a key (static: True whenever a
    boolean mask, segment ids or lengths are given; for causal / window alone the exact answer)."""
    if (
        args.mask is not None
        or args.q_segment_ids is not None
        or args.q_seq_lengths is not None
        or args.kv_seq_lengths is not None
    ):
        return True
    return structure_empties_rows(args)


def rows_without_keys(args: AttentionArgs):
    """Bool ``[B, 1 | N, T]``: True where a query row has no key left (the kernels' output 0 / LSE
    ``-inf`` rows), from the masks alone (a ``-inf`` bias is not looked at). None if no row can be
    (decided statically where only causal / window shape the mask: :func:`structure_empties_rows`).

    Closed form (``O(B * T)``) for causal / window / lengths; the boolean mask and segment ids are
    reduced over the keys.
    """
    T, S = args.q_len, args.kv_len
    if not rows_can_lack_keys(args):
        return None
    if args.mask is not None or args.q_segment_ids is not None:
        m = full_mask(args)
        return ~jnp.any(jnp.broadcast_to(m, m.shape[:2] + (T, S)), axis=-1)
    i = jnp.arange(T, dtype=jnp.int32)
    lo, hi = key_range(i, i + 1, S, causal=args.causal, diag_offset=args.diag_offset, window=args.window)
    hi = jnp.broadcast_to(hi, (T,))[None]
    lo = jnp.broadcast_to(lo, (T,))[None]
    if args.kv_seq_lengths is not None:
        hi = jnp.minimum(hi, args.kv_seq_lengths[:, None])
    empty = lo >= hi
    if args.q_seq_lengths is not None:
        empty = empty | (i[None] >= args.q_seq_lengths[:, None])
    return jnp.broadcast_to(empty, (args.batch, T))[:, None]


@functools.partial(jax.jit, static_argnames="low_precision")
def reference(args: AttentionArgs, *, low_precision: bool = False):
    """The math implementation: plain jnp, float32 accumulation (unless ``low_precision``).

    One ``jax.jit`` (called eagerly, as tests and notebooks do, it compiles once per shape instead of
    op by op; under a trace it is a nested jit XLA inlines).

    Args:
      args: canonical arguments (see :func:`make_args`).
      low_precision: for fp16/bf16 inputs, compute logits, softmax and the PV product in the input
        dtype (torch's ``allow_fp16_bf16_reduction_math_sdp``). Ignored for float32/64.

    Returns:
      ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32)``, the natural-log LSE of the
      (scaled, soft-capped, biased, masked) logits; ``-inf`` for fully masked rows, whose output is 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.attention import base
      >>> x = jnp.zeros((1, 3, 1, 4))
      >>> out, lse = base.reference(base.make_args(x, x, x))
      >>> float(lse[0, 0, 0])  # log(3)
      1.0986...
    """
    q, k, v = args.q, args.k, args.v
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    if S == 0:  # no key: an empty sum (torch's and jax.nn's 0), LSE -inf
        return (jnp.zeros((B, T, N, v.shape[-1]), q.dtype), jnp.full((B, N, T), -jnp.inf, jnp.float32))
    low = low_precision and q.dtype in (jnp.bfloat16, jnp.float16)
    cdt = q.dtype if low else jnp.promote_types(q.dtype, jnp.float32)
    prec = jax.lax.Precision.HIGHEST
    qg = q.reshape(B, T, K, G, H).astype(cdt)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(cdt), precision=prec, preferred_element_type=cdt)
    logits = logits.reshape(B, N, T, S) * jnp.asarray(args.scale, cdt)
    logits = softcap(logits, args.logits_soft_cap)
    if args.bias is not None:
        logits = logits + args.bias.astype(cdt)
    m = full_mask(args)
    if m is not None:
        # A finite stand-in, not -inf, for masked logits (zeroed after the exp): no intermediate
        # holds an inf unless a row has no key at all, so jax.debug_infs stays quiet.
        logits = jnp.where(m, logits, jnp.finfo(cdt).min)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    p = jnp.exp(logits - row_max)
    if m is not None:
        p = jnp.where(m, p, 0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    lse = (jnp.log(denom.astype(jnp.float32)) + row_max.astype(jnp.float32))[..., 0]
    p = p / jnp.where(denom == 0, 1, denom)
    if args.has_dropout:
        keep = dropout_keep_from_words(
            dropout_words_of(args),
            jnp.arange(B, dtype=jnp.int32)[:, None, None, None],
            jnp.arange(N, dtype=jnp.int32)[None, :, None, None],
            jnp.arange(T, dtype=jnp.int32)[None, None, :, None],
            jnp.arange(S, dtype=jnp.int32)[None, None, None, :],
            dropout_threshold(args.dropout_rate),
        )
        p = jnp.where(keep, p * (1.0 / (1.0 - args.dropout_rate)), 0).astype(p.dtype)
    pg = p.reshape(B, K, G, T, S)
    out = jnp.einsum("bkgts,bskh->btkgh", pg, v.astype(cdt), precision=prec, preferred_element_type=cdt)
    out = out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)
    return out, lse


def reference_vjp(args: AttentionArgs, g_out, g_lse=None):
    """``(dq, dk, dv, dbias)`` of :func:`reference` at ``args`` for cotangents ``(g_out, g_lse)``.

    Plain jnp, so it is differentiable again: the fast backends' backward passes use it as their own
    derivative, which makes second-order reverse mode (grad of grad, Hessian-vector products by
    reverse over reverse) work on them. It materialises the ``[B, N, T, S]`` weights, like MATH.
    """

    def f(q, k, v, bias):
        out, lse = reference(args.replace(q=q, k=k, v=v, bias=bias))
        return out, lse

    (out, lse), vjp = jax.vjp(f, args.q, args.k, args.v, args.bias)
    g_lse = jnp.zeros_like(lse) if g_lse is None else g_lse.astype(lse.dtype)
    return vjp((g_out.astype(out.dtype), g_lse))


def differentiable_backward(fast_backward, args_of):
    """Wraps a backward pass so that it has a derivative (second-order reverse mode).

    ``fast_backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse) -> (dq, dk, dv, dbias)`` is a
    kernel's backward (FFI calls, loops with dynamic bounds: not differentiable itself);
    ``args_of(st, q, k, v, bias, aux) -> AttentionArgs`` rebuilds the call. The wrapper runs the fast
    backward and differentiates as :func:`reference_vjp` (the same function, in plain jnp): the
    derivative w.r.t. ``out`` and ``lse`` is zero because the reference recomputes them from q, k, v.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
        return fast_backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse)

    def op_fwd(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
        return op(st, q, k, v, bias, aux, out, lse, g_out, g_lse), (
            q,
            k,
            v,
            bias,
            aux,
            out,
            lse,
            g_out,
            g_lse,
        )

    def op_bwd(st, res, ct):
        q, k, v, bias, aux, out, lse, g_out, g_lse = res
        args = args_of(st, q, k, v, bias, aux)

        def grads(q, k, v, bias, g_out, g_lse):
            dq, dk, dv, db = reference_vjp(args.replace(q=q, k=k, v=v, bias=bias), g_out, g_lse)
            return dq, dk, dv, (db if bias is not None else None)

        _, vjp = jax.vjp(grads, q, k, v, bias, g_out, g_lse)
        ct = tuple(ct)
        if bias is None:
            ct = ct[:3] + (None,)
        cq, ck, cv, cb, cgo, cgl = vjp(ct)
        zero = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731
        return (cq, ck, cv, cb, jax.tree.map(lambda x: None, aux), zero(out), zero(lse), cgo, cgl)

    op.defvjp(op_fwd, op_bwd)
    return op


def unsupported(args: AttentionArgs, platform: str) -> list:
    """The math backend runs everything, everywhere."""
    del args, platform
    return []


def attention(args: AttentionArgs, *, config=None, low_precision: bool = False, **opts):
    """Math backend entry point (same signature as the other backends): :func:`reference`."""
    del config, opts
    return reference(args, low_precision=low_precision)
