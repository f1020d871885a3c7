"""Timing on an accelerator that a reader can trust: in-jit repetition for JAX, CUDA events for torch.

Python wall clock around one call measures dispatch and launch latency as much as the kernel. Here:

* :func:`jax_time` compiles one loop of *dependent* calls (each passes its operands and the previous
  call's outputs through ``lax.optimization_barrier``, so XLA can neither hoist a call or any work on
  its operands out of the loop nor drop it, nor any work one of its outputs needs) and divides the
  loop's time by the number of calls (a static count, raised to last 2 ms where the first loop is
  shorter); nothing is added to the timed work (`pallas_kernels.timing.loop_time`).
* :func:`torch_time` times ``iters`` back-to-back launches between two CUDA events.

Both take the median of ``repeats`` runs after a warm-up (compilation, autotuning, caches).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from pallas_kernels.timing import loop_time

__all__ = ["jax_time", "torch_cuda", "torch_time", "ratio", "pyplot", "write_table"]


def jax_time(
    fn: Callable, args: Sequence[Any], iters: int = 20, repeats: int = 3, min_loop_s: float = 0.002
) -> float:
    """Seconds per call of ``fn(*args)`` on the default device, from one jitted loop of dependent calls
    (:func:`pallas_kernels.timing.loop_time`, which the autotuner uses too).

    Args:
      fn: traceable; its outputs are a pytree of arrays (every one is kept in the loop).
      args: the inputs (device arrays or pytrees of them).
      iters: calls per timed loop (>= 1), raised (a recompilation) where one loop is shorter than
        ``min_loop_s``: give enough for the kernels timed.
      repeats: timed loops; the median is returned.
      min_loop_s: the shortest timed loop (2 ms: a loop of 10-microsecond decode calls would otherwise
        be mostly its own launch).
    """
    return loop_time(fn, args, iters=iters, repeats=repeats, min_loop_s=min_loop_s)


def torch_cuda() -> Optional[Any]:
    """The ``torch`` module when torch with CUDA is importable and sees a GPU, else None."""
    try:
        import torch  # noqa: PLC0415 - optional peer
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def torch_time(fn: Callable[[], Any], iters: int = 20, repeats: int = 3) -> float:
    """Seconds per call of ``fn()`` (torch, CUDA): ``iters`` launches between two CUDA events."""
    torch = torch_cuda()
    if torch is None:
        raise RuntimeError("torch_time needs torch with CUDA")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return float(np.median(times))


def ratio(a: float, b: float) -> str:
    """``a / b`` formatted as ``1.23x``, or ``-`` when either is missing."""
    ok = a == a and b == b and b > 0  # NaN-safe
    return f"{a / b:.2f}x" if ok else "-"


def pyplot() -> Optional[Any]:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        import sys  # noqa: PLC0415

        print("matplotlib not installed: no PNG written", file=sys.stderr)
        return None
    return plt


def write_table(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` whole (a temporary file renamed over it), so that a run killed while
    rewriting its table after a row leaves the previous table, never half of one."""
    import os  # noqa: PLC0415

    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text + "\n")
    os.replace(tmp, path)
