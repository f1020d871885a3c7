"""python -m jbackends.xeon.run_cpu: N instances pinned to disjoint cores, XLA CPU thread settings."""

import os
import subprocess
import sys

import pytest

from jbackends.xeon import run_cpu

TINY = """
import os, jax.numpy as jnp
print("instance", os.environ["JBACKENDS_INSTANCE_INDEX"], "of", os.environ["JBACKENDS_NUM_INSTANCES"],
      "affinity", ",".join(map(str, sorted(os.sched_getaffinity(0)))),
      "xla", os.environ["XLA_FLAGS"], "omp", os.environ["OMP_NUM_THREADS"],
      "sum", float(jnp.sum(jnp.ones(4))), flush=True)
"""


def _run(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "jbackends.xeon.run_cpu", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs sched_setaffinity")
def test_two_pinned_instances(tmp_path):
    cores = run_cpu.physical_cores(run_cpu.available_cores())
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    (tmp_path / "tiny.py").write_text(TINY)
    res = _run(["--ninstances", "2", "--ncores-per-instance", "1", "--log-path", "logs", "tiny.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    logs = sorted((tmp_path / "logs").iterdir())
    assert [p.name for p in logs] == [
        f"run_instance_0_cores_{cores[0]}.log",
        f"run_instance_1_cores_{cores[1]}.log",
    ]
    seen = []
    for i, path in enumerate(logs):
        line = [l for l in path.read_text().splitlines() if l.startswith("instance")][0].split()
        assert line[1] == str(i) and line[3] == "2"
        seen.append(line[5])
        assert line[7] == "--xla_cpu_multi_thread_eigen=false" and line[9] == "1" and line[11] == "4.0"
    assert seen == [str(cores[0]), str(cores[1])]  # disjoint, one core each


def test_failure_status_and_rank(tmp_path, capsys):
    fail = tmp_path / "fail.py"
    fail.write_text("import os, sys; sys.exit(3 if os.environ['JBACKENDS_INSTANCE_INDEX'] == '0' else 0)")
    assert run_cpu.main(["--ninstances", "1", "--ncores-per-instance", "1", str(fail)]) == 3
    with pytest.raises(SystemExit) as exc:
        run_cpu.main(["--ninstances", "1", "--rank", "5", str(fail)])
    assert exc.value.code == 2 and "--rank 5 out of range" in capsys.readouterr().err


def test_help_and_plan_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cpu.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for word in ("--ninstances", "--ncores-per-instance", "xla_cpu_multi_thread_eigen", "--log-path"):
        assert word in out
    assert run_cpu.plan([0, 1, 2, 3], 2, None) == [run_cpu.Instance(0, (0, 1)), run_cpu.Instance(1, (2, 3))]
    assert run_cpu.plan([4, 5, 6], None, 1)[2].cores == (6,)
    with pytest.raises(ValueError, match="needs 6 cores"):
        run_cpu.plan([0, 1], 3, 2)
    with pytest.raises(ValueError, match=">= 1"):
        run_cpu.plan([0, 1], 0, None)
    env = run_cpu._env_for(run_cpu.Instance(0, (0, 1)), 1, "auto")
    assert "--xla_cpu_multi_thread_eigen=true" in env["XLA_FLAGS"] and env["JBACKENDS_CORES"] == "0,1"
