"""GPU attention benchmark: our Pallas Triton flash kernel vs cuDNN, XLA and tokamax (TFLOP/s).

For bf16, head dims 64 and 128, sequence lengths 1k..16k, causal and not, it times the forward and
forward+backward of:

* ``pallas``: ``pallas_kernels.attention.triton_flash`` (this project's Triton kernels),
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``,
* ``jax_xla``: ``jax.nn.dot_product_attention(implementation="xla")`` (quadratic memory; skipped
  where it runs out of memory),
* ``xla_flash``: this project's blockwise XLA implementation (the CPU path, for reference),
* ``tokamax``: ``tokamax.dot_product_attention(implementation="triton")`` when installed.

FLOPs follow the FlashAttention papers: forward ``4 B N T S H`` (halved under a causal mask),
backward 2.5x the forward. Batch x length is fixed at 16k tokens and heads x head dim at 2048.
Prints a table (TFLOP/s, and the ratio to cuDNN) and writes a PNG (needs matplotlib).

Usage (on a machine with an NVIDIA GPU)::

    python benchmarks/attention_gpu.py                 # full sweep, writes attention_gpu.png
    python benchmarks/attention_gpu.py --lengths 1024 4096 --head-dims 128 --no-bwd
    python benchmarks/attention_gpu.py --smoke         # CPU: tiny shapes, interpret mode, no timing value
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.attention import base, triton_flash, xla_flash  # noqa: E402

try:  # optional peer
    import tokamax  # noqa: E402
except ImportError:  # pragma: no cover - depends on the environment
    tokamax = None


def _pallas(q, k, v, causal, interpret=False):
    return triton_flash.attention(base.make_args(q, k, v, is_causal=causal), interpret=interpret)[0]


def _xla_flash(q, k, v, causal):
    return xla_flash.attention(base.make_args(q, k, v, is_causal=causal))[0]


def _jax_nn(impl):
    def f(q, k, v, causal):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

    return f


def _tokamax(q, k, v, causal):
    # tokamax mirrors jax.nn's signature plus `implementation` (its Triton backend by name).
    return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="triton")


def implementations(smoke: bool) -> dict:
    if smoke:
        return {
            "pallas": functools.partial(_pallas, interpret=True),
            "jax_xla": _jax_nn("xla"),
            "xla_flash": _xla_flash,
        }
    impls = {"pallas": _pallas, "cudnn": _jax_nn("cudnn"), "jax_xla": _jax_nn("xla"), "xla_flash": _xla_flash}
    if tokamax is not None:
        impls["tokamax"] = _tokamax
    return impls


def flops(B, N, T, S, H, causal, bwd):
    f = 4.0 * B * N * T * S * H
    if causal:
        f *= 0.5
    return f * (3.5 if bwd else 1.0)


def time_fn(fn, args, iters: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_one(impl, B, L, N, H, causal, bwd, iters, dtype):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, N, H)), dtype) for _ in range(3))
    if bwd:

        def loss(q, k, v):
            return impl(q, k, v, causal).astype(jnp.float32).sum()

        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    else:
        fn = jax.jit(lambda q, k, v: impl(q, k, v, causal))
    return time_fn(fn, (q, k, v), iters)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--tokens", type=int, default=16384, help="batch x length")
    p.add_argument("--model-dim", type=int, default=2048, help="heads x head dim")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-bwd", action="store_true", help="forward only")
    p.add_argument("--impls", nargs="+", default=None, help="subset of implementations")
    p.add_argument("--png", default="attention_gpu.png")
    p.add_argument(
        "--smoke", action="store_true", help="CPU check of this script: tiny shapes, Pallas in interpret mode"
    )
    a = p.parse_args(argv)

    if a.smoke:
        a.lengths, a.head_dims, a.tokens, a.model_dim, a.iters = [32], [16], 64, 32, 1
    elif jax.default_backend() != "gpu":
        sys.exit("attention_gpu.py needs a GPU (or pass --smoke for a CPU check of the script)")
    impls = implementations(a.smoke)
    if a.impls:
        impls = {k: v for k, v in impls.items() if k in a.impls}
    dtype = jnp.bfloat16
    device = jax.devices()[0].device_kind
    modes = [False] if a.no_bwd else [False, True]
    rows = []  # (mode, H, L, causal, impl, tflops)
    for bwd in modes:
        for H in a.head_dims:
            for L in a.lengths:
                B, N = max(1, a.tokens // L), max(1, a.model_dim // H)
                for causal in (False, True):
                    for name, impl in impls.items():
                        try:
                            t = bench_one(impl, B, L, N, H, causal, bwd, a.iters, dtype)
                            tf = flops(B, N, L, L, H, causal, bwd) / t / 1e12
                        except Exception as e:  # noqa: BLE001 - OOM / unsupported: report and go on
                            print(
                                f"  {name} H={H} L={L} causal={causal} bwd={bwd}: "
                                f"{type(e).__name__}: {str(e)[:120]}",
                                file=sys.stderr,
                            )
                            tf = math.nan
                        rows.append(("fwd+bwd" if bwd else "fwd", H, L, causal, name, tf))

    names = list(impls)
    print(
        f"\nAttention TFLOP/s on {device}, {jnp.dtype(dtype).name}, {a.tokens} tokens, "
        f"model dim {a.model_dim} (ratio to cudnn in parentheses)"
    )
    header = f"{'pass':8} {'H':>4} {'L':>6} {'causal':>6} " + " ".join(f"{n:>16}" for n in names)
    print(header)
    print("-" * len(header))
    table = {}
    for mode, H, L, causal, name, tf in rows:
        table.setdefault((mode, H, L, causal), {})[name] = tf
    for (mode, H, L, causal), res in table.items():
        ref = res.get("cudnn", math.nan)
        cells = []
        for n in names:
            tf = res.get(n, math.nan)
            ratio = f"({tf / ref:.2f}x)" if ref == ref and tf == tf and ref > 0 else ""
            cells.append(f"{tf:8.1f}{ratio:>8}")
        print(f"{mode:8} {H:>4} {L:>6} {str(causal):>6} " + " ".join(f"{c:>16}" for c in cells))

    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no PNG written", file=sys.stderr)
        return rows
    panels = [
        (m, H, c)
        for m in ("fwd", "fwd+bwd")
        if m in {r[0] for r in rows}
        for H in a.head_dims
        for c in (False, True)
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (m, H, c) in zip(axes[0], panels):
        for n in names:
            xs = [L for L in a.lengths]
            ys = [table[(m, H, L, c)].get(n, math.nan) for L in xs]
            ax.plot(xs, ys, marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{m}, hd {H}, {'causal' if c else 'full'}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Attention, {device}, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    print(f"wrote {a.png}")
    return rows


if __name__ == "__main__":
    main()
