"""Run a Python script (or program) as N instances pinned to disjoint CPU core sets: torch's `run_cpu`, for JAX.

    python -m jbackends.xeon.run_cpu --ninstances 2 --ncores-per-instance 1 my_script.py --my-arg

Each instance is a separate process pinned to its own cores (Linux: a two-line Python wrapper calls
`os.sched_setaffinity` and then `exec`s the program; elsewhere `taskset` when present), taken in order from the CPUs this launcher may use (physical cores only unless
`--use-logical-core`). XLA:CPU sizes its thread pool from the CPUs a process may run on, so pinning is
what bounds its intra-op threads (there is no XLA flag for the count; `intra_op_parallelism_threads` is a
TensorFlow option). With one core per instance `--xla_cpu_multi_thread_eigen=false` is added to
`XLA_FLAGS` (`--multi-thread-eigen` overrides). Every instance also gets:

    JBACKENDS_INSTANCE_INDEX, JBACKENDS_NUM_INSTANCES  its index and the instance count
    JBACKENDS_CORES                                   its cores, comma separated
    OMP_NUM_THREADS, MKL_NUM_THREADS                   its core count (for numpy/BLAS in the script;
                                                      XLA ignores them)

The launcher waits for every instance and exits with the first non-zero exit status (0 if all succeed).
Example (this is also the test):

    python -m jbackends.xeon.run_cpu --ninstances 2 --ncores-per-instance 1 --log-path logs tiny.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["Instance", "available_cores", "create_args", "main", "plan", "physical_cores"]


@dataclasses.dataclass(frozen=True)
class Instance:
    """One planned instance: its index and the cores it is pinned to."""

    index: int
    cores: tuple[int, ...]


def available_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def physical_cores(cpus: Sequence[int], sysfs: str = "/sys/devices/system/cpu") -> list[int]:
    """`cpus` without hyper-thread siblings (keeps the lowest CPU of each core); `cpus` if unknown."""
    keep, seen = [], set()
    for cpu in cpus:
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list", encoding="ascii") as f:
                siblings = _parse_cpu_list(f.read())
        except OSError:
            return list(cpus)
        key = min(siblings) if siblings else cpu
        if key not in seen:
            seen.add(key)
            keep.append(cpu)
    return keep


def _parse_cpu_list(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def plan(cores: Sequence[int], ninstances: int | None, ncores_per_instance: int | None) -> list[Instance]:
    """Split `cores` into disjoint, consecutive sets, one per instance.

    Omitted values are derived: `ninstances` from the core count and `ncores_per_instance` (1 instance
    when both are omitted), `ncores_per_instance` as an even share of the cores.

    Raises:
      ValueError: non-positive values, or more cores requested than available.
    """
    total = len(cores)
    if total == 0:
        raise ValueError("no CPU cores available to this process")
    for name, v in (("ninstances", ninstances), ("ncores_per_instance", ncores_per_instance)):
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if ninstances is None and ncores_per_instance is None:
        ninstances = 1
    if ninstances is None:
        ninstances = max(1, total // ncores_per_instance)
    if ncores_per_instance is None:
        ncores_per_instance = total // ninstances
        if ncores_per_instance < 1:
            raise ValueError(
                f"--ninstances {ninstances} needs at least {ninstances} cores, "
                f"only {total} available ({list(cores)})"
            )
    if ninstances * ncores_per_instance > total:
        raise ValueError(
            f"--ninstances {ninstances} x --ncores-per-instance {ncores_per_instance} needs "
            f"{ninstances * ncores_per_instance} cores, only {total} available ({list(cores)})"
        )
    return [
        Instance(i, tuple(cores[i * ncores_per_instance : (i + 1) * ncores_per_instance]))
        for i in range(ninstances)
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jbackends.xeon.run_cpu",
        description="Launch a script as N instances pinned to disjoint CPU core sets, with XLA:CPU thread "
        "settings per instance (torch.backends.xeon.run_cpu, for JAX).",
        epilog="Example: python -m jbackends.xeon.run_cpu --ninstances 2 --ncores-per-instance 1 bench.py "
        "--steps 10. XLA:CPU's thread pool follows each instance's pinned cores; with one core per "
        "instance --xla_cpu_multi_thread_eigen=false is added to XLA_FLAGS.",
    )
    return create_args(p)


def create_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the launcher's arguments to `parser` (torch's `run_cpu.create_args`) and return it.

    Example:
      >>> import argparse
      >>> from jbackends.xeon import run_cpu
      >>> run_cpu.create_args(argparse.ArgumentParser()).parse_args(["--ninstances", "2", "x.py"]).ninstances
      2
    """
    p = parser
    p.add_argument(
        "--ninstances",
        type=int,
        default=None,
        help="number of instances (default: all cores / --ncores-per-instance, or 1)",
    )
    p.add_argument(
        "--ncores-per-instance",
        type=int,
        default=None,
        help="cores pinned to each instance (default: an even share of the available cores)",
    )
    p.add_argument(
        "--rank", type=int, default=-1, help="launch only the instance with this index (default -1: all)"
    )
    p.add_argument(
        "--use-logical-core",
        action="store_true",
        help="use hyper-thread siblings too (default: one CPU per physical core)",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin instances to cores (still sets env)")
    p.add_argument(
        "--multi-thread-eigen",
        choices=("auto", "true", "false"),
        default="auto",
        help="XLA_FLAGS --xla_cpu_multi_thread_eigen for each instance (auto: false for 1 core)",
    )
    p.add_argument(
        "--log-path", default="", help="write each instance's stdout+stderr to a file in this directory"
    )
    p.add_argument("--log-file-prefix", default="run", help="log file name prefix (default: run)")
    p.add_argument("-m", "--module", action="store_true", help="run the program as a module (python -m)")
    p.add_argument(
        "--no-python", action="store_true", help="the program is an executable, not a Python script"
    )
    p.add_argument("program", help="the script (or module with -m, executable with --no-python) to run")
    p.add_argument("program_args", nargs=argparse.REMAINDER, help="arguments passed to the program")
    return p


def _env_for(inst: Instance, ninstances: int, eigen: str) -> dict[str, str]:
    env = dict(os.environ)
    n = len(inst.cores)
    multi = {"auto": "false" if n == 1 else "true", "true": "true", "false": "false"}[eigen]
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_multi_thread_eigen")]
    flags.append(f"--xla_cpu_multi_thread_eigen={multi}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JBACKENDS_INSTANCE_INDEX"] = str(inst.index)
    env["JBACKENDS_NUM_INSTANCES"] = str(ninstances)
    env["JBACKENDS_CORES"] = ",".join(map(str, inst.cores))
    env["OMP_NUM_THREADS"] = str(n)
    env["MKL_NUM_THREADS"] = str(n)
    return env


# Pins itself, then replaces itself with the program: no `preexec_fn` (unsafe in a threaded parent).
_PIN_AND_EXEC = (
    "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def _command(args: argparse.Namespace, inst: Instance, pin: str) -> list[str]:
    if args.no_python:
        cmd = [args.program]
    elif args.module:
        cmd = [sys.executable, "-u", "-m", args.program]
    else:
        cmd = [sys.executable, "-u", args.program]
    cmd += list(args.program_args)
    if pin == "taskset":
        cmd = ["taskset", "-c", ",".join(map(str, inst.cores))] + cmd
    elif pin == "affinity":
        cmd = [sys.executable, "-c", _PIN_AND_EXEC, ",".join(map(str, inst.cores))] + cmd
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv`, launch the instances, wait, and return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    cores = available_cores()
    if not args.use_logical_core:
        cores = physical_cores(cores)
    try:
        instances = plan(cores, args.ninstances, args.ncores_per_instance)
    except ValueError as e:
        parser.error(str(e))
    if args.rank >= 0:
        if args.rank >= len(instances):
            parser.error(f"--rank {args.rank} out of range for {len(instances)} instance(s)")
        selected = [instances[args.rank]]
    else:
        selected = instances
    pin = (
        "none"
        if args.no_pin
        else (
            "affinity"
            if hasattr(os, "sched_setaffinity")
            else "taskset"
            if shutil.which("taskset")
            else "none"
        )
    )
    if pin == "none" and not args.no_pin:
        print(
            "run_cpu: cannot pin on this OS (no sched_setaffinity or taskset); running unpinned",
            file=sys.stderr,
        )
    if args.log_path:
        os.makedirs(args.log_path, exist_ok=True)
    procs = []
    for inst in selected:
        out = None
        if args.log_path:
            name = f"{args.log_file_prefix}_instance_{inst.index}_cores_{'-'.join(map(str, inst.cores))}.log"
            out = open(os.path.join(args.log_path, name), "w", encoding="utf-8")  # noqa: SIM115
        print(f"run_cpu: instance {inst.index} cores={list(inst.cores)} pin={pin}", file=sys.stderr)
        proc = subprocess.Popen(
            _command(args, inst, pin),
            env=_env_for(inst, len(instances), args.multi_thread_eigen),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        procs.append((proc, out))
    status = 0
    for proc, out in procs:
        rc = proc.wait()
        if out is not None:
            out.close()
        if rc != 0 and status == 0:
            status = rc
    return status


if __name__ == "__main__":
    sys.exit(main())
