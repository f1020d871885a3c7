"""The GPU benchmarks run end to end on CPU (``--smoke``: tiny shapes, interpret mode), so the scripts a
GPU session depends on never rot: every row is timed, the table and the PNG are written."""

import os

import pytest

from benchmarks import attention_gpu, gpu_timing, int4_gpu


def test_attention_gpu_smoke(tmp_path):
    md, png = tmp_path / "a.md", tmp_path / "a.png"
    rows = attention_gpu.main(["--smoke", "--md", str(md), "--png", str(png)])
    assert {r[0] for r in rows} == {"train", "decode"} and len(rows) == 5
    for *_, res, _flops, label in rows:
        assert set(res) == {"jb", "jb_pallas", "jax_xla"}
        assert all(t > 0 for t in res.values()), res  # every row ran (NaN would fail)
        assert label.startswith("FLASH_ATTENTION[")  # jb's choice, named
    text = md.read_text()
    assert "| train | fwd+bwd | 16 | 32 | True |" in text and "| decode |" in text
    assert png.stat().st_size > 0


def test_int4_gpu_smoke(tmp_path):
    md, png = tmp_path / "i.md", tmp_path / "i.png"
    rows = int4_gpu.main(["--smoke", "--md", str(md), "--png", str(png)])
    assert [key for key, *_ in rows] == [(256, 128, 1), (256, 128, 16)]
    for _, res, engines, nbytes in rows:
        assert all(t > 0 for t in res.values()), res
        assert set(engines) == {"jb int4_matmul", "jb dyn-quant"} and nbytes > 0
    assert "| 256x128 | 16 |" in md.read_text() and os.path.getsize(png) > 0


def test_jax_time_checks_its_arguments():
    import jax.numpy as jnp

    with pytest.raises(ValueError, match="iters"):
        gpu_timing.jax_time(lambda x: x, (jnp.ones(2),), iters=0)
    assert gpu_timing.jax_time(lambda x: x * 2, (jnp.ones(4),), iters=3, repeats=1) > 0
    assert gpu_timing.ratio(2.0, 1.0) == "2.00x" and gpu_timing.ratio(float("nan"), 1.0) == "-"


def test_gpu_session_script_smoke(tmp_path):
    """The one-call GPU session script runs its three steps (on CPU: the benchmarks' smoke shapes, the
    GPU lane skipped) and leaves its 8 files, each step's summary printed last."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "GPU_SESSION_SMOKE": "1", "PYTHON": sys.executable}
    env.pop("JAX_PLATFORMS", None)
    res = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_session.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    tail = res.stdout.split("---- steps", 1)[1]
    for name in ("lane", "attention_gpu", "int4_gpu"):
        assert f"{name}: exit 0 after" in tail
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {
        "env.txt",
        "lane.log",
        "attention_gpu.log",
        "attention_gpu.md",
        "attention_gpu.png",
        "int4_gpu.log",
        "int4_gpu.md",
        "int4_gpu.png",
    }
    assert "skipped" in (tmp_path / "lane.log").read_text()
    assert "| decode |" in (tmp_path / "attention_gpu.md").read_text()

    bad = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_session.sh")],
        env={**env, "GPU_SESSION_STEPS": "lane nope", "OUT": str(tmp_path / "bad")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "unknown step 'nope'" in bad.stderr
    assert not (tmp_path / "bad").exists()  # refused before any step ran
