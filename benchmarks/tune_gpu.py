"""GPU tuning sweep: how far the Pallas kernels' default configs are from the best one on this card.

For a few representative calls (the Mosaic GPU flash kernels on sm90: their defaults with and without
``block_ranges`` on packed sequences, then the backward and forward, then the Triton
kernels' attention forward / backward, at head dims 64 and 128, L = 4k; decode at 128k keys; the int4
W4A16 / W4A8 kernels at decode and prefill on 8192 x 28672, a weight larger than L2) it times the
config the kernel picks by itself (``Config.heuristics``) and the candidates of its
search space (``Config.search_space``; for int4 with ``options=True``, the options not yet measured),
each in one jitted loop of dependent calls lasting at least ``--min-loop-ms``
(``pallas_kernels.timing.loop_time``, as the autotuner does), and prints the default, the fastest and
their ratio. Inputs are made on the device when a call's turn comes. Where the search space is larger than
``--max-candidates`` it walks it by coordinates instead: the configs one field away from the default,
then one field away from the best of those. A config that does not compile or fit is counted, not
fatal. The result says where the heuristics leave speed on the table and which config to put there
(``pallas_kernels/attention/mosaic_flash.py``, ``pallas_kernels/attention/triton_tuning.py``,
``pallas_kernels/int4_matmul/triton_config.py``). The Mosaic GPU cases need an sm90 GPU (skipped
elsewhere, and under ``--smoke``: its GPU interpreter is too slow for a sweep on CPU).

    python benchmarks/tune_gpu.py --md tune_gpu.md                     # on an NVIDIA GPU (--budget-s 170)
    python benchmarks/tune_gpu.py --cases flash_bwd int4_w4a16         # a subset
    python benchmarks/tune_gpu.py --cases mosaic_ranges                # block_ranges on packed sequences
    python benchmarks/tune_gpu.py --smoke                              # CPU: a check of this script
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

_START = time.monotonic()  # --budget-s counts from here: the imports and JAX's start-up count too

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.gpu_timing import write_table  # noqa: E402
from pallas_kernels.attention import autotune, base, mosaic_flash  # noqa: E402
from pallas_kernels.int4_matmul import base as int4_base, triton_config as int4_config  # noqa: E402

#: In the order they run (the largest gaps measured first: the Mosaic GPU flash kernels against cuDNN,
#: 0.85-0.96x forward+backward and 0.92-1.02x forward on an H200; int4 decode against torch's
#: tinygemm; the Triton attention backward against FA2), so that a spent --budget-s leaves out the
#: least useful.
#: ``mosaic_ranges`` (first: four calls of two configs each) times the Mosaic GPU kernels' defaults with
#: and without ``block_ranges`` on packed sequences (stream and walk only the blocks a tile can see; off
#: by default until measured: packed segments ran at 0.49x of the plain speed without it).
CASES = ("mosaic_ranges", "mosaic_bwd", "mosaic", "int4_w4a16", "flash_bwd", "flash", "decode", "int4_w4a8")
MOSAIC_CASES = ("mosaic_ranges", "mosaic_bwd", "mosaic")


@dataclasses.dataclass
class Case:
    """One call to tune. ``build()`` makes its inputs on the device when the call's turn comes (not all
    up front: the int4 weights alone are 235M parameters) and returns ``(subject, operands, make_fn)``:
    what ``heuristics`` / ``search_space`` look at (``AttentionArgs`` or an ``Int4Call``), the timed
    operands, and ``config -> jitted function of the operands``."""

    name: str
    label: str
    config_cls: type
    build: object
    priority: int = 0  # within one kernel, lower runs first (decode rows, head dim 128)
    space_options: dict = dataclasses.field(default_factory=dict)  # extra search_space keywords


def _normal(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _attention_cases(smoke: bool, interpret: bool) -> list:
    out = []
    shapes = [(128, 4096), (64, 4096)] if not smoke else [(16, 32)]
    for kernel in ("flash", "flash_bwd"):
        for H, L in shapes:
            for causal in (False, True):

                def build(kernel=kernel, H=H, L=L, causal=causal):
                    B, N = (max(1, 16384 // L), max(1, 2048 // H)) if not smoke else (1, 2)
                    keys = jax.random.split(jax.random.key(H + L + causal), 3)
                    q, k, v = (_normal(kk, (B, L, N, H), jnp.bfloat16) for kk in keys)
                    args = base.make_args(q, k, v, is_causal=causal)
                    return args, (args,), lambda cfg: autotune.runner(kernel, args, cfg, interpret)

                what = "fwd" if kernel == "flash" else "bwd (after the default fwd)"
                label = f"{kernel} {what} H={H} L={L}{' causal' if causal else ''}"
                out.append(
                    Case(kernel, label, autotune.CONFIGS[kernel], build, priority=0 if H >= 128 else 1)
                )
    B, N, K, H, S = (4, 32, 8, 128, 131072) if not smoke else (1, 4, 2, 16, 64)

    def build_decode():
        kq, kk, kv = jax.random.split(jax.random.key(7), 3)
        q = _normal(kq, (B, 1, N, H), jnp.bfloat16)
        k, v = (_normal(x, (B, S, K, H), jnp.bfloat16) for x in (kk, kv))
        args = base.make_args(q, k, v)
        return args, (args,), lambda cfg: autotune.runner("decode", args, cfg, interpret)

    out.append(Case("decode", f"decode S={S} GQA {N}/{K}", autotune.CONFIGS["decode"], build_decode))
    return out


class MosaicForward:
    """``mosaic_flash.Config`` as :func:`tune` takes a config class (of the call's ``AttentionArgs``)."""

    @staticmethod
    def heuristics(args):
        return mosaic_flash.Config.heuristics(args.head_dim, bias=args.bias is not None)

    @staticmethod
    def search_space(args, overlap: bool = True):
        return mosaic_flash.Config.search_space(args, overlap=overlap)


class MosaicBackward:
    """``mosaic_flash.BwdConfig`` as :func:`tune` takes a config class (its default: ``BwdConfig()``)."""

    @staticmethod
    def heuristics(args):
        del args
        return mosaic_flash.BwdConfig()

    @staticmethod
    def search_space(args):
        return mosaic_flash.BwdConfig.search_space(args)


class _BlockRanges:
    """A config class whose space is its base's default with and without ``block_ranges``."""

    base: type

    @classmethod
    def heuristics(cls, args):
        return cls.base.heuristics(args)

    @classmethod
    def search_space(cls, args):
        default = cls.base.heuristics(args)
        return [default, dataclasses.replace(default, block_ranges=True)]


class MosaicForwardRanges(_BlockRanges):
    base = MosaicForward


class MosaicBackwardRanges(_BlockRanges):
    base = MosaicBackward


def mosaic_runner(kernel: str, config) -> object:
    """The jitted function timed for a Mosaic GPU case: ``args -> forward`` under ``config``, or
    (``mosaic_bwd``) ``(args, out, lse, d_out) -> the dQ and dK / dV kernels`` under it (the forward
    run once, outside the timed loop)."""
    if kernel == "mosaic":
        return jax.jit(lambda a: mosaic_flash.forward(a, config=config))
    if kernel == "mosaic_bwd":
        return jax.jit(lambda a, out, lse, d_out: mosaic_flash.backward(a, out, lse, d_out, config=config))
    raise ValueError(f"`kernel` must be one of {MOSAIC_CASES}; got {kernel!r}")


def _mosaic_cases(overlap: bool = True) -> list:
    out = []
    no_causal = mosaic_unsupported(causal=True)  # e.g. the ptxas of CUDA 12.8 / 12.9
    if no_causal:
        print(f"  skipped the causal Mosaic GPU cases: {no_causal[0]}", file=sys.stderr)
    for kernel, config_cls in (("mosaic_bwd", MosaicBackward), ("mosaic", MosaicForward)):
        for H, L in ((128, 4096), (64, 4096)):
            for causal in (False, True) if not no_causal else (False,):

                def build(kernel=kernel, H=H, L=L, causal=causal):
                    B, N = max(1, 16384 // L), max(1, 2048 // H)
                    keys = jax.random.split(jax.random.key(H + L + causal), 4)
                    q, k, v, g = (_normal(kk, (B, L, N, H), jnp.bfloat16) for kk in keys)
                    args = base.make_args(q, k, v, is_causal=causal)
                    if kernel == "mosaic":
                        operands = (args,)
                    else:  # the backward alone: the forward's outputs made once
                        operands = (args, *jax.jit(mosaic_flash.forward)(args), g)
                    return args, operands, lambda cfg: mosaic_runner(kernel, cfg)

                what = "fwd" if kernel == "mosaic" else "bwd (alone, on the default fwd's outputs)"
                label = f"{kernel} {what} H={H} L={L}{' causal' if causal else ''}"
                options = dict(overlap=overlap) if kernel == "mosaic" else {}
                case = Case(
                    kernel, label, config_cls, build, priority=0 if H >= 128 else 1, space_options=options
                )
                out.append(case)
    return out


def _mosaic_ranges_cases() -> list:
    """``mosaic_ranges``: the backward, then the forward, at head dim 128, L = 4k, 4 packed sequences of
    1k per row (as the benchmark's segments row), causal and not, each under its default config with
    and without ``block_ranges``."""
    out = []
    no_causal = mosaic_unsupported(causal=True)
    for kernel, config_cls in (("mosaic_bwd", MosaicBackwardRanges), ("mosaic", MosaicForwardRanges)):
        for causal in (False, True) if not no_causal else (False,):

            def build(kernel=kernel, causal=causal, H=128, L=4096):
                B, N = 16384 // L, 2048 // H
                keys = jax.random.split(jax.random.key(7 + causal), 4)
                q, k, v, g = (_normal(kk, (B, L, N, H), jnp.bfloat16) for kk in keys)
                ids = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32) * 4 // L, (B, L))
                args = base.make_args(q, k, v, is_causal=causal, q_segment_ids=ids, kv_segment_ids=ids)
                if kernel == "mosaic":
                    operands = (args,)
                else:  # the backward alone, on the default forward's outputs
                    operands = (args, *jax.jit(mosaic_flash.forward)(args), g)
                return args, operands, lambda cfg: mosaic_runner(kernel, cfg)

            what = "fwd" if kernel == "mosaic" else "bwd (alone)"
            label = f"mosaic_ranges {what} H=128 L=4096 4 segments{' causal' if causal else ''}"
            out.append(
                Case("mosaic_ranges", label, config_cls, build, priority=0 if kernel == "mosaic_bwd" else 1)
            )
    return out


def mosaic_unsupported(causal: bool = False) -> list:
    """Why the Mosaic GPU cases (``causal``: the causal ones) cannot run on this machine (empty: they can)."""
    x = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    return mosaic_flash.unsupported(base.make_args(x, x, x, is_causal=causal), "cuda")


def _int4_cases(smoke: bool, interpret: bool) -> list:
    from jbackends import quantized as Q  # noqa: PLC0415

    # 8192 x 28672 only: its 117 MB of packed weight is larger than the GPU's L2 (50-60 MB), so repeated
    # calls read it from memory as a model's decode would (a 4096 x 11008 weight, 22 MB, stays in L2).
    K, N, ms = (8192, 28672, (1, 16, 256)) if not smoke else (256, 128, (1, 32))
    weights = {}

    def packed():
        if "p" not in weights:  # made once, on first use
            w = _normal(jax.random.key(1), (N, K), jnp.float32, 0.02)
            q4, s = Q.quantize_4bit(w, 128)
            weights["p"] = Q.dyn_quant_pack_4bit_weight(q4, s, None, 128, K, N)
        return weights["p"]

    out = []
    for M in ms:
        for name, op, dtype in (
            ("int4_w4a16", "weight_only", jnp.bfloat16),
            ("int4_w4a8", "dyn_quant", jnp.float32),
        ):
            if name == "int4_w4a8" and M == 16:
                continue

            def build(M=M, op=op, dtype=dtype):
                p = packed()
                x = _normal(jax.random.key(M), (M, K), dtype)
                return (
                    int4_base.Int4Call.of(op, x, p),
                    (x, p),
                    lambda cfg: autotune.int4_runner(op, cfg, interpret),
                )

            out.append(
                Case(
                    name,
                    f"{name} {K}x{N} M={M}",
                    int4_config.Config,
                    build,
                    priority=0 if M == 1 else 1 if M <= 16 else 2,
                    space_options=dict(options=True),
                )
            )
    return out


def _distance(a, b) -> int:
    return sum(getattr(a, f.name) != getattr(b, f.name) for f in dataclasses.fields(a))


def _neighbours(center, space) -> list:
    return [c for c in space if _distance(c, center) == 1]


def tune(
    case: Case, *, max_candidates: int, iters: int, repeats: int, deadline: float, min_loop_s: float
) -> dict:
    """Times the default config and the search (all of the space, or two coordinate rounds) of ``case``;
    returns the row. Stops starting candidates at ``deadline`` (``time.monotonic()``). Interrupted
    (SIGINT), it raises :class:`Interrupted` carrying the row of what was timed so far."""
    subject, operands, make_fn = case.build()
    default = case.config_cls.heuristics(subject)
    space = case.config_cls.search_space(subject, **case.space_options)
    timed: dict = {}
    walk = "all" if len(space) <= max_candidates else "coordinates"

    def row():
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

    def run(cfgs):
        for cfg in [c for c in cfgs if c not in timed]:
            if time.monotonic() > deadline:
                return
            ((c, t, err),) = autotune.timings(
                make_fn, [cfg], operands, repeats=repeats, iters=iters, min_loop_s=min_loop_s
            )
            timed[c] = t if t is not None else math.nan
            # each time as soon as it is measured: a run killed mid-compile keeps them in its log
            us = f"{t * 1e6:.1f} us" if t is not None else f"failed: {(err or '')[:160]}"
            print(f"  {case.label}: {_fmt_cfg(c)}: {us}", file=sys.stderr, flush=True)

    try:
        run([default])
        if walk == "all":
            run(space)
        else:
            run(_neighbours(default, space))
            ok = {c: t for c, t in timed.items() if t == t}
            best = min(ok, key=ok.get) if ok else default
            if best != default:
                run(_neighbours(best, space))
    except KeyboardInterrupt:
        raise Interrupted(row()) from None
    return row()


class Interrupted(KeyboardInterrupt):
    """A SIGINT during :func:`tune`, with the row of the configs timed until then."""

    def __init__(self, row):
        super().__init__()
        self.row = row


def _fmt_cfg(cfg) -> str:
    if cfg is None:
        return "-"
    return " ".join(
        f"{f.name.replace('num_', '').replace('block_', 'b')}={getattr(cfg, f.name)}"
        for f in dataclasses.fields(cfg)
    )


def table(rows, device: str) -> str:
    lines = [
        f"Pallas kernel configs on {device}, jax {jax.__version__}: microseconds per call (in-jit loop), "
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
    p.add_argument("--iters", type=int, default=40, help="calls per timed loop (more: see --min-loop-ms)")
    p.add_argument("--min-loop-ms", type=float, default=2.0, help="a shorter loop is recompiled longer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--budget-s",
        type=float,
        default=170.0,
        help="no candidate starts after this many seconds from the process start",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="leave mosaic_flash.Config(overlap=True) out of the forward's space (e.g. where its GPU-lane "
        "test did not pass)",
    )
    p.add_argument("--md", default=None, help="also write the table as markdown to this file")
    p.add_argument(
        "--smoke", action="store_true", help="CPU check of the script: tiny shapes, interpret mode"
    )
    a = p.parse_args(argv)
    if a.max_candidates < 1 or a.iters < 1 or a.repeats < 1 or not a.min_loop_ms >= 0:
        p.error("--max-candidates, --iters and --repeats must be >= 1, --min-loop-ms >= 0")
    interpret = a.smoke
    if a.smoke:
        a.iters, a.repeats, a.max_candidates, a.min_loop_ms = 1, 1, 2, 0.0
    elif jax.default_backend() != "gpu":
        sys.exit("tune_gpu.py needs a GPU (or pass --smoke for a CPU check of the script)")
    cases = []
    if set(MOSAIC_CASES) & set(a.cases):
        why = ["under --smoke (a CPU check)"] if a.smoke else mosaic_unsupported()
        if why:
            print(f"  skipped the Mosaic GPU cases: {'; '.join(why)}", file=sys.stderr)
        else:
            cases += _mosaic_cases(overlap=not a.no_overlap) + _mosaic_ranges_cases()
    if {"flash", "flash_bwd", "decode"} & set(a.cases):
        cases += _attention_cases(a.smoke, interpret)
    if {"int4_w4a16", "int4_w4a8"} & set(a.cases):
        cases += _int4_cases(a.smoke, interpret)
    cases = sorted((c for c in cases if c.name in a.cases), key=lambda c: (CASES.index(c.name), c.priority))
    deadline = (_START if argv is None else time.monotonic()) + a.budget_s
    rows, interrupted = [], False
    try:
        for case in cases:
            if time.monotonic() > deadline:
                break
            rows.append(
                tune(
                    case,
                    max_candidates=a.max_candidates,
                    iters=a.iters,
                    repeats=a.repeats,
                    deadline=deadline,
                    min_loop_s=a.min_loop_ms / 1e3,
                )
            )
            text = table(rows, jax.devices()[0].device_kind)
            print("  row: " + text.split("\n")[-1], file=sys.stderr, flush=True)
            if a.md:  # rewritten after each call: a run killed mid-compile keeps the calls done
                write_table(a.md, text + f"\n\n(in progress: {len(rows)} of {len(cases)} calls so far)")
    except Interrupted as e:  # a time limit's SIGINT (benchmarks/gpu_session.sh): keep what was timed
        interrupted = True
        if e.row["tried"]:
            rows.append(dict(e.row, walk=e.row["walk"] + ", cut short"))
    except KeyboardInterrupt:
        interrupted = True
    text = table(rows, jax.devices()[0].device_kind)
    if interrupted:
        text += f"\n\n(interrupted: {len(rows)} of {len(cases)} calls, the last one partly)"
    elif len(rows) < len(cases):
        text += f"\n\n(--budget-s spent: {len(rows)} of {len(cases)} calls)"
    print("\n" + text)
    if a.md:
        write_table(a.md, text)
    if interrupted:
        sys.exit(130)
    return rows


if __name__ == "__main__":
    main()
