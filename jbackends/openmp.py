"""`torch.backends.openmp`, for JAX: `is_available()` is False, truthfully.

XLA's CPU runtime does not use OpenMP: it parallelises with its own thread pool (Eigen / tsl), sized from
the CPUs this process may run on (its affinity mask). To control CPU threads, pin the process
(`python -m jbackends.xeon.run_cpu --ncores-per-instance N ...`, or `taskset`) and, for single-core
instances, `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`. `OMP_NUM_THREADS` has no effect on XLA.

Example:
  >>> import jbackends as jb
  >>> jb.openmp.is_available()
  False
"""

__all__ = ["is_available"]


def is_available() -> bool:
    """False: XLA:CPU has no OpenMP runtime (see the module docstring for what controls its threads).

    Example:
      >>> import jbackends as jb
      >>> jb.openmp.is_available()
      False
    """
    return False
