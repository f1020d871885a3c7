"""Timing a kernel on an accelerator: one jitted loop of dependent calls, never a wall clock around one call.

A Python clock around a single call measures dispatch, launch latency and host synchronisation as much
as the kernel (tens of microseconds, the whole run time of a decode kernel). :func:`loop_time` compiles
one ``lax.fori_loop`` of ``iters`` calls in which each call's inputs depend on the previous output (the
first floating input is moved by ``eps * sum(first output)``, with ``eps`` a run-time zero, so XLA can
neither fold the nudge away nor hoist the call out of the loop), times the whole loop and divides. The
nudge costs one pass over the first output, small next to the kernels it is meant for. The autotuner
(`pallas_kernels.attention.autotune`) and the GPU benchmarks (``benchmarks/gpu_timing.py``) share it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["loop_time"]


def _first_floating(leaves) -> int:
    for i, leaf in enumerate(leaves):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return i
    raise ValueError("loop_time: the operands hold no floating array to carry the dependence between calls")


def loop_time(fn: Callable, operands: Sequence[Any], *, iters: int = 20, repeats: int = 3) -> float:
    """Seconds per call of ``fn(*operands)`` on the default device: the median over ``repeats`` timed runs
    of one jitted loop of ``iters`` dependent calls, after one untimed run (compilation, warm-up).

    Args:
      fn: traceable; its first output leaf must be an array (it feeds the dependence).
      operands: a sequence of pytrees (arrays, or records such as ``AttentionArgs`` / a packed weight);
        the first floating leaf among them carries the dependence.
      iters: calls per timed loop (>= 1).
      repeats: timed loops (>= 1); the median counts.

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.timing import loop_time
      >>> loop_time(lambda a, b: a @ b, (jnp.ones((64, 64)), jnp.ones((64, 64))), iters=2, repeats=1) > 0
      True
    """
    if not (isinstance(iters, int) and isinstance(repeats, int)) or iters < 1 or repeats < 1:
        raise ValueError(f"loop_time: iters and repeats must be ints >= 1 (got {iters!r}, {repeats!r})")
    operands = tuple(operands)
    idx = _first_floating(jax.tree.leaves(operands))

    @jax.jit
    def loop(operands, eps):
        def body(_, carry):
            out = jax.tree.leaves(fn(*carry))[0]
            ls, t = jax.tree.flatten(carry)
            delta = eps * jnp.sum(out.astype(jnp.float32))
            ls[idx] = ls[idx] + delta.astype(ls[idx].dtype)
            return jax.tree.unflatten(t, ls)

        return jax.lax.fori_loop(0, iters, body, operands)

    eps = jnp.zeros((), jnp.float32)
    jax.block_until_ready(loop(operands, eps))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(operands, eps))
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times))
