"""Run the jbackends benchmarks, print their ratio tables and write PNG plots.

    python -m benchmarks                   # from the repository root; quick: small sizes, ~1.5 min on 2 cores
    python -m benchmarks --full            # the full sizes (tens of minutes on a CPU)
    python -m benchmarks --only int4 --out /some/dir

Two benchmarks:

* attention (`benchmarks/attention.py`'s table; on a GPU also `benchmarks/attention_gpu.py`): jbackends'
  flash backend against `jax.nn.dot_product_attention`, torch's CPU SDPA and tokamax, by sequence
  length. Plot `attention.png`: time and peak memory (JAX: the compiled executable's
  `memory_analysis()`; torch: resident-set growth) against the sequence length.
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

INT4_QUICK = dict(
    ms=[1, 4, 16, 64], shapes=[(4096, 4096)], groupsize=128, torch_dyn_max_m=1, budget_s=0.25, rounds=1
)
INT4_FULL = dict(
    ms=[1, 4, 16, 64, 256],
    shapes=[(4096, 4096), (4096, 11008)],
    groupsize=128,
    torch_dyn_max_m=16,
    budget_s=1.0,
    rounds=3,
)


def run_int4(full: bool, out: str) -> dict[str, Any]:
    """Runs `benchmarks/int4.py`'s table, then plots dense-f32 time / int4 time against M."""
    from benchmarks import int4

    cfg = INT4_FULL if full else INT4_QUICK
    _header(
        f"int4 matmul (groupsize {cfg['groupsize']}, {'full' if full else 'quick'}): "
        "ms per call and speed-up over dense matmuls (>1x: faster)"
    )
    roofs = int4.measure_roofs(cfg["budget_s"])
    print(f"roofs: memory copy {roofs[0]:.1f} GB/s (read + write), XLA float32 GEMM {roofs[1]:.1f} GFLOP/s")
    rows = int4.run(
        cfg["ms"],
        cfg["shapes"],
        cfg["groupsize"],
        cfg["torch_dyn_max_m"],
        cfg["budget_s"],
        roofs,
        cfg["rounds"],
    )

    # Summary table and plot: every int4 row against dense f32, per (K, N).
    by_shape: dict[tuple[int, int], dict[str, list[tuple[int, float]]]] = {}
    for (k, n, m), r in rows:
        f32 = next(t for name, (t, _) in r.items() if name.startswith("dense f32"))
        for name, (t, _) in r.items():
            if not name.startswith("dense"):
                by_shape.setdefault((k, n), {}).setdefault(name, []).append((m, f32 / t))
    print("\nsummary: dense f32 time / int4 time (>1x: int4 is faster)")
    for (k, n), series in by_shape.items():
        # every M any series has, each value under its own M (a series may skip some: '-')
        ms = sorted({m for pts in series.values() for m, _ in pts})
        print(f"  K={k} N={n}: {'impl':36s} " + " ".join(f"{f'M={m}':>8s}" for m in ms))
        for name, pts in series.items():
            at = dict(pts)
            cells = " ".join(f"{at[m]:7.2f}x" if m in at else f"{'-':>8s}" for m in ms)
            print(f"  {'':{len(f'K={k} N={n}: ')}}{name:36s} " + cells)

    plt = _plt()
    fig, axes = plt.subplots(1, len(by_shape), figsize=(5.5 * len(by_shape), 3.8), squeeze=False)
    for ax, ((k, n), series) in zip(axes[0], by_shape.items()):
        for name, pts in series.items():
            ax.plot([m for m, _ in pts], [s for _, s in pts], "o-", label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="M (rows of x)",
            ylabel="dense f32 time / int4 time",
            title=f"int4 speed-up, K={k} N={n} ({jax.devices()[0].platform})",
        )
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


ATTN_QUICK = [
    "--lengths",
    "256",
    "512",
    "1024",
    "2048",
    "--modes",
    "fwd+bwd",
    "--causal",
    "yes",
    "--repeats",
    "3",
]
ATTN_FULL: list[
    str
] = []  # benchmarks/attention.py's defaults: L in {1k, 4k, 16k}, causal and not, fwd and fwd+bwd


def run_attention(full: bool, out: str) -> dict[str, Any]:
    """Runs `benchmarks/attention.py`'s table, then plots its time and memory against the length.

    jbackends' flash backend against `jax.nn.dot_product_attention` (xla), torch's CPU SDPA and tokamax
    when installed (float32, B=1, 8 heads, head dim 64). On a GPU, torch's CPU rows are left out and
    `benchmarks/attention_gpu.py` (TFLOP/s of the Pallas kernels against cuDNN, XLA, tokamax) follows.
    """
    from benchmarks import attention

    platform = jax.default_backend()
    args = list(ATTN_FULL if full else ATTN_QUICK) + (["--no-torch"] if platform != "cpu" else [])
    _header(
        f"attention ({'full' if full else 'quick'}; `python benchmarks/attention.py {' '.join(args)}`): "
        "ratios are other / jbackends (>1x: jbackends is faster / smaller)"
    )
    rows = attention.main(args)

    panels = sorted({(r["mode"], r["causal"]) for r in rows}, key=lambda mc: (mc[0] != "fwd", mc[1]))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    plt = _plt()
    fig, axes = plt.subplots(2, len(panels), figsize=(max(6.0, 4.6 * len(panels)), 7), squeeze=False)
    for col, (mode, causal) in enumerate(panels):
        ax_t, ax_m = axes[0][col], axes[1][col]
        for name in impls:
            pts = sorted(
                (r["L"], r["time"], r["mem"])
                for r in rows
                if r["impl"] == name and r["mode"] == mode and r["causal"] == causal
            )
            lengths = [p[0] for p in pts]
            ax_t.plot(lengths, [np.nan if p[1] is None else 1e3 * p[1] for p in pts], "o-", label=name)
            ax_m.plot(lengths, [np.nan if p[2] is None else p[2] / 2**20 for p in pts], "o-", label=name)
        ax_t.set(ylabel="ms", title=f"{mode}, {'causal' if causal else 'full'}: time ({platform})")
        ax_m.set(ylabel="MiB", title=f"{mode}, {'causal' if causal else 'full'}: peak memory")
        lengths = sorted({r["L"] for r in rows})
        for ax in (ax_t, ax_m):
            ax.set(xscale="log", yscale="log", xlabel="sequence length")
            ax.set_xticks(lengths, [str(x) for x in lengths])
            ax.xaxis.set_minor_locator(plt.NullLocator())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "attention.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nplot: {path}")
    result = {"rows": rows, "png": path}

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
    parser.add_argument(
        "--out",
        default=os.path.join("out", "benchmarks"),
        help="directory for the PNG plots (default ./%(default)s)",
    )
    parser.add_argument(
        "--only", choices=sorted(BENCHMARKS), action="append", help="run only this benchmark (repeatable)"
    )
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__} | {dev.platform} ({dev.device_kind}) | {os.cpu_count()} CPU cores | "
        f"{'full' if args.full else 'quick (use --full for the full tables)'}"
    )
    results, t0 = {}, time.perf_counter()
    for name in args.only or list(BENCHMARKS):
        results[name] = BENCHMARKS[name](args.full, args.out)
    pngs = [os.path.abspath(r["png"]) for r in results.values()]
    print(f"\ndone in {time.perf_counter() - t0:.0f} s; plots:\n  " + "\n  ".join(pngs))
    return results


if __name__ == "__main__":
    main()
