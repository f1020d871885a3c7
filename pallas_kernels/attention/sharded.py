"""Attention kernels that keep batch- and kv-head-sharded inputs sharded (see ``docs/sharding.md``).

:func:`attention_vjp` turns a kernel's ``forward(args) -> (out, lse)`` and
``backward(args, out, lse, d_out, d_lse) -> (dq, dk, dv, dbias)`` into one differentiable call that
:mod:`pallas_kernels.partition` splits along the batch and the kv heads: every operand of the call
(q, k, v, bias, mask, lengths, segment ids) gets its factors here, once, for every kernel.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, sharded
  >>> q = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
  >>> args = base.make_args(q, q[:, :, :2], q[:, :, :2], is_causal=True)
  >>> def bwd(a, out, lse, d_out, d_lse):
  ...   return jax.vjp(lambda q, k, v: base.reference(a.replace(q=q, k=k, v=v)), a.q, a.k, a.v)[1](
  ...       (d_out, d_lse)) + (None,)
  >>> out, lse = sharded.attention_vjp(args, base.reference, bwd, name="reference")
  >>> bool(jnp.allclose(out, base.reference(args)[0]))
  True
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import partition
from pallas_kernels.attention import base

__all__ = ["attention_vjp", "ring_supported", "plan"]

_HEADS = ("k", "g")  # query head n = kv_head * G + g
_OPTIONAL = {  # AttentionArgs field -> the factors of a full (unbroadcast) operand
    "bias": ("b", _HEADS, "t", "s"),
    "mask": ("b", _HEADS, "t", "s"),
    "q_seq_lengths": ("b",),
    "kv_seq_lengths": ("b",),
    "q_segment_ids": ("b", "t"),
    "kv_segment_ids": ("b", "s"),
}


def _factors(x, want, full, tag):
    """``want``, with a factor of its own for each broadcast (size 1 < full) or unexpected dimension."""
    if x.ndim != len(want):
        return tuple(f"{tag}{d}" for d in range(x.ndim))
    out = []
    for d, (f, size) in enumerate(zip(want, x.shape)):
        key = f if isinstance(f, str) else "n"
        out.append(f if size == full[key] else f"{tag}{d}")
    return tuple(out)


def attention_vjp(
    args: base.AttentionArgs, forward: Callable, backward: Callable, *, name: str, skips_dbias: bool = False
):
    """``forward(args)`` as a differentiable call split along the batch and the kv heads.

    Args:
      args: the call's arguments.
      forward: ``forward(args) -> (out [B, T, N, Hv], lse [B, N, T])``; reads every size from the
        arrays of the ``args`` it is given (it runs once per shard, on local blocks).
      backward: ``backward(args, out, lse, d_out, d_lse) -> (dq, dk, dv, dbias)``, dbias None
        without a bias; same rule.
      name: the kernel's name, for error messages.
      skips_dbias: ``backward`` takes a keyword ``need_dbias`` and skips the bias gradient when the
        bias is not differentiated (a bias used as a mask).

    Returns:
      ``(out, lse)``, differentiable w.r.t. q, k, v and bias. With dropout every shard's arguments
      carry ``dropout_offsets`` (its first global batch row and head), so the keep-mask hashes global
      indices and the split call drops what the unsplit one does.
    """
    B, T, N = args.q.shape[:3]
    full = {"b": B, "t": T, "s": args.k.shape[1], "n": N}
    present = [f for f in _OPTIONAL if getattr(args, f) is not None]
    operands = [args.q, args.k, args.v] + [getattr(args, f) for f in present]
    factors = [("b", "t", _HEADS, "h"), ("b", "s", "k", "h"), ("b", "s", "k", "e")]
    factors += [_factors(getattr(args, f), _OPTIONAL[f], full, f + "_") for f in present]
    if args.has_dropout:
        # The seed (replicated) and the batch / head indices, split like q's: a shard's first entries
        # are its global offsets. A seed mixed with a caller's shard_map position is mixed here, once.
        seed = base.dropout_words_of(args)
        operands += [seed, jnp.arange(B, dtype=jnp.uint32), jnp.arange(N, dtype=jnp.uint32)]
        factors += [("dropout_words",), ("b",), (_HEADS,)]
    has_bias = args.bias is not None
    diff = (0, 1, 2, 3) if has_bias else (0, 1, 2)
    partial = {}
    if has_bias:  # the gradient of a bias broadcast over the batch / heads sums over their shards
        bf = factors[3]
        partial[3] = tuple(p for p, d in (("b", 0), ("k", 1)) if bf[d] != _OPTIONAL["bias"][d])

    def rebuild(xs):
        q, k, v, *rest = xs
        changes = dict(zip(present, rest))
        if args.has_dropout:
            words, b_index, n_index = rest[len(present) :]
            offsets = jnp.stack([b_index[0] + words[2], n_index[0] + words[3]])
            changes.update(dropout_rng=words[:2], dropout_offsets=offsets)
        return args.replace(q=q, k=k, v=v, **changes)

    def fwd(*xs):
        return tuple(forward(rebuild(xs)))

    def bwd(*xs, skip=()):
        *ins, out, lse, d_out, d_lse = xs
        kw = dict(need_dbias=3 not in skip) if skips_dbias else {}
        dq, dk, dv, dbias = backward(rebuild(ins), out, lse, d_out, d_lse, **kw)
        return (dq, dk, dv, dbias) if has_bias else (dq, dk, dv)

    def bwd_math(*xs, skip=()):
        """The backward in the math formulation (differentiable): second order differentiates this."""
        *ins, _, _, d_out, d_lse = xs  # out and lse are recomputed, as functions of q, k, v (and bias)
        dq, dk, dv, dbias = base.reference_vjp(rebuild(ins), d_out, d_lse)
        return (dq, dk, dv, dbias) if has_bias else (dq, dk, dv)

    ring = None
    if ring_supported(args):
        ring = (("t", "s"), _fwd_ring(args, forward), _bwd_ring(args, backward))
    call = partition.sharded_vjp(
        fwd,
        bwd,
        in_factors=factors,
        out_factors=(("b", "t", _HEADS, "e"), ("b", _HEADS, "t")),
        parallel=("b", "k"),
        diff=diff,
        grad_partial_sums=partial,
        skippable=(3,) if has_bias and skips_dbias else (),
        ring=ring,
        bwd_derivative=bwd_math,
        name=name,
    )
    return call(*operands)


# ---- sequence parallelism: a ring over the devices that split the sequence ------------------------
#
# q, k, v arrive split along the sequence in n equal chunks of c rows, chunk i on device i of the
# ring. Step r (a lax.scan over 0 <= r < n) gives device i the k / v held by device j = (i - r) mod n,
# passed on by one ppermute per step. The forward combines the per-step (out, lse) by their
# log-sum-exp; the backward, given the global out and lse, sums dq on the spot and carries dk / dv
# with their keys round the ring: after n steps every device holds its own keys' gradients.
#
# Causal calls are load balanced (the "zigzag" layout): the sequence is cut in 2n half-chunks and
# device i works on half-chunks i and 2n-1-i (two ppermutes in, two out), so every device has the same
# amount of unmasked work at every step. For query half a and key half b the pair is fully visible
# (b < a: the kernel without the mask), diagonal (b == a: the causal kernel) or fully masked (b > a:
# skipped), picked by lax.switch, so the kernel is compiled three times, not n.


def ring_supported(args: base.AttentionArgs) -> bool:
    """Whether a sequence-split call can run as a ring (else it is gathered along the sequence)."""
    optional = any(getattr(args, f) is not None for f in _OPTIONAL)
    return (
        not optional
        and not args.has_dropout
        and args.window is None
        and args.q_len == args.kv_len
        and (not args.causal or args.diag_offset == 0)
    )


def _pair(args, a, b, run, zeros):
    """``run`` for query block a against key block b of a causal call: full, diagonal or skipped."""
    full = args.replace(causal=False)
    case = jnp.where(b < a, 1, jnp.where(b == a, 2, 0))
    return jax.lax.switch(case, [lambda: zeros, lambda: run(full), lambda: run(args)])


def _owner(s, n):
    """The device that holds half-chunk s in the zigzag layout."""
    return s if s < n else 2 * n - 1 - s


def _to_zigzag(x, axis, axes, n):
    """Device d's chunk (half-chunks 2d, 2d+1 along ``axis``) -> half-chunks (d, 2n-1-d)."""
    h0, h1 = jnp.split(x, 2, axis=axis)
    even = jax.lax.ppermute(h0, axes, [(d, _owner(2 * d, n)) for d in range(n)])
    odd = jax.lax.ppermute(h1, axes, [(d, _owner(2 * d + 1, n)) for d in range(n)])
    first = jax.lax.axis_index(axes) % 2 == 0
    return jnp.concatenate([jnp.where(first, even, odd), jnp.where(first, odd, even)], axis=axis)


def _from_zigzag(x, axis, axes, n):
    """The inverse of :func:`_to_zigzag`."""
    p0, p1 = jnp.split(x, 2, axis=axis)
    first = jax.lax.axis_index(axes) % 2 == 0
    h0 = jax.lax.ppermute(jnp.where(first, p0, p1), axes, [(_owner(2 * d, n), d) for d in range(n)])
    h1 = jax.lax.ppermute(jnp.where(first, p1, p0), axes, [(_owner(2 * d + 1, n), d) for d in range(n)])
    return jnp.concatenate([h0, h1], axis=axis)


def _merge(acc, new):
    """Two partial attention results over disjoint keys, combined by their log-sum-exp."""
    (out, lse), (o, l) = acc, new
    m = jnp.maximum(lse, l)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_old, w_new = jnp.exp(lse - m), jnp.exp(l - m)
    tot = w_old + w_new
    safe = jnp.where(tot > 0, tot, 1.0)
    w = lambda x: jnp.swapaxes(x / safe, 1, 2)[..., None]  # noqa: E731 - [B,N,T] -> [B,T,N,1]
    return (
        out * w(w_old) + o.astype(jnp.float32) * w(w_new),
        jnp.where(tot > 0, m + jnp.log(safe), -jnp.inf),
    )


def _fits(args, n):
    """The zigzag layout cuts each device's chunk in two: causal calls need an even chunk."""
    return not args.causal or (args.q_len // n) % 2 == 0


def _fwd_ring(args, forward):
    def make(axes, n):
        if not _fits(args, n):
            return None
        perm = [(j, (j + 1) % n) for j in range(n)]

        def run(q, k, v):
            i = jax.lax.axis_index(axes)
            if args.causal:
                q, k, v = (_to_zigzag(x, 1, axes, n) for x in (q, k, v))
            B, T, N, _ = q.shape
            h = T // 2

            def empty(t):
                return (
                    jnp.zeros((B, t, N, v.shape[3]), jnp.float32),
                    jnp.full((B, N, t), -jnp.inf, jnp.float32),
                )

            def call(a):
                return tuple(forward(a))

            def step(carry, r):
                acc, k, v = carry
                j = (i - r) % n
                if args.causal:  # query halves (i, 2n-1-i) against key halves (j, 2n-1-j)
                    qa, qb = q[:, :h], q[:, h:]
                    ka, kb, va, vb = k[:, :h], k[:, h:], v[:, :h], v[:, h:]
                    acc_a, acc_b = acc
                    acc_a = _merge(acc_a, _pair(args.replace(q=qa, k=ka, v=va), i, j, call, empty(h)))
                    acc_b = _merge(acc_b, call(args.replace(q=qb, k=ka, v=va, causal=False)))
                    acc_b = _merge(
                        acc_b,
                        _pair(args.replace(q=qb, k=kb, v=vb), 2 * n - 1 - i, 2 * n - 1 - j, call, empty(h)),
                    )
                    acc = (acc_a, acc_b)
                else:
                    acc = _merge(acc, call(args.replace(q=q, k=k, v=v)))
                k, v = jax.lax.ppermute((k, v), axes, perm)
                return (acc, k, v), None

            init = (empty(h), empty(h)) if args.causal else empty(T)
            (acc, _, _), _ = jax.lax.scan(step, (init, k, v), jnp.arange(n))
            if args.causal:
                (oa, la), (ob, lb) = acc
                out, lse = jnp.concatenate([oa, ob], axis=1), jnp.concatenate([la, lb], axis=2)
                out, lse = _from_zigzag(out, 1, axes, n), _from_zigzag(lse, 2, axes, n)
            else:
                out, lse = acc
            return out.astype(q.dtype), lse

        return run

    return make


def _bwd_ring(args, backward):
    def make(axes, n):
        if not _fits(args, n):
            return None
        perm = [(j, (j + 1) % n) for j in range(n)]

        def run(q, k, v, out, lse, d_out, d_lse):
            i = jax.lax.axis_index(axes)
            dtypes = (q.dtype, k.dtype, v.dtype)
            if args.causal:
                q, k, v, out, d_out = (_to_zigzag(x, 1, axes, n) for x in (q, k, v, out, d_out))
                lse, d_lse = (_to_zigzag(x, 2, axes, n) for x in (lse, d_lse))
            h = q.shape[1] // 2
            f32 = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731

            def grads(a):
                return tuple(g.astype(jnp.float32) for g in backward(a, out, lse, d_out, d_lse)[:3])

            def step(carry, r):
                dq, k, v, dk, dv = carry
                j = (i - r) % n
                if args.causal:
                    top, bot = (slice(None), slice(None, h)), (slice(None), slice(h, None))
                    top_l, bot_l = (
                        (slice(None), slice(None), slice(None, h)),
                        (slice(None), slice(None), slice(h, None)),
                    )
                    qa, qb = q[top], q[bot]
                    ka, kb, va, vb = k[top], k[bot], v[top], v[bot]

                    def rows(sl, sl_l):
                        return lambda a: tuple(
                            g.astype(jnp.float32)
                            for g in backward(a, out[sl], lse[sl_l], d_out[sl], d_lse[sl_l])[:3]
                        )

                    zeros = (f32(qa), f32(ka), f32(va))
                    g_aa = _pair(args.replace(q=qa, k=ka, v=va), i, j, rows(top, top_l), zeros)
                    g_ba = rows(bot, bot_l)(args.replace(q=qb, k=ka, v=va, causal=False))
                    g_bb = _pair(
                        args.replace(q=qb, k=kb, v=vb), 2 * n - 1 - i, 2 * n - 1 - j, rows(bot, bot_l), zeros
                    )
                    dq = dq + jnp.concatenate([g_aa[0], g_ba[0] + g_bb[0]], axis=1)
                    dk = dk + jnp.concatenate([g_aa[1] + g_ba[1], g_bb[1]], axis=1)
                    dv = dv + jnp.concatenate([g_aa[2] + g_ba[2], g_bb[2]], axis=1)
                else:
                    g = grads(args.replace(q=q, k=k, v=v))
                    dq, dk, dv = dq + g[0], dk + g[1], dv + g[2]
                k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), axes, perm)
                return (dq, k, v, dk, dv), None

            (dq, _, _, dk, dv), _ = jax.lax.scan(step, (f32(q), k, v, f32(k), f32(v)), jnp.arange(n))
            if args.causal:
                dq, dk, dv = (_from_zigzag(x, 1, axes, n) for x in (dq, dk, dv))
            return tuple(x.astype(t) for x, t in zip((dq, dk, dv), dtypes))

        return run

    return make


def plan(args: base.AttentionArgs, q_spec, k_spec, mesh_shape) -> str:
    """How a call whose q / k arrive with PartitionSpecs ``q_spec`` / ``k_spec`` (BTNH order) over a
    mesh of ``mesh_shape`` (axis name -> size) runs: what stays split, and whether a ring runs.

    Example:
      >>> import jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from pallas_kernels.attention import base, sharded
      >>> q = jnp.zeros((2, 64, 4, 16))
      >>> sharded.plan(base.make_args(q, q, q, is_causal=True), P("b", "s"), P("b", "s"),
      ...              {"b": 2, "s": 4})
      'batch split over b (no collective); sequence split over s: a ring of 4 steps (causal: load-balanced zigzag)'
    """

    def axes(spec, dim):
        entry = tuple(spec)[dim] if len(tuple(spec)) > dim else None
        return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))

    def size(ax):
        out = 1
        for a in ax:
            out *= mesh_shape[a]
        return out

    parts = []
    b = axes(q_spec, 0)
    if b:
        parts.append(
            f"batch split over {'+'.join(b)} (no collective)"
            if args.batch % size(b) == 0
            else f"batch split over {'+'.join(b)} does not divide {args.batch}: gathered"
        )
    h = axes(k_spec, 2) or axes(q_spec, 2)
    if h:
        parts.append(
            f"kv heads split over {'+'.join(h)} (no collective)"
            if args.num_kv_heads % size(h) == 0
            else f"heads split over {'+'.join(h)} do not keep whole kv-head groups "
            f"({args.num_kv_heads} kv heads): gathered"
        )
    t = axes(q_spec, 1)
    if t:
        n = size(t)
        if not ring_supported(args) or args.q_len % n or not _fits(args, n):
            parts.append(
                f"sequence split over {'+'.join(t)}: gathered along the sequence (the ring needs "
                "T == S, no bias / mask / lengths / segment ids / window / dropout / off-diagonal "
                "causal offset, and equal, for causal even, chunks)"
            )
        else:
            parts.append(
                f"sequence split over {'+'.join(t)}: a ring of {n} steps"
                + (" (causal: load-balanced zigzag)" if args.causal else "")
            )
    return "; ".join(parts) if parts else "not split"
