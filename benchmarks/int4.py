"""int4 matmul benchmark: M in {1, 16, 256} x (K x N) in {4096 x 4096, 4096 x 11008}.

Rows per shape: jbackends dyn-quant (W4A8, the ``auto`` engine: the C++ kernel on CPU), the same
pinned to pure XLA, the weight-only int4_matmul (W4A32), dense float32 and bfloat16 ``jnp.dot``, and
when torch is installed its ``_dyn_quant_matmul_4bit`` (x86: a scalar single-threaded reference) and
``_weight_int4pack_mm_for_cpu`` (AVX-512 tinygemm; timed with bfloat16 activations, its fast path).

Columns: median time, effective GB/s of weight traffic (the bytes of the weight the op reads:
packed nibbles + scales for int4, 4 or 2 bytes per weight for dense) and its fraction of a measured
memory copy rate ("%copy"), GFLOP/s (2 M N K) and its fraction of a measured XLA float32 GEMM rate
("%gemm"), and speed-ups (>1 is faster) of each row over dense f32, dense bf16, torch dyn-quant and
torch int4pack. The two roofs are measured at the start (and printed): the copy rate is the best of
numpy's single-threaded copy and XLA's multi-threaded one, counting the bytes read and written; the
GEMM rate is XLA's float32 ``jnp.dot`` on 512 x 4096 x 4096.

    python benchmarks/int4.py                 # the full table (a few minutes on 2 cores)
    python benchmarks/int4.py --quick         # M=1 only
    python benchmarks/int4.py --groupsize 32

The CPU is often shared: each cell is timed in `--rounds` interleaved rounds (default 3) and its time is
the median of their medians; rerun for stable numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):  # `python benchmarks/int4.py` from a checkout: import this checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jbackends.quantized as Q  # noqa: E402
from pallas_kernels.int4_matmul import cpp as _cpp  # noqa: E402

try:
    import torch
except ImportError:  # torch is optional
    torch = None


def _time(fn, *, min_iters=3, budget_s=1.0, max_iters=50, warm_up=True) -> float:
    if warm_up:
        fn()  # compile, first-touch
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_iters or (time.perf_counter() < t_end and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _jax(f, *args):
    f = jax.jit(f)
    return lambda: jax.block_until_ready(f(*args))


def measure_roofs(budget_s: float = 1.0) -> tuple[float, float]:
    """(copy GB/s, XLA float32 GEMM GFLOP/s) on this machine now: the roofs of the table's fractions."""
    n = 256 << 20
    a = np.ones(n, np.uint8)
    b = np.empty_like(a)
    t_np = _time(lambda: np.copyto(b, a), budget_s=budget_s)
    xa = jnp.ones((n // 4,), jnp.float32)
    t_xla = _time(_jax(lambda v: v + 1.0, xa), budget_s=budget_s)
    copy_gbs = 2 * n / min(t_np, t_xla) / 1e9
    M, K, N = 512, 4096, 4096
    xm = jnp.ones((M, K), jnp.float32)
    wm = jnp.ones((K, N), jnp.float32)
    t_gemm = _time(_jax(jnp.dot, xm, wm), budget_s=budget_s)
    return copy_gbs, 2 * M * N * K / t_gemm / 1e9


def run(ms, shapes, groupsize, torch_dyn_max_m, budget_s, roofs=(None, None), rounds=1):
    """Times every implementation at every (shape, M) and prints a block per pair; returns
    [((K, N, M), {row name: (seconds, weight bytes)})]. Each cell is timed in `rounds` interleaved
    rounds of budget_s / rounds (the first with a warm-up call) and its time is their median."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    rows = []
    rng = np.random.default_rng(0)
    for K, N in shapes:
        w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        q, s = Q.quantize_4bit(w, groupsize)
        packed = Q.dyn_quant_pack_4bit_weight(q, s, None, groupsize, K, N)
        int4_bytes = packed.nbytes
        wt32 = jnp.asarray(w.T)
        wt16 = wt32.astype(jnp.bfloat16)
        if torch is not None:
            tq = np.asarray(q)
            qi = np.stack([tq & 15, tq >> 4], -1).reshape(N, K).astype(np.int32)
            sb = torch.tensor(np.asarray(s)).to(torch.bfloat16 if groupsize != K else torch.float32)
            tpk = torch.ops.aten._dyn_quant_pack_4bit_weight(torch.tensor(tq), sb, None, groupsize, K, N)
            t4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.tensor(qi), 2)
            # tinygemm: w = (q - 8) * scale with zero = 0 in its (scale, zero) layout [K/g, N, 2]
            sz = torch.zeros(K // groupsize, N, 2)
            sz[..., 0] = torch.tensor(np.asarray(s)).T  # the zero stays 0: the kernel subtracts the 8
            sz = sz.to(torch.bfloat16)  # its fast path: bf16 activations (f32 ones are ~10x slower)
        t_dyn_m16 = None
        for M in ms:
            x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
            xb = x.astype(jnp.bfloat16)
            # name -> (callable, weight bytes, timing kwargs)
            cells = {
                "jb dyn-quant (auto)": (
                    _jax(lambda x, p: Q.dyn_quant_matmul_4bit(x, p, groupsize, K, N), x, packed),
                    int4_bytes,
                    {},
                ),
                "jb dyn-quant (xla)": (
                    _jax(
                        lambda x, p: Q.dyn_quant_matmul_4bit(x, p, groupsize, K, N, implementation="xla"),
                        x,
                        packed,
                    ),
                    int4_bytes,
                    {},
                ),
                "jb int4_matmul (auto)": (_jax(lambda x, p: Q.int4_matmul(x, p), x, packed), int4_bytes, {}),
                "jb int4_matmul (auto, bf16 x)": (
                    _jax(lambda x, p: Q.int4_matmul(x, p), xb, packed),
                    int4_bytes,
                    {},
                ),
                "dense f32 jnp.dot": (_jax(jnp.dot, x, wt32), N * K * 4, {}),
                "dense bf16 jnp.dot": (_jax(jnp.dot, xb, wt16), N * K * 2, {}),
            }
            if torch is not None:
                tx = torch.tensor(np.asarray(x))
                if M <= torch_dyn_max_m:
                    cells["torch _dyn_quant_matmul_4bit"] = (
                        lambda tx=tx: torch.ops.aten._dyn_quant_matmul_4bit(tx, tpk, groupsize, K, N),
                        int4_bytes,
                        {"min_iters": 1},
                    )
                txb = tx.to(torch.bfloat16)
                cells["torch _weight_int4pack_mm (bf16 x)"] = (
                    lambda txb=txb: torch.ops.aten._weight_int4pack_mm_for_cpu(txb, t4, groupsize, sz),
                    int4_bytes,
                    {},
                )
            # Interleaved rounds: every cell is timed once per round, and its time is the median of its
            # rounds, so that a slow spell of a shared CPU does not land on one row of the ratio alone.
            times = {name: [] for name in cells}
            for i in range(rounds):
                for name, (fn, _, kw) in cells.items():
                    times[name].append(_time(fn, budget_s=budget_s / rounds, warm_up=i == 0, **kw))
            r = {name: (float(np.median(times[name])), cells[name][1]) for name in cells}
            if "torch _dyn_quant_matmul_4bit" in r and M == 16:
                t_dyn_m16 = r["torch _dyn_quant_matmul_4bit"][0]
            if torch is not None and M > torch_dyn_max_m and t_dyn_m16 is not None:
                t4_row = r.pop("torch _weight_int4pack_mm (bf16 x)")
                r["torch _dyn_quant_matmul_4bit (est.)"] = (t_dyn_m16 * M / 16, int4_bytes)
                r["torch _weight_int4pack_mm (bf16 x)"] = t4_row
            rows.append(((K, N, M), r))
            _print_block((K, N, M), r, roofs)
    return rows


def _print_block(key, r, roofs=(None, None)):
    K, N, M = key
    copy_gbs, gemm_gflops = roofs
    f32 = r["dense f32 jnp.dot"][0]
    bf16 = r["dense bf16 jnp.dot"][0]
    tdyn = next((v[0] for k, v in r.items() if k.startswith("torch _dyn")), None)
    t4 = r.get("torch _weight_int4pack_mm (bf16 x)", (None,))[0]
    print(f"\nK={K} N={N} M={M}")
    print(
        f"  {'impl':38s} {'ms':>9s} {'GB/s':>7s} {'%copy':>6s} {'GFLOP/s':>8s} {'%gemm':>6s} "
        f"{'vs f32':>7s} {'vs bf16':>8s} {'vs t.dyn':>9s} {'vs t.i4pk':>9s}"
    )
    for name, (t, nbytes) in r.items():
        ratio = lambda ref: f"{ref / t:.2f}x" if ref else "-"
        gbs = nbytes / t / 1e9
        gflops = 2 * M * N * K / t / 1e9
        frac = lambda v, roof: f"{100 * v / roof:5.0f}%" if roof else "    -"
        print(
            f"  {name:38s} {t * 1e3:9.3f} {gbs:7.1f} {frac(gbs, copy_gbs):>6s} {gflops:8.1f} "
            f"{frac(gflops, gemm_gflops):>6s} {ratio(f32):>7s} {ratio(bf16):>8s} {ratio(tdyn):>9s} {ratio(t4):>9s}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M=1 only")
    ap.add_argument("--groupsize", type=int, default=128)
    ap.add_argument("--ms", type=int, nargs="*", default=None)
    ap.add_argument(
        "--torch-dyn-max-m",
        type=int,
        default=16,
        help="largest M to time torch's scalar _dyn_quant_matmul_4bit on (above: scaled estimate)",
    )
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per cell")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved timing rounds per cell (each gets budget / rounds; a cell's time is their median)",
    )
    a = ap.parse_args()
    ms = a.ms or ([1] if a.quick else [1, 16, 256])
    print(
        f"jax {jax.__version__}, devices {jax.devices()}, C++ kernel: {_cpp.isa()}, "
        f"torch: {getattr(torch, '__version__', 'absent')}, groupsize={a.groupsize}"
    )
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    roofs = measure_roofs(a.budget)
    print(f"roofs: memory copy {roofs[0]:.1f} GB/s (read + write), XLA float32 GEMM {roofs[1]:.1f} GFLOP/s")
    run(ms, [(4096, 4096), (4096, 11008)], a.groupsize, a.torch_dyn_max_m, a.budget, roofs, a.rounds)


if __name__ == "__main__":
    main()
