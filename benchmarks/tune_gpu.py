"""GPU tuning sweep: how far the Pallas Triton kernels' default configs are from the best one on this card.

For a few representative calls (attention forward / backward at head dims 64 and 128, L = 4k; decode at
128k keys; the int4 W4A16 / W4A8 kernels at decode and prefill on the large Llama shapes) it times the
config the kernel picks by itself (``Config.heuristics``) and the candidates of its search space
(``Config.search_space``), each inside one jit (``pallas_kernels.timing.loop_time``, as the autotuner
does), and prints the default, the fastest and their ratio. Where the search space is larger than
``--max-candidates`` it walks it by coordinates instead: the configs one field away from the default,
then one field away from the best of those. A config that does not compile or fit is counted, not
fatal. The result says where the heuristics leave speed on the table and which config to put there
(``pallas_kernels/attention/triton_tuning.py``, ``pallas_kernels/int4_matmul/triton_config.py``).

    python benchmarks/tune_gpu.py --md tune_gpu.md                     # on an NVIDIA GPU (<= --budget-s, 240)
    python benchmarks/tune_gpu.py --cases flash_bwd int4_w4a16         # a subset
    python benchmarks/tune_gpu.py --smoke                              # CPU: a check of this script
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.attention import autotune, base  # noqa: E402
from pallas_kernels.int4_matmul import base as int4_base, triton_config as int4_config  # noqa: E402

#: In the order they run (the largest gaps measured first: int4 decode against torch's tinygemm, then the
#: attention backward against FA2), so that a spent --budget-s leaves out the least useful.
CASES = ("int4_w4a16", "flash_bwd", "flash", "decode", "int4_w4a8")


@dataclasses.dataclass
class Case:
    """One call to tune: ``kernel`` names the config class and runner; ``operands`` are what it runs on."""

    name: str
    label: str
    config_cls: type
    subject: object  # AttentionArgs, or an Int4Call (what heuristics / search_space look at)
    make_fn: object  # config -> jitted function of the operands
    operands: tuple
    priority: int = 0  # within one kernel, lower runs first (decode rows, head dim 128)


def _attention_cases(smoke: bool, interpret: bool, rng) -> list:
    out = []
    shapes = [(128, 4096), (64, 4096)] if not smoke else [(16, 32)]
    for kernel in ("flash", "flash_bwd"):
        for H, L in shapes:
            for causal in (False, True):
                B, N = (max(1, 16384 // L), max(1, 2048 // H)) if not smoke else (1, 2)
                q, k, v = (jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.bfloat16) for _ in range(3))
                args = base.make_args(q, k, v, is_causal=causal)
                out.append(
                    Case(
                        kernel,
                        f"{kernel} H={H} L={L}{' causal' if causal else ''}",
                        autotune.CONFIGS[kernel],
                        args,
                        lambda cfg, kernel=kernel, args=args: autotune.runner(kernel, args, cfg, interpret),
                        (args,),
                        priority=0 if H >= 128 else 1,
                    )
                )
    B, N, K, H, S = (4, 32, 8, 128, 131072) if not smoke else (1, 4, 2, 16, 64)
    q = jnp.asarray(rng.normal(size=(B, 1, N, H)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.bfloat16) for _ in range(2))
    args = base.make_args(q, k, v)
    out.append(
        Case(
            "decode",
            f"decode S={S} GQA {N}/{K}",
            autotune.CONFIGS["decode"],
            args,
            lambda cfg, args=args: autotune.runner("decode", args, cfg, interpret),
            (args,),
        )
    )
    return out


def _int4_cases(smoke: bool, interpret: bool, rng) -> list:
    from jbackends import quantized as Q  # noqa: PLC0415

    out = []
    plan = [(8192, 28672, (1, 16, 256)), (4096, 11008, (1, 256))] if not smoke else [(256, 128, (1, 32))]
    for K, N, ms in plan:
        w = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        q4, s = Q.quantize_4bit(w, 128)
        packed = Q.dyn_quant_pack_4bit_weight(q4, s, None, 128, K, N)
        for M in ms:
            for name, op, dtype in (
                ("int4_w4a16", "weight_only", jnp.bfloat16),
                ("int4_w4a8", "dyn_quant", jnp.float32),
            ):
                if name == "int4_w4a8" and M == 16:
                    continue
                x = jnp.asarray(rng.standard_normal((M, K)), dtype)
                call = int4_base.Int4Call.of(op, x, packed)
                out.append(
                    Case(
                        name,
                        f"{name} {K}x{N} M={M}",
                        int4_config.Config,
                        call,
                        lambda cfg, op=op: autotune.int4_runner(op, cfg, interpret),
                        (x, packed),
                        priority=0 if M == 1 else 1 if M <= 16 else 2,
                    )
                )
    return out


def _distance(a, b) -> int:
    return sum(getattr(a, f.name) != getattr(b, f.name) for f in dataclasses.fields(a))


def _neighbours(center, space) -> list:
    return [c for c in space if _distance(c, center) == 1]


def tune(case: Case, *, max_candidates: int, iters: int, repeats: int, deadline: float) -> dict:
    """Times the default config and the search (all of the space, or two coordinate rounds) of ``case``;
    returns the row. Stops starting candidates at ``deadline`` (``time.monotonic()``)."""
    default = case.config_cls.heuristics(case.subject)
    space = case.config_cls.search_space(case.subject)
    timed: dict = {}

    def run(cfgs):
        todo = [c for c in cfgs if c not in timed]
        for cfg in todo:
            if time.monotonic() > deadline:
                return
            ((c, t, err),) = autotune.timings(
                case.make_fn, [cfg], case.operands, repeats=repeats, iters=iters
            )
            timed[c] = t if t is not None else math.nan
            if err is not None:
                print(f"  {case.label}: {cfg}: {err[:160]}", file=sys.stderr)

    run([default])
    if len(space) <= max_candidates:
        run(space)
        walk = "all"
    else:
        run(_neighbours(default, space))
        ok = {c: t for c, t in timed.items() if t == t}
        best = min(ok, key=ok.get) if ok else default
        if best != default:
            run(_neighbours(best, space))
        walk = "coordinates"
    ok = {c: t for c, t in timed.items() if t == t}
    best = min(ok, key=ok.get) if ok else None
    return dict(
        label=case.label,
        default=default,
        t_default=timed.get(default, math.nan),
        best=best,
        t_best=ok.get(best, math.nan) if best is not None else math.nan,
        tried=len(timed),
        failed=sum(1 for t in timed.values() if t != t),
        space=len(space),
        walk=walk,
    )


def _fmt_cfg(cfg) -> str:
    if cfg is None:
        return "-"
    return " ".join(
        f"{f.name.replace('num_', '').replace('block_', 'b')}={getattr(cfg, f.name)}"
        for f in dataclasses.fields(cfg)
    )


def table(rows, device: str) -> str:
    lines = [
        f"Pallas Triton configs on {device}, jax {jax.__version__}: microseconds per call (in-jit loop), "
        "the kernel's default config against the fastest found; `gain` = default time / best time.",
        "",
        "| call | default config | us | best config | us | gain | tried (failed) of space |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gain = r["t_default"] / r["t_best"] if r["t_best"] == r["t_best"] and r["t_best"] > 0 else math.nan
        lines.append(
            f"| {r['label']} | {_fmt_cfg(r['default'])} | {r['t_default'] * 1e6:.1f} | {_fmt_cfg(r['best'])} | "
            f"{r['t_best'] * 1e6:.1f} | {gain:.2f}x | {r['tried']} ({r['failed']}) of {r['space']}, {r['walk']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--max-candidates", type=int, default=12, help="above this, a coordinate walk")
    p.add_argument("--iters", type=int, default=10, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--budget-s", type=float, default=600.0, help="no candidate starts after this many seconds"
    )
    p.add_argument("--md", default=None, help="also write the table as markdown to this file")
    p.add_argument(
        "--smoke", action="store_true", help="CPU check of the script: tiny shapes, interpret mode"
    )
    a = p.parse_args(argv)
    if a.max_candidates < 1 or a.iters < 1 or a.repeats < 1:
        p.error("--max-candidates, --iters and --repeats must be >= 1")
    interpret = a.smoke
    if a.smoke:
        a.iters, a.repeats, a.max_candidates = 1, 1, 2
    elif jax.default_backend() != "gpu":
        sys.exit("tune_gpu.py needs a GPU (or pass --smoke for a CPU check of the script)")
    rng = np.random.default_rng(0)
    cases = []
    if {"flash", "flash_bwd", "decode"} & set(a.cases):
        cases += _attention_cases(a.smoke, interpret, rng)
    if {"int4_w4a16", "int4_w4a8"} & set(a.cases):
        cases += _int4_cases(a.smoke, interpret, rng)
    cases = sorted((c for c in cases if c.name in a.cases), key=lambda c: (CASES.index(c.name), c.priority))
    deadline = time.monotonic() + a.budget_s
    rows, interrupted = [], False
    try:
        for case in cases:
            if time.monotonic() > deadline:
                break
            rows.append(
                tune(
                    case, max_candidates=a.max_candidates, iters=a.iters, repeats=a.repeats, deadline=deadline
                )
            )
            print(f"  done {case.label}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # a time limit's SIGINT (benchmarks/gpu_session.sh): keep the rows done
        interrupted = True
    text = table(rows, jax.devices()[0].device_kind)
    if interrupted:
        text += f"\n\n(interrupted: {len(rows)} of {len(cases)} calls)"
    elif len(rows) < len(cases):
        text += f"\n\n(--budget-s spent: {len(rows)} of {len(cases)} calls)"
    print("\n" + text)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(text + "\n")
    if interrupted:
        sys.exit(130)
    return rows


if __name__ == "__main__":
    main()
