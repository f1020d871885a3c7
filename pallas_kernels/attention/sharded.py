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

from pallas_kernels import partition
from pallas_kernels.attention import base

__all__ = ["attention_vjp"]

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

  call = partition.sharded_vjp(
      fwd, bwd, in_factors=factors, out_factors=(("b", "t", _HEADS, "e"), ("b", _HEADS, "t")),
      parallel=("b", "k"), diff=diff, grad_partial_sums=partial,
      skippable=(3,) if has_bias and skips_dbias else (), name=name)
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
      dbias = jax.numpy.zeros(bias.shape, bias.dtype)
    return dq, dk, dv, dbias, jax.tree.map(lambda _: None, rest)

  f.defvjp(f_fwd, f_bwd)
  return f(args.q, args.k, args.v, args.bias, tuple(getattr(args, n) for n in rest_fields))
