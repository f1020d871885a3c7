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
