"""Timing a kernel on an accelerator: one jitted loop of dependent calls, never a wall clock around one call.

A Python clock around a single call measures dispatch, launch latency and host synchronisation as much
as the kernel (tens of microseconds, the whole run time of a decode kernel). :func:`loop_time` compiles
one ``lax.fori_loop`` of calls (a static trip count) and divides its time by their number. Each
iteration passes the operands and the previous call's outputs through ``lax.optimization_barrier``
together, and the loop carries the outputs. The barrier makes every call depend on the one before it,
so XLA can neither hoist a call, nor any work on one of its operands, out of the loop, nor drop it, nor
drop work that only one of its outputs needs (a token of the first output alone let XLA drop the dK /
dV kernel of a ``jax.grad`` over q, k, v, where dQ comes from its own kernel), and the operands are
never modified. Nothing is added to the timed work, except a copy per call of an output that is one
of the operands returned as it is (the loop then carries that buffer twice). The autotuner
(`pallas_kernels.attention.autotune`) and the GPU benchmarks (``benchmarks/gpu_timing.py``) share it.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["loop_time", "timed_loop"]


def timed_loop(fn: Callable) -> Callable:
    """The jitted ``(operands, n) -> outputs of the last call`` loop :func:`loop_time` times: ``n``
    dependent calls of ``fn(*operands)`` (see the module docstring; exposed to check what XLA keeps
    inside the loop).

    ``n`` is static: a loop with a known trip count runs on the GPU without reading its condition back
    to the host between iterations, which a run-time bound would cost every call."""

    @functools.partial(jax.jit, static_argnums=1)
    def loop(operands, n):
        shapes = jax.eval_shape(fn, *operands)
        if not jax.tree.leaves(shapes):  # XLA would drop the whole loop: a time of ~0
            raise ValueError("loop_time: fn returns no arrays, so nothing it computes can be timed")
        outputs = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(_, state):
            carry, _previous = jax.lax.optimization_barrier(state)
            return carry, fn(*carry)

        return jax.lax.fori_loop(0, n, body, (operands, outputs))[1]

    return loop


def loop_time(
    fn: Callable, operands: Sequence[Any], *, iters: int = 20, repeats: int = 3, min_loop_s: float = 0.0
) -> float:
    """Seconds per call of ``fn(*operands)`` on the default device: the median over ``repeats`` timed runs
    of one jitted loop of dependent calls, after an untimed run (compilation, warm-up).

    Args:
      fn: traceable; its outputs are a pytree of arrays (every one feeds the dependence).
      operands: a sequence of pytrees (arrays, or records such as ``AttentionArgs`` / a packed weight).
      iters: calls per timed loop (>= 1).
      repeats: timed loops (>= 1); the median counts.
      min_loop_s: the shortest loop worth timing, in seconds (0: ``iters`` as given). A loop of a few
        microsecond-long calls is dominated by the fixed cost of launching it: when the warm-up loop is
        shorter, the count goes up to the next power of two that should last ``min_loop_s`` (a second
        compilation: give ``iters`` that suffice where compiling is slow).

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.timing import loop_time
      >>> loop_time(lambda a, b: a @ b, (jnp.ones((64, 64)), jnp.ones((64, 64))), iters=2, repeats=1) > 0
      True
    """
    if not (isinstance(iters, int) and isinstance(repeats, int)) or iters < 1 or repeats < 1:
        raise ValueError(f"loop_time: iters and repeats must be ints >= 1 (got {iters!r}, {repeats!r})")
    if not min_loop_s >= 0:
        raise ValueError(f"loop_time: min_loop_s must be >= 0 (got {min_loop_s!r})")
    operands = tuple(operands)
    loop = timed_loop(fn)

    def run(n):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(operands, n))
        return time.perf_counter() - t0

    n = iters
    run(n)  # compile and warm up
    if min_loop_s > 0:
        t = run(n)
        if t < min_loop_s:
            n = 1 << max(0, math.ceil(math.log2(n * min_loop_s / max(t, 1e-9))))
            n = min(n, 1 << 16)
            run(n)  # compile the longer loop and warm it up
    return float(np.median([run(n) / n for _ in range(repeats)]))
