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

__all__ = ["attention_vjp", "ring_supported"]

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


def attention_vjp(args: base.AttentionArgs, forward: Callable, backward: Callable, *,
                  name: str, skips_dbias: bool = False):
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
    ``(out, lse)``, differentiable w.r.t. q, k, v and bias. With dropout nothing is split (the
    keep-mask hashes global batch and head indices): the call runs on the gathered inputs.
  """
  if args.has_dropout:
    return _unsplit_vjp(args, forward, backward, skips_dbias)
  B, T, N = args.q.shape[:3]
  full = {"b": B, "t": T, "s": args.k.shape[1], "n": N}
  present = [f for f in _OPTIONAL if getattr(args, f) is not None]
  operands = [args.q, args.k, args.v] + [getattr(args, f) for f in present]
  factors = [("b", "t", _HEADS, "h"), ("b", "s", "k", "h"), ("b", "s", "k", "e")]
  factors += [_factors(getattr(args, f), _OPTIONAL[f], full, f + "_") for f in present]
  has_bias = args.bias is not None
  diff = (0, 1, 2, 3) if has_bias else (0, 1, 2)
  partial = {}
  if has_bias:  # the gradient of a bias broadcast over the batch / heads sums over their shards
    bf = factors[3]
    partial[3] = tuple(p for p, d in (("b", 0), ("k", 1)) if bf[d] != _OPTIONAL["bias"][d])

  def rebuild(xs):
    q, k, v, *rest = xs
    return args.replace(q=q, k=k, v=v, **dict(zip(present, rest)))

  def fwd(*xs):
    return tuple(forward(rebuild(xs)))

  def bwd(*xs, skip=()):
    *ins, out, lse, d_out, d_lse = xs
    kw = dict(need_dbias=3 not in skip) if skips_dbias else {}
    dq, dk, dv, dbias = backward(rebuild(ins), out, lse, d_out, d_lse, **kw)
    return (dq, dk, dv, dbias) if has_bias else (dq, dk, dv)

  ring = None
  if ring_supported(args):
    ring = (("t", "s"), _fwd_ring(args, forward), _bwd_ring(args, backward))
  call = partition.sharded_vjp(
      fwd, bwd, in_factors=factors, out_factors=(("b", "t", _HEADS, "e"), ("b", _HEADS, "t")),
      parallel=("b", "k"), diff=diff, grad_partial_sums=partial,
      skippable=(3,) if has_bias and skips_dbias else (), ring=ring, name=name)
  return call(*operands)


def _unsplit_vjp(args, forward, backward, skips_dbias):
  """The same differentiable call with nothing split (dropout)."""
  rest_fields = [f for f in (*_OPTIONAL, "dropout_rng") if f != "bias" and getattr(args, f) is not None]

  def rebuild(q, k, v, bias, rest):
    return args.replace(q=q, k=k, v=v, bias=bias, **dict(zip(rest_fields, rest)))

  @jax.custom_vjp
  def f(q, k, v, bias, rest):
    return tuple(forward(rebuild(q, k, v, bias, rest)))

  def f_fwd(q, k, v, bias, rest):
    outs = f(q, k, v, bias, rest)
    return outs, (q, k, v, bias, rest, outs)

  def f_bwd(res, cts):
    q, k, v, bias, rest, (out, lse) = res
    kw = dict(need_dbias=bias is not None) if skips_dbias else {}
    dq, dk, dv, dbias = backward(rebuild(q, k, v, bias, rest), out, lse, *cts, **kw)
    if bias is not None and dbias is None:
      dbias = jnp.zeros(bias.shape, bias.dtype)
    return dq, dk, dv, dbias, jax.tree.map(lambda _: None, rest)

  f.defvjp(f_fwd, f_bwd)
  return f(args.q, args.k, args.v, args.bias, tuple(getattr(args, n) for n in rest_fields))


# ---- sequence parallelism: a ring over the devices that split the sequence ------------------------
#
# q, k, v arrive split along the sequence in n equal chunks of c rows, chunk i on device i of the
# ring. Step r (a lax.scan over 0 <= r < n) gives device i the k / v chunk j = (i - r) mod n, passed
# on by one ppermute per step. With a causal mask (diagonal offset 0) the pair (i, j) is fully
# visible for j < i (a call without the mask), the diagonal for j == i (the causal call) and fully
# masked for j > i (skipped): lax.switch picks one, so the kernel is compiled three times, not n.
# The forward combines the per-step (out, lse) by their log-sum-exp; the backward, given the global
# out and lse, sums dq on the spot and carries dk / dv with their chunk round the ring: after n
# steps every chunk's gradients are back on its owner.

def ring_supported(args: base.AttentionArgs) -> bool:
  """Whether a sequence-split call can run as a ring (else it is gathered along the sequence)."""
  optional = any(getattr(args, f) is not None for f in _OPTIONAL)
  return (not optional and not args.has_dropout and args.window is None
          and args.q_len == args.kv_len and (not args.causal or args.diag_offset == 0))


def _pair(args, i, j, run, zeros):
  """``run`` for the (q chunk i, kv chunk j) pair: full, diagonal, or skipped (causal)."""
  if not args.causal:
    return run(args)
  full = args.replace(causal=False)
  case = jnp.where(j < i, 1, jnp.where(j == i, 2, 0))
  return jax.lax.switch(case, [lambda: zeros, lambda: run(full), lambda: run(args)])


def _fwd_ring(args, forward):
  def make(axes, n):
    perm = [(j, (j + 1) % n) for j in range(n)]

    def run(q, k, v):
      i = jax.lax.axis_index(axes)
      B, T, N, _ = q.shape
      empty = (jnp.zeros((B, T, N, v.shape[3]), q.dtype), jnp.full((B, N, T), -jnp.inf, jnp.float32))

      def step(carry, r):
        out, lse, k, v = carry
        o, l = _pair(args.replace(q=q, k=k, v=v), i, (i - r) % n, lambda a: tuple(forward(a)), empty)
        m = jnp.maximum(lse, l)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w_old, w_new = jnp.exp(lse - m), jnp.exp(l - m)
        tot = w_old + w_new
        safe = jnp.where(tot > 0, tot, 1.0)
        lse = jnp.where(tot > 0, m + jnp.log(safe), -jnp.inf)
        w = lambda x: jnp.swapaxes(x / safe, 1, 2)[..., None]  # noqa: E731 - [B,N,T] -> [B,T,N,1]
        out = out * w(w_old) + o.astype(jnp.float32) * w(w_new)
        k, v = jax.lax.ppermute((k, v), axes, perm)
        return (out, lse, k, v), None

      init = (jnp.zeros(empty[0].shape, jnp.float32), empty[1], k, v)
      (out, lse, _, _), _ = jax.lax.scan(step, init, jnp.arange(n))
      return out.astype(q.dtype), lse
    return run
  return make


def _bwd_ring(args, backward):
  def make(axes, n):
    perm = [(j, (j + 1) % n) for j in range(n)]

    def run(q, k, v, out, lse, d_out, d_lse):
      i = jax.lax.axis_index(axes)
      f32 = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
      empty = (f32(q), f32(k), f32(v))

      def grads(a):
        return tuple(x.astype(jnp.float32) for x in backward(a, out, lse, d_out, d_lse)[:3])

      def step(carry, r):
        dq, k, v, dk, dv = carry
        g = _pair(args.replace(q=q, k=k, v=v), i, (i - r) % n, grads, empty)
        k, v, dk, dv = jax.lax.ppermute((k, v, dk + g[1], dv + g[2]), axes, perm)
        return (dq + g[0], k, v, dk, dv), None

      (dq, _, _, dk, dv), _ = jax.lax.scan(step, (f32(q), k, v, f32(k), f32(v)), jnp.arange(n))
      return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    return run
  return make
