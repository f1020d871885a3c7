"""GPU int4 matmul benchmark: our W4A16 / W4A8 kernels against dense bf16 and torch's tinygemm, by M.

For (K x N) in {4096 x 4096, 4096 x 11008, 8192 x 28672} and M from decode (1) to prefill (2048),
groupsize 128 unless ``--groupsize``, it times (inside one jit, a ``fori_loop`` of dependent calls;
torch by CUDA events around back-to-back launches; see ``benchmarks/gpu_timing.py``):

* ``jb int4_matmul``: ``jb.quantized.int4_matmul`` (W4A16, bf16 activations; the engine dispatch picks),
* ``jb dyn-quant``: ``jb.quantized.dyn_quant_matmul_4bit`` (W4A8, torch's numerics),
* ``jb xla bf16``: the same call with the XLA engine pinned and bf16 operands
  (``implementation="xla", compute_dtype=bfloat16``: at M > 8, ``xla.SMALL_M``, the weight is
  dequantized by XLA and one dense bf16 GEMM runs, the candidate for prefill where our Pallas kernel
  trails dense bf16; at M <= 8 the XLA engine's fused float32 dots run and the bf16 label does not apply),
* ``dense bf16``: ``jnp.dot`` on the dequantized bf16 weight (what an int4 matmul should cost at
  prefill, and what it must beat at decode),
* ``torch int4pack``: ``torch.ops.aten._weight_int4pack_mm`` (tinygemm, bf16 activations) when torch
  with CUDA is importable, and ``torch dense bf16`` (``torch.mm``).

Columns: microseconds per call, GB/s of packed weight (``N * K / 2`` bytes plus scales, for the int4
rows), and the ratios to torch's int4 kernel and to dense bf16 (> 1: ours is faster). The engine each
jb row ran (``jb.quantized.explain``) is printed. Writes a markdown table (``--md``) and a PNG of time
vs M per shape (``--png``).

    python benchmarks/int4_gpu.py --md int4_gpu.md --png int4_gpu.png     # on an NVIDIA GPU
    python benchmarks/int4_gpu.py --smoke                                  # CPU: a check of the script
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jbackends.quantized as Q  # noqa: E402
from benchmarks.gpu_timing import jax_time, pyplot, ratio, torch_cuda, torch_time, write_table  # noqa: E402

SHAPES = ((4096, 4096), (4096, 11008), (8192, 28672))
MS = (1, 4, 16, 64, 256, 1024, 2048)
ROWS = ("jb int4_matmul", "jb dyn-quant", "jb xla bf16", "dense bf16", "torch int4pack", "torch dense bf16")


def torch_operands(torch, q_packed, scales, K, N, groupsize):
    """torch's tinygemm operands for our weight: ``w = (q - 8) * scale`` (zero 0)."""
    q = np.asarray(q_packed)  # [N, K/2]: the low nibble is the even k, stored q + 8
    lo, hi = q & 15, q >> 4
    u8 = torch.tensor((lo << 4) | hi, dtype=torch.uint8, device="cuda")  # tinygemm: the even k high
    w4 = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
    sz = torch.zeros(K // groupsize, N, 2, dtype=torch.float32)
    sz[..., 0] = torch.tensor(np.asarray(scales, np.float32)).T
    return w4, sz.to(torch.bfloat16).cuda()


#: (row, case, error) of every timing that failed: listed under the table; a failed jb row makes the
#: run exit 3.
FAILURES = []


def _failed(name, case, err):
    line = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    FAILURES.append((name, case, line))
    print(f"  {name} {case}: {line}", file=sys.stderr, flush=True)


def run(shapes, ms, groupsize, iters, use_torch, rows=None, on_row=None):
    """Times every (shape, M); appends each finished row to `rows` (a new list if None) and returns it, so
    that a caller interrupted part way keeps the rows done; ``on_row(rows)`` after each."""
    rng = np.random.default_rng(0)
    rows = [] if rows is None else rows
    for K, N in shapes:
        w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        q, s = Q.quantize_4bit(w, groupsize)
        packed = Q.dyn_quant_pack_4bit_weight(q, s, None, groupsize, K, N)
        wbf = jnp.asarray(Q.dequantize_4bit(packed)).T.astype(jnp.bfloat16)  # [K, N]
        int4_bytes = packed.nbytes
        torch = torch_cuda() if use_torch else None
        if torch is not None:
            try:
                w4, sz = torch_operands(torch, q, s, K, N, groupsize)
                tw = torch.from_dlpack(wbf)
            except Exception as e:  # noqa: BLE001 - no torch rows for this shape, the jb rows go on
                _failed("torch", f"operands K={K} N={N}", e)
                torch = None
        for M in ms:
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            xb = x.astype(jnp.bfloat16)
            r = {}
            for name, fn, args in (
                ("jb int4_matmul", lambda x, p: Q.int4_matmul(x, p), (xb, packed)),
                ("jb dyn-quant", lambda x, p: Q.dyn_quant_matmul_4bit(x, p, groupsize, K, N), (x, packed)),
                (
                    "jb xla bf16",
                    lambda x, p: Q.int4_matmul(x, p, compute_dtype=jnp.bfloat16, implementation="xla"),
                    (xb, packed),
                ),
                ("dense bf16", jnp.dot, (xb, wbf)),
            ):
                try:
                    # decode calls last ~10-100 us: 200 of them make a loop of >= 2 ms at once (no
                    # recompilation for a longer one, see gpu_timing.jax_time)
                    r[name] = jax_time(fn, args, iters=iters if M > 16 else max(iters, 200))
                except Exception as e:  # noqa: BLE001 - report, go on
                    _failed(name, f"K={K} N={N} M={M}", e)
                    r[name] = math.nan
            if torch is not None:
                tx = torch.from_dlpack(xb)
                try:
                    r["torch int4pack"] = torch_time(
                        lambda: torch.ops.aten._weight_int4pack_mm(tx, w4, groupsize, sz), iters=iters
                    )
                    got = torch.ops.aten._weight_int4pack_mm(tx, w4, groupsize, sz).float().cpu().numpy()
                    ours = np.asarray(Q.int4_matmul(xb, packed), np.float32)
                    err = np.linalg.norm(got - ours) / max(np.linalg.norm(ours), 1e-30)
                    if err > 2e-2:
                        print(
                            f"  note: torch int4pack differs from ours by {err:.2g} (layout?)",
                            file=sys.stderr,
                        )
                except Exception as e:  # noqa: BLE001
                    _failed("torch int4pack", f"K={K} N={N} M={M}", e)
                    r["torch int4pack"] = math.nan
                try:
                    r["torch dense bf16"] = torch_time(lambda: torch.mm(tx, tw), iters=iters)
                except Exception as e:  # noqa: BLE001
                    _failed("torch dense bf16", f"K={K} N={N} M={M}", e)
                    r["torch dense bf16"] = math.nan
            engines = {
                "jb int4_matmul": Q.explain(xb, packed, op="int4_matmul").implementation,
                "jb dyn-quant": Q.explain(x, packed, op="dyn_quant_matmul_4bit").implementation,
            }
            rows.append(((K, N, M), r, engines, int4_bytes))
            if on_row is not None:
                on_row(rows)
    return rows


def table(rows, groupsize, use_torch):
    names = [n for n in ROWS if use_torch or not n.startswith("torch")]
    dev = jax.devices()[0].device_kind
    tv = f", torch {torch_cuda().__version__}" if use_torch else ""
    lines = [
        f"int4 matmul on {dev}, groupsize {groupsize}, jax {jax.__version__}{tv}: microseconds per call "
        "(packed-weight GB/s for the jb rows); `vs torch` / `vs dense`: time ratios (> 1: jb faster).",
        "",
        "| K x N | M | "
        + " | ".join(names)
        + " | W4A16 vs torch | W4A16 vs dense | W4A8 vs W4A16 | engines |",
        "|" + "---|" * (len(names) + 6),
    ]
    for (K, N, M), r, engines, nbytes in rows:
        cells = []
        for n in names:
            t = r.get(n, math.nan)
            cell = f"{t * 1e6:.1f}" if t == t else "-"
            if n.startswith("jb") and t == t:
                cell += f" ({nbytes / t / 1e9:.0f} GB/s)"
            cells.append(cell)
        w16, w8 = r.get("jb int4_matmul", math.nan), r.get("jb dyn-quant", math.nan)
        lines.append(
            f"| {K}x{N} | {M} | "
            + " | ".join(cells)
            + f" | {ratio(r.get('torch int4pack', math.nan), w16)} | {ratio(r.get('dense bf16', math.nan), w16)}"
            + f" | {ratio(w16, w8)} | {engines['jb int4_matmul']} / {engines['jb dyn-quant']} |"
        )
    if FAILURES:
        lines += ["", "Failed (the first line of each error; the log has the rest):"]
        lines += [f"- {name}, {case}: {err}" for name, case, err in FAILURES]
    return "\n".join(lines), names


def write_png(rows, names, path, groupsize):
    plt = pyplot()
    if plt is None:
        return
    shapes = sorted({key[:2] for key, *_ in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.6), squeeze=False)
    for ax, (K, N) in zip(axes[0], shapes):
        sel = [(key[2], r) for key, r, *_ in rows if key[:2] == (K, N)]
        for n in names:
            ax.plot([m for m, _ in sel], [r.get(n, math.nan) * 1e6 for _, r in sel], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"K={K} N={N}", fontsize=9)
        ax.set_xlabel("M (rows of x)")
        ax.set_ylabel("microseconds (lower is better)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"int4 matmul, {jax.devices()[0].device_kind}, groupsize {groupsize}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groupsize", type=int, default=128)
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS))
    ap.add_argument("--shapes", nargs="+", default=None, help="KxN, e.g. 4096x11008")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--md", default=None)
    ap.add_argument("--png", default="int4_gpu.png")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script: tiny shapes")
    a = ap.parse_args(argv)
    FAILURES.clear()  # this run's
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes] if a.shapes else list(SHAPES)
    if a.smoke:
        shapes, a.ms, a.iters, a.no_torch = [(256, 128)], [1, 16], 2, True
    elif jax.default_backend() != "gpu":
        sys.exit("int4_gpu.py needs a GPU (or pass --smoke for a CPU check of the script)")
    use_torch = not a.no_torch and torch_cuda() is not None
    rows = []
    total = len(shapes) * len(a.ms)

    def on_row(rows):
        """Each finished row: its table line to stderr at once and the markdown file rewritten, so that
        a run killed mid-compile (a time limit's SIGKILL) keeps the rows done before it."""
        text, _ = table(rows, a.groupsize, use_torch)
        print("  row: " + text.split("\n")[3 + len(rows)], file=sys.stderr, flush=True)
        if a.md:
            write_table(a.md, text + f"\n\n(in progress: {len(rows)} of {total} rows so far)")

    interrupted = False
    try:
        run(shapes, a.ms, a.groupsize, a.iters, use_torch, rows, on_row)
    except KeyboardInterrupt:  # a time limit's SIGINT (benchmarks/gpu_session.sh): keep the rows done
        interrupted = True
        print(f"interrupted after {len(rows)} rows: writing those", file=sys.stderr, flush=True)
    if interrupted and not rows:
        sys.exit(130)
    text, names = table(rows, a.groupsize, use_torch)
    if interrupted:
        text += f"\n\n(interrupted: {len(rows)} of {total} rows)"
    print("\n" + text)
    if a.md:
        write_table(a.md, text)
    write_png(rows, names, a.png, a.groupsize)
    if interrupted:
        sys.exit(130)
    if any(name.startswith("jb") for name, _, _ in FAILURES):
        sys.exit(3)  # one of our kernels failed somewhere: the summary must not say exit 0
    return rows


if __name__ == "__main__":
    main()
