"""CPU attention benchmark: jbackends' flash against jax.nn (xla), torch's CPU SDPA and tokamax.

Rows ``jbackends flash`` (what FLASH runs on CPU by default: the C++ kernel through jax.ffi where it
is built, the ratios' base) and ``jbackends flash (xla)`` (the blockwise XLA fallback, flag
``flash_cpu_kernel="xla"``).

    python benchmarks/attention.py                      # L in {1k, 4k, 16k}, causal and not, fwd and fwd+bwd
    python benchmarks/attention.py --lengths 1024 4096 --repeats 5
    python benchmarks/attention.py --mask bool bias --dtype bfloat16   # masked / bf16 rows
    python benchmarks/attention.py --isa avx2            # the C++ kernel's AVX2 path (default: best)

Shapes follow the issue: float32, B=1, H=8 heads, D=64, self-attention, layout BTNH for JAX and
(B, H, L, D) for torch. Time is the median of ``--repeats`` runs (``--long-repeats`` for L > 4096)
after one warm-up (compile excluded), with the fastest and slowest run as the spread. ``--mask
bool`` adds a random boolean mask [1, 1, L, L] (70% kept, causal or not on top), ``--mask bias`` a
float bias of that shape, to every implementation (torch: ``attn_mask``). ``GFLOP/s`` counts
4 B H L^2 D per forward (half of it causal) and 3.5 times that for forward + backward; ``roof`` is
that rate over XLA's float32 matmul rate measured at the start (a 2048^3 ``jnp.dot``, the best of
10 runs; on a shared machine it reads low, and fractions above 100% mean just that).

Peak memory, and how it is measured:

* JAX rows: ``jax.jit(f).lower(...).compile().memory_analysis()``: the executable's temporary
  buffers plus its outputs (inputs excluded), i.e. what the call allocates at its peak. It needs no
  run, so jax.nn at 16k is reported even where running it would not fit (its time is then "-").
  Where the C++ flash kernel runs, its own allocations (``cpp_flash.workspace_bytes``) are added.
* torch rows: the growth of the resident set (``/proc/self/statm``, sampled every 0.5 ms) of a
  fresh subprocess during one call after a warm-up call (inputs allocated before). Memory the
  allocator kept from the warm-up is not counted again, so this is a lower bound of what the call
  needs; comparable in magnitude with the JAX numbers, not byte-exact.

Ratios are ``other / jbackends`` for both time and memory (> 1: jbackends is faster / smaller).
The machine is usually shared: rerun for stable numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

B, N, D = 1, 8, 64


def _jax_impls() -> dict:
    from jbackends import attention as jba

    import jbackends as jb  # noqa: PLC0415

    def flash_xla(q, k, v, c, **kw):
        with jb.with_backends(flash_cpu_kernel="xla"):
            return jba.dot_product_attention(q, k, v, is_causal=c, implementation="flash", **kw)

    impls = {
        "jbackends flash": lambda q, k, v, c, **kw: jba.dot_product_attention(
            q, k, v, is_causal=c, implementation="flash", **kw
        ),
        "jbackends flash (xla)": flash_xla,
        "jax.nn xla": lambda q, k, v, c, **kw: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="xla", **kw
        ),
    }
    try:
        import tokamax  # noqa: PLC0415
        from absl import flags as absl_flags  # noqa: PLC0415 - tokamax's dependency

        # tokamax reads its absl flags on first use and would parse this script's argv as its own.
        if not absl_flags.FLAGS.is_parsed():
            absl_flags.FLAGS.mark_as_parsed()

        impls["tokamax xla_chunked"] = lambda q, k, v, c, **kw: tokamax.dot_product_attention(
            q, k, v, is_causal=c, implementation="xla_chunked", **kw
        )
    except Exception:  # noqa: BLE001 - not installed / other API: column left out
        pass
    return impls


def _fn(impl: Callable, causal: bool, mode: str, extra: dict) -> Callable:
    if mode == "fwd":
        return lambda q, k, v: impl(q, k, v, causal, **extra)
    return jax.grad(
        lambda q, k, v: impl(q, k, v, causal, **extra).astype(jnp.float32).sum(), argnums=(0, 1, 2)
    )


def _timed(f: Callable[[], Any], repeats: int) -> tuple:
    """(median, fastest, slowest) of ``repeats`` runs after a warm-up."""
    f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), min(ts), max(ts)


def gemm_rate(repeats: int = 10, n: int = 2048) -> float:
    """XLA's float32 matmul rate here (FLOP/s): the best of ``repeats`` n^3 ``jnp.dot``."""
    rng = np.random.default_rng(1)
    a, b = (jnp.asarray(rng.normal(size=(n, n)), jnp.float32) for _ in range(2))
    f = jax.jit(lambda a, b: jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST))
    _, best, _ = _timed(lambda: jax.block_until_ready(f(a, b)), repeats)
    return 2.0 * n**3 / best


def flops(L: int, causal: bool, mode: str) -> float:
    f = 4.0 * B * N * L * L * D * (0.5 if causal else 1.0)
    return f if mode == "fwd" else 3.5 * f


def _extra(kind: str, L: int) -> dict:
    """The mask / bias operand of a row (jax.nn keyword -> array, [1, 1, L, L])."""
    if kind == "none":
        return {}
    rng = np.random.default_rng(2)
    if kind == "bool":
        return {"mask": jnp.asarray(rng.random((1, 1, L, L)) < 0.7)}
    return {"bias": jnp.asarray(rng.normal(size=(1, 1, L, L)), jnp.float32)}


def bench_jax(
    name: str,
    impl,
    L: int,
    causal: bool,
    mode: str,
    repeats: int,
    max_run_bytes: float,
    mask="none",
    dtype="float32",
) -> dict:
    x = jax.ShapeDtypeStruct((B, L, N, D), jnp.dtype(dtype))
    extra = _extra(mask, L)
    lowered = jax.jit(_fn(impl, causal, mode, extra)).lower(x, x, x)
    compiled = lowered.compile()
    ma = compiled.memory_analysis()
    mem = ma.temp_size_in_bytes + ma.output_size_in_bytes
    if "jb_flash_attention_" in lowered.as_text():
        # The C++ kernel's own allocations (packed k / v, tiles, dQ buffers) are not XLA buffers.
        from pallas_kernels.attention import cpp_flash  # noqa: PLC0415

        mem += cpp_flash.workspace_bytes(x.shape, x.shape, x.shape, backward=mode != "fwd", dtype=dtype)
    row = dict(impl=name, mem=mem, time=None, spread=None)
    if mem > max_run_bytes:
        return row
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, N, D)), jnp.float32).astype(dtype) for _ in range(3))
    med, lo, hi = _timed(lambda: jax.block_until_ready(compiled(q, k, v)), repeats)
    row.update(time=med, spread=(lo, hi))
    return row


_TORCH_CHILD = r"""
import json, os, sys, threading, time, torch
import numpy as np
L, causal, mode, repeats = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], int(sys.argv[4])
kind, dtype = sys.argv[5], getattr(torch, sys.argv[6])
g = mode != "fwd"
q, k, v = (torch.randn(1, 8, L, 64).to(dtype).requires_grad_(g) for _ in range(3))
rng = np.random.default_rng(2)
if kind == "bool":
    am = torch.from_numpy(rng.random((1, 1, L, L)) < 0.7)
    if causal:  # torch takes attn_mask or is_causal: the causal mask folded into the boolean one
        am = am & torch.ones(L, L, dtype=torch.bool).tril()
elif kind == "bias":
    am = torch.from_numpy(rng.normal(size=(1, 1, L, L)).astype(np.float32)).to(dtype)
    if causal:
        am = am.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
else:
    am = None
_F = torch.nn.functional.scaled_dot_product_attention
def F(q, k, v, is_causal):
    if am is None:
        return _F(q, k, v, is_causal=is_causal)
    return _F(q, k, v, attn_mask=am)
PAGE = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
def run():
    if g:
        F(q, k, v, is_causal=causal).float().sum().backward()
        q.grad = k.grad = v.grad = None
    else:
        with torch.no_grad():
            F(q, k, v, is_causal=causal)
run()  # warm-up (allocator pools, OpenMP threads)
base, peak, done = rss(), [0], [False]
def poll():
    while not done[0]:
        peak[0] = max(peak[0], rss()); time.sleep(0.0005)
th = threading.Thread(target=poll); th.start()
run()
done[0] = True; th.join()
mem = max(peak[0] - base, 0)
ts = []
for _ in range(repeats):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
print(json.dumps(dict(time=float(np.median(ts)), lo=min(ts), hi=max(ts), mem=mem, threads=torch.get_num_threads())))
"""


def bench_torch(
    L: int, causal: bool, mode: str, repeats: int, mask="none", dtype="float32"
) -> Optional[dict]:
    try:
        import torch  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001
        return None
    out = subprocess.run(
        [sys.executable, "-c", _TORCH_CHILD, str(L), "1" if causal else "0", mode, str(repeats), mask, dtype],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return dict(impl="torch sdpa (cpu)", time=None, mem=None, error=out.stderr[-300:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(impl="torch sdpa (cpu)", time=r["time"], spread=(r["lo"], r["hi"]), mem=r["mem"])


def _fmt_t(t):
    return "-" if t is None else f"{t * 1e3:9.1f}"


def _fmt_m(m):
    return "-" if m is None else f"{m / 2**20:9.1f}"


def _ratio(a, b):
    return "-" if (a is None or b is None or b == 0) else f"{a / b:6.2f}x"


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long-repeats", type=int, default=1, help="repeats for L > 4096")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    p.add_argument(
        "--max-run-gb",
        type=float,
        default=6.0,
        help="do not run a JAX executable needing more than this (memory is still reported)",
    )
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--mask", nargs="+", default=["none"], choices=["none", "bool", "bias"])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--isa", default="", help="the C++ flash kernel's code path (avx512, avx2, scalar)")
    a = p.parse_args(argv)
    impls = _jax_impls()
    from pallas_kernels.attention import cpp_flash  # noqa: PLC0415

    if a.isa and not cpp_flash.set_isa(a.isa):
        raise SystemExit(f"--isa {a.isa}: this CPU or build cannot run it")
    roof = gemm_rate()
    print(
        f"attention on {jax.devices()[0].platform}: B={B}, heads={N}, head_dim={D}; C++ kernel path "
        f"{cpp_flash.isa()}; time = median of {a.repeats} [fastest, slowest]; memory = JAX compiled "
        f"temp+output bytes / torch peak-RSS growth; XLA f32 GEMM roof {roof / 1e9:.1f} GFLOP/s"
    )
    rows = []
    combos = [
        (L, c == "yes", m, mk, dt)
        for L in a.lengths
        for c in a.causal
        for m in a.modes
        for mk in a.mask
        for dt in a.dtype
    ]
    for L, causal, mode, mask, dtype in combos:
        repeats = a.repeats if L <= 4096 else a.long_repeats
        res = [
            bench_jax(name, impl, L, causal, mode, repeats, a.max_run_gb * 2**30, mask, dtype)
            for name, impl in impls.items()
            if not (mask != "none" and name == "jbackends flash (xla)")  # FLASH's XLA code takes no mask
        ]
        t = None if a.no_torch else bench_torch(L, causal, mode, repeats, mask, dtype)
        if t is not None:
            res.append(t)
        ours = res[0]
        for r in res:
            r.update(
                L=L,
                causal=causal,
                mode=mode,
                time_ratio=None if r["time"] is None or ours["time"] is None else r["time"] / ours["time"],
                mem_ratio=None if r["mem"] is None or not ours["mem"] else r["mem"] / ours["mem"],
                mask=mask,
                dtype=dtype,
                gflops=None if r["time"] is None else flops(L, causal, mode) / r["time"] / 1e9,
            )
            r["roof"] = None if r["gflops"] is None else r["gflops"] * 1e9 / roof
        rows.extend(res)
        print(f"\nL={L:5d} causal={'yes' if causal else 'no ':3s} {mode} mask={mask} {dtype}")
        print(
            f"  {'implementation':22s} {'time ms':>9s} {'[fastest, slowest]':>19s} {'t/ours':>7s} "
            f"{'GFLOP/s':>8s} {'roof':>5s} {'peak MiB':>9s} {'m/ours':>7s}"
        )
        for r in res:
            sp = "" if not r.get("spread") else f"[{r['spread'][0] * 1e3:.1f}, {r['spread'][1] * 1e3:.1f}]"
            gf = "-" if r["gflops"] is None else f"{r['gflops']:8.1f}"
            rf = "-" if r["roof"] is None else f"{100 * r['roof']:4.0f}%"
            print(
                f"  {r['impl']:22s} {_fmt_t(r['time'])} {sp:>19s} {_ratio(r['time'], ours['time']):>7s} "
                f"{gf:>8s} {rf:>5s} {_fmt_m(r['mem'])} {_ratio(r['mem'], ours['mem']):>7s}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
