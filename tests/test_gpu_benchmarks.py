"""The GPU benchmarks run end to end on CPU (``--smoke``: tiny shapes, interpret mode), so the scripts a
GPU session depends on never rot: every row is timed, the table and the PNG are written."""

import dataclasses
import os
import shutil

import jax.numpy as jnp
import pytest

import jbackends as jb

from benchmarks import attention_gpu, gpu_timing, int4_gpu, tune_gpu
from pallas_kernels.attention import base, mosaic_flash


def test_attention_gpu_smoke(tmp_path):
    md, png = tmp_path / "a.md", tmp_path / "a.png"
    rows = attention_gpu.main(["--smoke", "--md", str(md), "--png", str(png)])
    assert [r[0] for r in rows] == ["train"] * 4 + ["feature"] * 3 + ["decode"]
    for section, *_, res, _flops, label, _column_flops in rows:
        assert set(res) == ({"jb", "jb_pallas"} if section == "feature" else {"jb", "jb_pallas", "jax_xla"})
        assert all(t > 0 for t in res.values()), res  # every row ran (NaN would fail)
        assert label.startswith("FLASH_ATTENTION[")  # jb's choice, named
    assert [r[7].split()[-1] for r in rows if r[0] == "feature"] == ["softcap", "segments", "dropout"]
    text = md.read_text()
    assert "| train | fwd+bwd | 16 | 32 | True |" in text and "| decode |" in text
    assert png.stat().st_size > 0


def test_attention_gpu_feature_rows_of_the_mosaic_kernel():
    """With a ``jb_mosaic`` column the softcap, segment-id and dropout rows, and a boolean mask's, a bias's
    and a local window's, are also timed under its flags, against its time without them (on CPU the flag selects
    nothing: this checks the rows' plumbing)."""
    impls = attention_gpu.jax_impls(smoke=True)
    impls["jb_mosaic"] = (attention_gpu._jb, {"flash": True, "flash_cuda_kernel": "mosaic"})
    rows = attention_gpu.run_features(impls, 1, 32, 2, 16, 2, "float32", smoke=True)
    assert [name for name, *_ in rows] == ["softcap", "segments", "dropout"] * 2 + ["mask", "bias", "window"]
    for name, res, label, _visible in rows[3:]:
        assert set(res) == {"jb", "jb_mosaic"} and all(t > 0 for t in res.values()), res
        assert label.startswith("FLASH[mosaic_flash]") and name in label


@pytest.mark.skipif(
    not mosaic_flash.interpret_available(), reason="no Mosaic GPU interpret mode (jax < 0.11.2)"
)
@pytest.mark.parametrize("name", attention_gpu.MOSAIC_RANGES)
def test_attention_gpu_block_ranges_rows_run_the_mosaic_kernels_with_block_ranges(monkeypatch, name):
    """The segment-id and mask rows under ``block_ranges=True`` (GPU only in the benchmark) call the Mosaic
    GPU kernels with both configs' ``block_ranges`` on and the row's operands: here in interpret mode,
    forward, against jb's float32 result with the same operands."""
    import jax
    import numpy as np

    from pallas_kernels import gpu

    seen = []
    attention = mosaic_flash.attention

    def spy(args, **kw):
        seen.append((args, kw))
        return attention(args, **kw)

    monkeypatch.setattr(mosaic_flash, "attention", spy)
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 2, 64)), jnp.bfloat16) for _ in range(3))
    fn, ops, visible = attention_gpu._with_block_ranges(name, q, k, interpret=True)
    out = fn(q, k, v, False, **ops)
    ((args, kw),) = seen
    assert kw["config"].block_ranges and kw["bwd_config"].block_ranges and kw["interpret"]
    assert (args.q_segment_ids is not None, args.mask is not None) == (name == "segments", name == "mask")
    assert visible == (0.25 if name == "segments" else 1.0)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = jb.dot_product_attention(*f32, **ops)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="`name` must be one of"):
        attention_gpu._with_block_ranges("softcap", q, k)
    wide = jnp.zeros((1, 256, 2, 256), jnp.bfloat16)  # head dim 256: the Triton backward, no BwdConfig
    seen.clear()
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        jax.eval_shape(lambda q: attention_gpu._with_block_ranges(name, q, q)[0](q, q, q, False, **ops), wide)
    assert seen[0][1]["config"].block_ranges and seen[0][1]["bwd_config"] is None


def test_attention_gpu_feature_operands_are_made_outside_the_timed_loop_and_rows_count_visible_pairs(
    monkeypatch,
):
    """A feature row's mask or bias is made once and passed into the timed loop (random generation in
    the loop would be timed with the kernel), the bias's gradient is part of the backward timed, and the
    segment-id and window rows count only the (query, key) pairs they leave to compute."""
    import jax
    import numpy as np

    captured = []
    monkeypatch.setattr(attention_gpu, "jax_time", lambda fn, args, iters: captured.append((fn, args)) or 1.0)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32, 2, 16)), jnp.float32)
    for name in ("mask", "bias"):
        fn, ops, visible = attention_gpu._with_feature(name, q, q)
        assert visible == 1.0 and set(ops) == {name} and ops[name].shape == (1, 1, 32, 32)
        attention_gpu.time_jax(fn, None, q, q, q, False, True, 2, ops)
        call, args = captured[-1]
        text = str(jax.make_jaxpr(call)(*args))
        assert "threefry" not in text and "random_bits" not in text, name
        grads = jax.eval_shape(call, *args)
        assert (set(grads[3]) == {"bias"}) == (name == "bias")  # dbias is timed, a bool mask has none
    T = 32
    _, ops, visible = attention_gpu._with_feature("segments", q, q)
    ids = np.asarray(ops["segment_ids"][0])
    assert visible == np.mean(ids[:, None] == ids[None, :]) == 0.25
    _, _, visible = attention_gpu._with_feature("window", q, q)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    assert visible == pytest.approx(np.mean(np.abs(i - j) <= T // 8))


def test_attention_gpu_mgpu_example_gets_backward_blocks_where_it_has_a_backward(monkeypatch):
    """jax's example kernel refuses a backward without its own block sizes; it has no causal backward."""
    m = pytest.importorskip("jax.experimental.pallas.ops.gpu.attention_mgpu")
    seen = []
    monkeypatch.setattr(m, "attention", lambda q, k, v, cfg: seen.append(cfg) or q)
    fn = attention_gpu._mgpu_example()
    q = jnp.zeros((1, 128, 1, 64), jnp.float16)
    fn(q, q, q, False)
    fn(q, q, q, True)
    assert seen[0].has_backward_blocks and not seen[0].causal
    assert seen[1].causal and not seen[1].has_backward_blocks


def test_gpu_benchmarks_list_failed_cells_and_exit_3(tmp_path, monkeypatch):
    """A timing that fails is a '-' cell, its error's first line under the table, and a failed jb row
    makes the run exit 3, so that the GPU session's summary does not say exit 0."""

    def boom(*args, **kwargs):
        raise ValueError("boom\nthe rest of the message")

    monkeypatch.setattr(attention_gpu, "_interpreted_pallas", boom)
    md = tmp_path / "a.md"
    argv = [
        "--smoke",
        "--no-features",
        "--no-decode",
        "--modes",
        "fwd",
        "--md",
        str(md),
        "--png",
        str(tmp_path / "a.png"),
    ]
    with pytest.raises(SystemExit) as e:
        attention_gpu.main(argv)
    assert e.value.code == 3
    text = md.read_text()
    assert text.count("| train | fwd | 16 | 32 |") == 2 and "| - |" in text
    assert "- jb_pallas, B=2 T=32 S=32 H=16 causal=False bwd=False: ValueError: boom" in text

    monkeypatch.setattr(int4_gpu.Q, "dyn_quant_matmul_4bit", boom)
    md = tmp_path / "i.md"
    with pytest.raises(SystemExit) as e:
        int4_gpu.main(["--smoke", "--md", str(md), "--png", str(tmp_path / "i.png")])
    assert e.value.code == 3
    assert "- jb dyn-quant, K=256 N=128 M=16: ValueError: boom" in md.read_text()


def test_attention_gpu_columns_pin_their_kernels():
    """jb_pallas is the Triton kernels and jb_mosaic the Mosaic GPU ones whatever 'auto' prefers (on sm90
    'auto' runs the Mosaic kernel first: an unpinned jb_pallas column timed it twice)."""
    impls = attention_gpu.jax_impls(smoke=False)
    assert impls["jb_pallas"][1] == dict(attention_gpu.FLASH_ONLY, flash_cuda_kernel="triton")
    assert impls["jb_mosaic"][1] == dict(attention_gpu.FLASH_ONLY, flash_cuda_kernel="mosaic")
    assert impls["jb"][1] is None


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


def _while_body(hlo: str) -> str:
    """The text of the while loop's body computation in an optimized HLO module."""
    import re

    name = re.search(r"body=%?([\w.\-]+)", hlo).group(1)
    lines = hlo.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"%?{re.escape(name)}\b", line.strip()))
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "}")
    return "\n".join(lines[start:end])


def test_loop_time_keeps_every_call_and_its_operand_work_in_the_loop():
    """The shared in-jit timer: work on an operand that never changes (sin(w)) stays inside the loop,
    where a loop that only feeds the output back into the first input lets XLA hoist it; so does work
    that only a second output needs; records
    (AttentionArgs) and integer operands are fine; bad counts are refused."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import base
    from pallas_kernels.timing import loop_time, timed_loop

    f = lambda a, w: a * jnp.sin(w).sum()  # noqa: E731
    ops = (jnp.ones(8), jnp.ones(1000))
    assert "sine" in _while_body(timed_loop(f).lower(ops, 100).compile().as_text())

    @functools.partial(jax.jit, static_argnums=1)
    def naive(ops, n):  # the old nudge: the output fed back into the first input only
        def body(_, s):
            a, w = s
            return a + 0.0 * jnp.sum(f(a, w)), w

        return jax.lax.fori_loop(0, n, body, ops)

    assert "sine" not in _while_body(naive.lower(ops, 100).compile().as_text())

    # Work only a later output leaf needs stays too (a token of the first leaf alone let XLA drop the
    # dK / dV kernel of a jax.grad over q, k, v from the GPU benchmark's loop: 2026-11-27).
    two = lambda a, w: (a * 2.0, jnp.cos(w))  # noqa: E731
    assert "cosine" in _while_body(timed_loop(two).lower(ops, 100).compile().as_text())

    x = jnp.ones((1, 8, 2, 16))
    args = base.make_args(x, x, x, q_seq_lengths=jnp.array([5], jnp.int32))
    assert loop_time(lambda a: base.reference(a), (args,), iters=2, repeats=1) > 0
    assert loop_time(lambda i: i + 1, (jnp.arange(3),), iters=1, repeats=1, min_loop_s=0.001) > 0
    with pytest.raises(ValueError, match="iters and repeats"):
        loop_time(lambda x: x, (x,), iters=1, repeats=0)
    with pytest.raises(ValueError, match="min_loop_s"):
        loop_time(lambda x: x, (x,), min_loop_s=-1.0)
    with pytest.raises(ValueError, match="returns no arrays"):
        loop_time(lambda x: None, (x,), iters=1, repeats=1)


def test_autotune_timings_report_failures_beside_times():
    import jax.numpy as jnp

    from pallas_kernels.attention import autotune

    def make(cfg):
        if cfg == "bad":
            raise ValueError("does not fit")
        return lambda x: x * cfg

    timed = autotune.timings(make, [2.0, "bad", 3.0], (jnp.ones(4),), repeats=1, iters=1)
    assert [c for c, _, _ in timed] == [2.0, "bad", 3.0]
    assert timed[1][1] is None and "does not fit" in timed[1][2]
    assert all(t > 0 and e is None for _, t, e in (timed[0], timed[2]))
    assert autotune.fastest(make, [2.0, "bad"], (jnp.ones(4),), repeats=1, iters=1) == 2.0
    with pytest.raises(RuntimeError, match="every candidate failed"):
        autotune.fastest(make, ["bad"], (jnp.ones(4),), repeats=1, iters=1)


def test_tune_gpu_smoke(tmp_path):
    """The tuning sweep times each call's default config and walks its search space (interpret mode on
    CPU: the times mean nothing, the bookkeeping is what is checked)."""
    md = tmp_path / "t.md"
    rows = tune_gpu.main(["--smoke", "--cases", "int4_w4a8", "decode", "--md", str(md)])
    assert [r["label"] for r in rows] == [  # in CASES order, not the command line's
        "decode S=64 GQA 4/2",
        "int4_w4a8 256x128 M=1",
        "int4_w4a8 256x128 M=32",
    ]
    for r in rows:
        assert r["walk"] == "coordinates" and r["tried"] >= 3 and r["failed"] == 0
        assert r["t_default"] > 0 and 0 < r["t_best"] <= r["t_default"]
    assert "| decode S=64 GQA 4/2 |" in md.read_text()
    # the coordinate walk: every config tried is the default or one field from a config tried before
    assert tune_gpu._distance(rows[0]["best"], rows[0]["default"]) <= 2


def test_tune_gpu_mosaic_forward_space_without_overlap():
    """``--no-overlap`` (for a session whose GPU-lane overlap test did not pass): the Mosaic forward
    cases walk their space without ``Config(overlap=True)``; the backward cases are unchanged."""
    for overlap in (True, False):
        cases = tune_gpu._mosaic_cases(overlap=overlap)
        assert {c.name for c in cases} == {"mosaic", "mosaic_bwd"}
        for c in cases:
            args = base.make_args(*(jnp.zeros((1, 256, 2, 128), jnp.bfloat16),) * 3)
            space = c.config_cls.search_space(args, **c.space_options)
            assert space and all(
                isinstance(cfg, (mosaic_flash.Config, mosaic_flash.BwdConfig)) for cfg in space
            )
            has_overlap = any(getattr(cfg, "overlap", False) for cfg in space)
            assert has_overlap == (overlap and c.name == "mosaic" and mosaic_flash.overlap_available())


def _interrupt_after(monkeypatch, module, name, calls, exc=KeyboardInterrupt):
    """Patches module.name to run as before `calls` times, then raise `exc` (KeyboardInterrupt: what SIGINT
    does)."""
    real, count = getattr(module, name), [0]

    def wrapper(*args, **kw):
        count[0] += 1
        if count[0] > calls:
            raise exc
        return real(*args, **kw)

    monkeypatch.setattr(module, name, wrapper)


def test_gpu_benchmarks_keep_their_rows_when_interrupted(tmp_path, monkeypatch):
    """A time limit's SIGINT (KeyboardInterrupt) during the second row: the table of the first is still
    written, marked as partial, and the exit status says it was cut short (130)."""
    _interrupt_after(monkeypatch, int4_gpu, "jax_time", 4)  # the 4 timings of the first row
    md = tmp_path / "i.md"
    with pytest.raises(SystemExit) as e:
        int4_gpu.main(["--smoke", "--md", str(md), "--png", str(tmp_path / "i.png")])
    assert e.value.code == 130
    text = md.read_text()
    assert "| 256x128 | 1 |" in text and "| 256x128 | 16 |" not in text
    assert "(interrupted: 1 of 2 rows)" in text

    from pallas_kernels.attention import autotune

    _interrupt_after(monkeypatch, autotune, "timings", 3)  # inside the first call's walk
    md = tmp_path / "t.md"
    with pytest.raises(SystemExit) as e:
        tune_gpu.main(["--smoke", "--cases", "int4_w4a8", "--md", str(md)])
    text = md.read_text()  # the first call's walk, cut short, is kept
    assert e.value.code == 130 and "(interrupted: 1 of 2 calls, the last one partly)" in text
    assert "| int4_w4a8 256x128 M=1 |" in text and "coordinates, cut short" in text

    _interrupt_after(monkeypatch, attention_gpu, "run_case", 1)
    md = tmp_path / "a.md"
    with pytest.raises(SystemExit) as e:
        attention_gpu.main(["--smoke", "--md", str(md), "--png", str(tmp_path / "a.png")])
    assert e.value.code == 130
    text = md.read_text()
    assert text.count("| train |") == 1 and "(interrupted: 1 rows done)" in text


class _Killed(BaseException):
    """Stands for SIGKILL: nothing of the script's own handling runs after it."""


def test_gpu_benchmarks_keep_their_rows_when_killed(tmp_path, monkeypatch, capsys):
    """A compile outlasts the SIGINT and SIGKILL comes: the markdown table was rewritten after each row,
    and every row (tune: every config's time) was printed to the log as it ended."""
    _interrupt_after(monkeypatch, attention_gpu, "run_case", 1, _Killed)
    md = tmp_path / "a.md"
    with pytest.raises(_Killed):
        attention_gpu.main(["--smoke", "--md", str(md), "--png", str(tmp_path / "a.png")])
    text = md.read_text()
    assert text.count("| train |") == 1 and "(in progress: 1 rows so far)" in text

    _interrupt_after(monkeypatch, int4_gpu, "jax_time", 4, _Killed)  # the 4 timings of the first row
    md = tmp_path / "i.md"
    with pytest.raises(_Killed):
        int4_gpu.main(["--smoke", "--md", str(md), "--png", str(tmp_path / "i.png")])
    text = md.read_text()
    assert "| 256x128 | 1 |" in text and "(in progress: 1 of 2 rows so far)" in text
    assert "  row: | 256x128 | 1 |" in capsys.readouterr().err

    from pallas_kernels.attention import autotune

    _interrupt_after(monkeypatch, autotune, "timings", 2, _Killed)
    with pytest.raises(_Killed):
        tune_gpu.main(["--smoke", "--cases", "int4_w4a8"])
    err = capsys.readouterr().err
    assert err.count("int4_w4a8 256x128 M=1: ") == 2 and err.count(" us\n") == 2, err


def _session(tmp_path, **env_over):
    """Runs benchmarks/gpu_session.sh in smoke mode (CPU) with OUT=tmp_path and these settings."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SESSION_")}
    env.update(OUT=str(tmp_path), GPU_SESSION_SMOKE="1", PYTHON=sys.executable, **env_over)
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_gpu_session_script_smoke(tmp_path):
    """The one-call GPU session script runs its three steps with their real command lines (on CPU: the
    GPU lane's tests skip, the benchmarks take their smoke shapes) and leaves its 8 files, the tables and
    each step's summary printed last."""
    res = _session(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    head, tail = res.stdout.split("---- steps", 1)
    for name in ("lane", "attention_gpu", "int4_gpu"):
        assert f"{name}: exit 0 after" in tail
    assert "---- attention_gpu.md" in head and "---- int4_gpu.md" in head and "| decode |" in head
    assert {p.name for p in tmp_path.iterdir()} == {
        "env.txt",
        "lane.log",
        "attention_gpu.log",
        "attention_gpu.md",
        "attention_gpu.png",
        "int4_gpu.log",
        "int4_gpu.md",
        "int4_gpu.png",
    }
    lane = (tmp_path / "lane.log").read_text()
    assert "skipped" in lane and "deselected" in lane and "failed" not in lane and "error" not in lane


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_gpu_session_script_limits_and_bad_settings(tmp_path):
    """A step past its limit is stopped, reported as such, and fails the run; steps that are unknown or
    absent are refused before anything runs."""
    res = _session(tmp_path / "slow", GPU_SESSION_STEPS="int4", GPU_SESSION_INT4_S="1")
    assert res.returncode == 1
    assert "int4_gpu: exit 124 after" in res.stdout and "(hit its 1 s limit)" in res.stdout

    res = _session(tmp_path / "spent", GPU_SESSION_STEPS="int4", GPU_SESSION_TOTAL_S="2")
    assert res.returncode == 1 and "int4_gpu: not run (the 2 s total is spent)" in res.stdout

    res = _session(tmp_path / "tune", GPU_SESSION_STEPS="tune", GPU_SESSION_TUNE_ARGS="--cases int4_w4a8")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "tune_gpu: exit 0 after" in res.stdout and "| int4_w4a8 256x128 M=32 |" in res.stdout
    assert {p.name for p in (tmp_path / "tune").iterdir()} == {"env.txt", "tune_gpu.log"}

    for steps, msg in (("lane nope", "unknown step 'nope'"), ("", "names no step"), ("  ", "names no step")):
        bad = _session(tmp_path / "bad", GPU_SESSION_STEPS=steps)
        assert bad.returncode == 2 and msg in bad.stderr, (steps, bad.stderr)
        assert not (tmp_path / "bad").exists()  # refused before any step ran


def test_tune_gpu_mosaic_cases_plumbing(tmp_path, capsys):
    """The Mosaic GPU cases of the sweep: skipped under --smoke (and off sm90) with the reason; their config
    adapters give the kernel's default inside a search space that fits shared memory; each runner
    (forward; forward then the two backward kernels) lowers for an sm90 target."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from pallas_kernels import gpu
    from pallas_kernels.attention import base, mosaic_flash

    rows = tune_gpu.main(["--smoke", "--cases", "mosaic_bwd", "int4_w4a8", "--md", str(tmp_path / "t.md")])
    assert [r["label"].split()[0] for r in rows] == ["int4_w4a8", "int4_w4a8"]
    assert "skipped the Mosaic GPU cases: under --smoke" in capsys.readouterr().err
    assert tune_gpu.mosaic_unsupported()  # this CPU machine: no sm90 GPU

    x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    args = base.make_args(x, x, x, is_causal=True)
    for cls in (tune_gpu.MosaicForward, tune_gpu.MosaicBackward):
        default, space = cls.heuristics(args), cls.search_space(args)
        assert default in space and len(space) >= 4
        assert all(mosaic_flash._fits(c, args) for c in space)
        assert all(tune_gpu._distance(c, default) <= 3 for c in space)
    wide = base.make_args(*(jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16),) * 3)
    assert mosaic_flash.Config(block_kv=128, stages=3) not in tune_gpu.MosaicForward.search_space(wide)

    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    a = base.make_args(q, q, q, is_causal=True)
    lse = jnp.zeros((1, 2, 256), jnp.float32)
    for kernel, cfg, operands in (
        ("mosaic", mosaic_flash.Config(block_kv=64, stages=3), (a,)),
        ("mosaic_bwd", mosaic_flash.BwdConfig(block_kv_dq=128, block_q_dkv=64, stages=2), (a, q, lse, q)),
    ):
        with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
            exp = export.export(tune_gpu.mosaic_runner(kernel, cfg), platforms=["cuda"])(*operands)
        # the backward alone: its dQ and dK / dV kernels, no forward
        assert exp.mlir_module().count("custom_call @mosaic_gpu") == (1 if kernel == "mosaic" else 2)
    with pytest.raises(ValueError, match="kernel"):
        tune_gpu.mosaic_runner("flash", None)


def test_tune_gpu_mosaic_ranges_cases():
    """``--cases mosaic_ranges``: on packed sequences, each Mosaic GPU kernel's default config with and
    without ``block_ranges`` (two candidates: the whole space), the backward first, and the ranged
    forward lowers for an sm90 target to a kernel that differs from the plain one."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from pallas_kernels import gpu

    assert tune_gpu.CASES[0] == "mosaic_ranges" and "mosaic_ranges" in tune_gpu.MOSAIC_CASES
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    ids = jnp.arange(256, dtype=jnp.int32)[None] * 4 // 256
    packed = base.make_args(q, q, q, q_segment_ids=ids, kv_segment_ids=ids)
    for cls, default in (
        (tune_gpu.MosaicForwardRanges, mosaic_flash.Config.heuristics(64)),
        (tune_gpu.MosaicBackwardRanges, mosaic_flash.BwdConfig()),
    ):
        assert cls.heuristics(packed) == default and not default.block_ranges
        assert cls.search_space(packed) == [default, dataclasses.replace(default, block_ranges=True)]
    cases = tune_gpu._mosaic_ranges_cases()
    assert {c.name for c in cases} == {"mosaic_ranges"} and len(cases) in (2, 4)
    assert [c.label.split()[1] for c in sorted(cases, key=lambda c: c.priority)][0] == "bwd"
    cfg = mosaic_flash.Config.heuristics(64, False)
    ranged_cfg = dataclasses.replace(cfg, block_ranges=True)
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        ranged = export.export(tune_gpu.mosaic_runner("mosaic", ranged_cfg), platforms=["cuda"])(packed)
        # the kernels' jaxprs: jax 0.11's exported modules vary from run to run
        programs = [
            str(jax.make_jaxpr(tune_gpu.mosaic_runner("mosaic", c))(packed)) for c in (cfg, ranged_cfg)
        ]
    assert ranged.mlir_module().count("custom_call @mosaic_gpu") == 1
    assert programs[0] != programs[1]  # the ranges reach the kernel
