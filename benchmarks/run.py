"""Run the jbackends benchmarks, print their ratio tables and write PNG plots.

    python -m benchmarks                   # from the repository root; quick: small sizes, ~1.5 min on 2 cores
    python -m benchmarks --full            # the full sizes (tens of minutes on a CPU)
    python -m benchmarks --only int4 --out /some/dir

Two benchmarks:

* attention (here; on a GPU also `benchmarks/attention_gpu.py`): every jbackends SDPA backend against
  `jax.nn.dot_product_attention`, causal, forward + backward, by sequence length. Plot `attention.png`:
  time and memory (the temporary buffers of the compiled executable, `memory_analysis()`) against the
  sequence length.
* int4 (`benchmarks/int4.py`'s table): `jb.quantized` int4 matmuls against dense float32 / bfloat16
  matmuls and torch's int4 ops, by rows M. Plot
  `int4_speedup.png`: dense float32 time / int4 time against M (>1: int4 is faster).

Timings are medians (or best-of) of short runs on whatever device JAX picks; on a shared machine rerun
for stable numbers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py`: make `benchmarks.*` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

__all__ = ["main", "run_attention", "run_int4"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _header(title: str) -> None:
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}", flush=True)


# --------------------------------------------------------------------------------------------------
# int4
# --------------------------------------------------------------------------------------------------

INT4_QUICK = dict(ms=[1, 4, 16, 64], shapes=[(4096, 4096)], groupsize=128, torch_dyn_max_m=1, budget_s=0.25)
INT4_FULL = dict(ms=[1, 4, 16, 64, 256], shapes=[(4096, 4096), (4096, 11008)], groupsize=128,
                 torch_dyn_max_m=16, budget_s=1.0)


def run_int4(full: bool, out: str) -> dict[str, Any]:
    """Runs `benchmarks/int4.py`'s table, then plots dense-f32 time / int4 time against M."""
    from benchmarks import int4

    cfg = INT4_FULL if full else INT4_QUICK
    _header(f"int4 matmul (groupsize {cfg['groupsize']}, {'full' if full else 'quick'}): "
            "ms per call and speed-up over dense matmuls (>1x: faster)")
    rows = int4.run(cfg["ms"], cfg["shapes"], cfg["groupsize"], cfg["torch_dyn_max_m"], cfg["budget_s"])

    # Summary table and plot: every int4 row against dense f32, per (K, N).
    by_shape: dict[tuple[int, int], dict[str, list[tuple[int, float]]]] = {}
    for (k, n, m), r in rows:
        f32 = next(t for name, (t, _) in r.items() if name.startswith("dense f32"))
        for name, (t, _) in r.items():
            if not name.startswith("dense"):
                by_shape.setdefault((k, n), {}).setdefault(name, []).append((m, f32 / t))
    print("\nsummary: dense f32 time / int4 time (>1x: int4 is faster)")
    for (k, n), series in by_shape.items():
        ms = [m for m, _ in next(iter(series.values()))]
        print(f"  K={k} N={n}: {'impl':36s} " + " ".join(f"{f'M={m}':>8s}" for m in ms))
        for name, pts in series.items():
            print(f"  {'':{len(f'K={k} N={n}: ')}}{name:36s} " + " ".join(f"{s:7.2f}x" for _, s in pts))

    plt = _plt()
    fig, axes = plt.subplots(1, len(by_shape), figsize=(5.5 * len(by_shape), 3.8), squeeze=False)
    for ax, ((k, n), series) in zip(axes[0], by_shape.items()):
        for name, pts in series.items():
            ax.plot([m for m, _ in pts], [s for _, s in pts], "o-", label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set(xscale="log", yscale="log", xlabel="M (rows of x)", ylabel="dense f32 time / int4 time",
               title=f"int4 speed-up, K={k} N={n} ({jax.devices()[0].platform})")
        ms = sorted({m for pts in series.values() for m, _ in pts})
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "int4_speedup.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nplot: {path}")
    return {"rows": rows, "png": path}


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


ATTN_QUICK = dict(seq_lens=[256, 512, 1024, 2048], batch=1, heads=4, head_dim=64, reps=3)
ATTN_FULL = dict(seq_lens=[512, 1024, 2048, 4096, 8192], batch=1, heads=8, head_dim=64, reps=10)


def _attention_impls(platform: str) -> dict[str, Any]:
    """name -> fn(q, k, v): jax.nn's paths and each jbackends backend (pinned with `implementation=`)."""
    import jbackends as jb

    impls = {"jax.nn (xla)": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                           implementation="xla")}
    if platform == "gpu":
        impls["jax.nn (cudnn)"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                               implementation="cudnn")
    for backend in ("flash", "mem_efficient", "math") + (("cudnn",) if platform == "gpu" else ()):
        impls[f"jb {backend}"] = (lambda q, k, v, b=backend:
                                  jb.dot_product_attention(q, k, v, is_causal=True, implementation=b))
    return impls


def _median_s(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile, warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_attention(full: bool, out: str) -> dict[str, Any]:
    """Causal self-attention, forward + backward, by sequence length: time and compiled temp memory.

    Every jbackends backend (pinned with `implementation=`) against `jax.nn.dot_product_attention`.
    Memory is the temporary-buffer size XLA reports for the compiled gradient (`memory_analysis()`).
    On a GPU, `benchmarks/attention_gpu.py` (TFLOP/s of the Pallas kernels against cuDNN, XLA and
    tokamax) runs after it.
    """
    import jax.numpy as jnp

    cfg = ATTN_FULL if full else ATTN_QUICK
    platform = jax.default_backend()
    dtype = jnp.bfloat16 if platform == "gpu" else jnp.float32
    b, n, h = cfg["batch"], cfg["heads"], cfg["head_dim"]
    _header(f"attention, causal, forward + backward, B={b} N={n} H={h} {jnp.dtype(dtype).name} on {platform} "
            f"({'full' if full else 'quick'}): ms and MiB, and the ratio to jax.nn (xla)")
    impls = _attention_impls(platform)
    ms: dict[str, list[float]] = {name: [] for name in impls}
    mib: dict[str, list[float]] = {name: [] for name in impls}
    base = "jax.nn (xla)"
    print(f"{'T':>6} " + " ".join(f"{name:>24}" for name in impls))
    for t in cfg["seq_lens"]:
        q, k, v = (jax.random.normal(jax.random.key(i), (b, t, n, h), dtype) for i in range(3))
        for name, fn in impls.items():
            grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            try:
                analysis = grad.lower(q, k, v).compile().memory_analysis()
                mib[name].append(analysis.temp_size_in_bytes / 2**20 if analysis is not None else float("nan"))
                ms[name].append(1e3 * _median_s(grad, (q, k, v), cfg["reps"]))
            except Exception as e:  # noqa: BLE001 - out of memory / unsupported here: report, go on
                print(f"  {name} T={t}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                mib[name].append(float("nan"))
                ms[name].append(float("nan"))
        cells = []
        for name in impls:
            cells.append(f"{ms[name][-1]:7.1f}ms {ms[base][-1] / ms[name][-1]:4.1f}x {mib[name][-1]:6.1f}M")
        print(f"{t:>6} " + " ".join(f"{c:>24}" for c in cells), flush=True)
    print("(each cell: fwd+bwd time, speed-up over jax.nn (xla) (>1x: faster), temporary memory)")

    plt = _plt()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name in impls:
        ax_t.plot(cfg["seq_lens"], ms[name], "o-", label=name)
        ax_m.plot(cfg["seq_lens"], mib[name], "o-", label=name)
    ax_t.set(ylabel="ms (forward + backward)", title=f"causal attention time ({platform})")
    ax_m.set(ylabel="MiB (temporary buffers)", title="memory of the compiled forward + backward")
    for ax in (ax_t, ax_m):
        ax.set(xscale="log", yscale="log", xlabel="sequence length")
        ax.set_xticks(cfg["seq_lens"], [str(x) for x in cfg["seq_lens"]])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "attention.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nplot: {path}")
    result = {"seq_lens": cfg["seq_lens"], "ms": ms, "mib": mib, "png": path}

    if platform == "gpu":
        from benchmarks import attention_gpu

        _header("attention_gpu.py: TFLOP/s of the Pallas kernels against cuDNN, XLA and tokamax")
        gpu_args = ["--png", os.path.join(out, "attention_gpu.png")]
        if not full:
            gpu_args += ["--lengths", "1024", "4096", "--head-dims", "128", "--iters", "5"]
        result["gpu_rows"] = attention_gpu.main(gpu_args)
    return result


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------

BENCHMARKS = {"attention": run_attention, "int4": run_int4}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the full sizes (slow on a CPU)")
    parser.add_argument("--out", default=os.path.join("out", "benchmarks"), help="directory for the PNG plots (default ./%(default)s)")
    parser.add_argument("--only", choices=sorted(BENCHMARKS), action="append",
                        help="run only this benchmark (repeatable)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} | {dev.platform} ({dev.device_kind}) | {os.cpu_count()} CPU cores | "
          f"{'full' if args.full else 'quick (use --full for the full tables)'}")
    results, t0 = {}, time.perf_counter()
    for name in args.only or list(BENCHMARKS):
        results[name] = BENCHMARKS[name](args.full, args.out)
    pngs = [os.path.abspath(r["png"]) for r in results.values()]
    print(f"\ndone in {time.perf_counter() - t0:.0f} s; plots:\n  " + "\n  ".join(pngs))
    return results


if __name__ == "__main__":
    main()
