"""GPU attention benchmark: what `jb.dot_product_attention` gives by default, against every peer on the card.

Rows (bf16 unless ``--dtype``), each timed inside one jit (a ``fori_loop`` of dependent calls; torch by
CUDA events around back-to-back launches; see ``benchmarks/gpu_timing.py``):

* ``jb``: ``jb.dot_product_attention`` with no flags (the default dispatch: ``jb.explain`` says which
  backend runs; the last column names it),
* ``jb_pallas``: the same call with FLASH alone and ``flash_cuda_kernel="triton"`` (our Pallas Triton
  flash / decode kernels),
* ``jb_mosaic``: the same call with FLASH alone and ``flash_cuda_kernel="mosaic"`` (our Pallas Mosaic GPU
  FlashAttention-3 kernels, sm90, forward and backward),
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``,
* ``jax_xla``: ``jax.nn.dot_product_attention(implementation="xla")`` (quadratic memory: L <= 4k),
* ``mgpu_example``: jax's example Pallas Mosaic GPU kernel (``attention_mgpu``; sm90, head dims
  multiple of 64, no causal backward, float16 only: it runs on float16 copies of the inputs) when
  importable,
* ``tokamax``: ``tokamax.dot_product_attention(implementation="triton")`` when installed,
* ``torch_flash``, ``torch_cudnn``, ``torch_efficient``: ``torch.nn.functional.scaled_dot_product_attention``
  under ``sdpa_kernel(<backend>)`` when torch with CUDA is importable.

Sections: training shapes (head dims, lengths, causal and not, ``fwd`` and ``fwd+bwd``; batch x length
fixed at ``--tokens``, heads x head dim at ``--model-dim``) and decode (one query row, GQA, KV lengths up
to 128k). FLOPs follow the FlashAttention papers: forward ``4 B N T S H`` (halved under a causal mask),
backward 2.5x the forward. Prints TFLOP/s, the ratio of ``jb`` to the best of ``cudnn`` / ``jb_pallas`` /
``jb_mosaic``
(the "never slower than what you could pick yourself" check), writes a markdown table (``--md``) and a
PNG (``--png``, needs matplotlib).

Usage (on an NVIDIA GPU; ~8 minutes for ``--quick``)::

    python benchmarks/attention_gpu.py --quick --md attention_gpu.md --png attention_gpu.png
    python benchmarks/attention_gpu.py                       # the full sweep (long: run in parts)
    python benchmarks/attention_gpu.py --head-dims 128 --lengths 4096 16384 --modes fwd+bwd
    python benchmarks/attention_gpu.py --smoke               # CPU: a check of this script, no timing value
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jbackends as jb  # noqa: E402
from benchmarks.gpu_timing import jax_time, pyplot, ratio, torch_cuda, torch_time, write_table  # noqa: E402
from pallas_kernels.attention import base, mosaic_flash, triton_flash  # noqa: E402

JAX_IMPLS = ("jb", "jb_pallas", "jb_mosaic", "cudnn", "jax_xla", "mgpu_example", "tokamax")
TORCH_IMPLS = ("torch_flash", "torch_cudnn", "torch_efficient")


# ---- the JAX rows: (q, k, v, causal) -> out ----------------------------------------------------------


def _jb(q, k, v, causal):
    return jb.dot_product_attention(q, k, v, is_causal=causal)


def _jax_nn(impl):
    return lambda q, k, v, causal: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl
    )


def _interpreted_pallas(q, k, v, causal):  # --smoke only: the Triton kernel in interpret mode on CPU
    return triton_flash.attention(base.make_args(q, k, v, is_causal=causal), interpret=True)[0]


def _mgpu_example():
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as m  # noqa: PLC0415
    except ImportError:
        return None

    def f(q, k, v, causal):
        # Its backward needs its own blocks (and has no causal form: those cells stay empty).
        bwd = {} if causal else dict(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
        cfg = m.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal, **bwd)
        return m.attention(q, k, v, cfg)

    f.dtype = jnp.float16  # the example kernel's scratch is float16: it runs on float16 copies

    return f


def _tokamax():
    try:
        import tokamax  # noqa: PLC0415
    except ImportError:
        return None
    return lambda q, k, v, causal: tokamax.dot_product_attention(
        q, k, v, is_causal=causal, implementation="triton"
    )


#: The flags of a call that only FLASH may run (its kernels under ``flash_cuda_kernel="auto"``), and
#: of one that only its Triton kernels may run (the jb_pallas column).
FLASH_ONLY = dict(flash=True, mem_efficient=False, cudnn=False, math=False)
TRITON_ONLY = dict(FLASH_ONLY, flash_cuda_kernel="triton")


def jax_impls(smoke: bool) -> dict:
    """name -> (fn, the flags scope it is traced in)."""
    if smoke:
        return {
            "jb": (_jb, None),
            "jb_pallas": (_interpreted_pallas, None),
            "jax_xla": (_jax_nn("xla"), None),
        }
    impls = {
        "jb": (_jb, None),
        "jb_pallas": (_jb, TRITON_ONLY),
        "cudnn": (_jax_nn("cudnn"), None),
        "jax_xla": (_jax_nn("xla"), None),
    }
    for name, make in (("mgpu_example", _mgpu_example), ("tokamax", _tokamax)):
        fn = make()
        if fn is not None:
            impls[name] = (fn, None)
    # Last: our Mosaic GPU kernels had not run on a GPU when this row was added; were they to hang,
    # a time limit's interrupt would then lose only their column.
    impls["jb_mosaic"] = (_jb, dict(FLASH_ONLY, flash_cuda_kernel="mosaic"))
    return impls


def time_jax(fn, scope, q, k, v, causal, bwd, iters, extra=None):
    """Seconds per call (forward, or forward + backward w.r.t. q, k, v and the floating ``extra``
    operands), traced under ``scope``. ``extra``: keyword operands of ``fn`` (a feature row's mask or
    bias), made beforehand and passed into the timed loop, so that making them is not timed."""
    extra = dict(extra or {})
    floats = {n for n, x in extra.items() if jnp.issubdtype(x.dtype, jnp.floating)}
    if bwd:

        def call(q, k, v, extra):
            w = jnp.cos(jnp.arange(q.shape[-1], dtype=jnp.float32)).reshape(1, 1, 1, -1)  # a cotangent
            fixed = {n: x for n, x in extra.items() if n not in floats}

            def loss(q, k, v, diff):
                return (fn(q, k, v, causal, **diff, **fixed).astype(jnp.float32) * w).sum()

            return jax.grad(loss, (0, 1, 2, 3))(q, k, v, {n: extra[n] for n in floats})
    else:

        def call(q, k, v, extra):
            return fn(q, k, v, causal, **extra)

    with jb.with_backends(**scope) if scope else contextlib.nullcontext():
        return jax_time(call, (q, k, v, extra), iters=iters)


#: (column, case, error) of every timing that failed: listed under the table; a failed jb* cell makes
#: the run exit 3.
FAILURES = []


def _failed(name, case, err):
    line = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    FAILURES.append((name, case, line))
    print(f"  {name} {case}: {line}", file=sys.stderr, flush=True)


def time_torch(name, q, k, v, causal, bwd, iters):
    torch = torch_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    backend = {
        "torch_flash": SDPBackend.FLASH_ATTENTION,
        "torch_cudnn": SDPBackend.CUDNN_ATTENTION,
        "torch_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[name]
    t = lambda x: torch.from_dlpack(x).transpose(1, 2).contiguous().requires_grad_(bwd)  # noqa: E731 - BNTH
    tq, tk, tv = t(q), t(k), t(v)
    gqa = tq.shape[1] != tk.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step():
        with sdpa_kernel(backend):
            out = sdpa(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
            if bwd:
                torch.autograd.grad(out, (tq, tk, tv), out)  # any cotangent of the right shape
        return out

    return torch_time(step, iters=iters)


def flops(B, N, T, S, H, causal, bwd):
    f = 4.0 * B * N * T * S * H * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)


def run_case(impls, torch_names, B, T, S, N, K, H, causal, bwd, iters, dtype, max_xla_bytes):
    """{name: seconds per call (NaN where it cannot run)} and the backend ``jb`` chose; ``torch_names``:
    the torch rows to time (those of `TORCH_IMPLS` asked for, when torch with CUDA is there)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32).astype(dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32).astype(dtype) for _ in range(2))
    chosen = jb.explain(q, k, v, is_causal=causal)
    res = {}
    for name, (fn, scope) in impls.items():
        if name == "jax_xla" and B * N * T * S * 4 * (3 if bwd else 1) > max_xla_bytes:
            res[name] = math.nan  # quadratic memory: skipped, not failed
            continue
        dt = getattr(fn, "dtype", None)  # a row that takes one dtype only (mgpu_example: float16)
        args = (q, k, v) if dt is None else tuple(x.astype(dt) for x in (q, k, v))
        try:
            res[name] = time_jax(fn, scope, *args, causal, bwd, iters)
        except Exception as e:  # noqa: BLE001 - unsupported shapes / OOM: reported, the sweep goes on
            _failed(name, f"B={B} T={T} S={S} H={H} causal={causal} bwd={bwd}", e)
            res[name] = math.nan
    for name in torch_names:
        try:
            res[name] = time_torch(name, q, k, v, causal, bwd, iters)
        except Exception as e:  # noqa: BLE001
            _failed(name, f"B={B} T={T} S={S} H={H} causal={causal} bwd={bwd}", e)
            res[name] = math.nan
    label = f"{chosen.chosen.name}[{chosen.implementation}]" if chosen.chosen is not None else "-"
    return res, label


#: The features only our kernels have (cuDNN cannot run them: the default runs FLASH), timed forward and
#: backward against FLASH without them: issue 13 asks for >= 0.8x of the no-feature speed.
FEATURES = ("softcap", "segments", "dropout")
#: The features the Mosaic GPU kernels run too: also timed with ``flash_cuda_kernel="mosaic"``, against
#: the jb_mosaic column without them; with a random boolean mask (a ring of int8 tiles streamed beside
#: the keys), an additive bias shared by the batch and heads (the same, in the inputs' dtype, and its
#: gradient) and a local window of a quarter of the keys (the blocks outside it skipped: faster).
MOSAIC_FEATURES = ("softcap", "segments", "dropout", "mask", "bias", "window")
#: The segment-id and mask rows again under the Mosaic kernels' block ranges (``Config`` /
#: ``BwdConfig(block_ranges=True)``: each tile streams only its blocks from the first to the last visible
#: one; off by default until a GPU has timed them), calling ``mosaic_flash.attention`` directly (jb passes
#: no kernel config), in the jb column against jb_mosaic without the feature.
MOSAIC_RANGES = ("segments", "mask")


def _with_feature(name, q, k):
    """``(fn, operands, visible)`` of a feature row: ``fn(q, k, v, causal, **operands)`` calls jb with the
    feature; ``operands`` (a mask, a bias) are made here, outside the timed loop; ``visible`` is the
    fraction of the (query, key) pairs the feature leaves to compute (4 packed segments: 1/4; a window
    of S/8 each side: about 1/4), so that a row's speed counts the work it has to do, not the skipped."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    operands, kw, visible = {}, {}, 1.0
    if name == "softcap":
        kw = dict(logits_soft_cap=30.0)
    elif name == "segments":  # 4 packed sequences per row
        ids = np.arange(T) * 4 // T
        operands = dict(segment_ids=jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (B, T)))
        visible = float(np.sum(np.bincount(ids) ** 2)) / (T * S)
    elif name == "mask":  # one [T, S] mask shared by the batch and heads
        operands = dict(mask=jax.random.bernoulli(jax.random.key(1), 0.7, (1, 1, T, S)))
    elif name == "bias":  # its gradient is timed too (time_jax differentiates floating operands)
        operands = dict(bias=jax.random.normal(jax.random.key(2), (1, 1, T, S), q.dtype))
    elif name == "window":
        w = S // 8
        kw = dict(local_window_size=(w, w))
        i = np.arange(T)[:, None] + (S - T)  # lower-right aligned, as the call aligns it
        visible = float(np.sum(np.clip(np.minimum(i + w, S - 1) - np.maximum(i - w, 0) + 1, 0, None))) / (
            T * S
        )
    else:
        kw = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0))

    def f(q, k, v, causal, **ops):
        return jb.dot_product_attention(q, k, v, is_causal=causal, **ops, **kw)

    return f, operands, visible


def _with_block_ranges(name, q, k, interpret=False):
    """``(fn, operands, visible)`` of :data:`MOSAIC_RANGES`' row ``name`` (as :func:`_with_feature`):
    ``fn`` runs ``mosaic_flash.attention`` with the default configs plus ``block_ranges=True``
    (``interpret``: in its GPU interpret mode, for a CPU check)."""
    if name not in MOSAIC_RANGES:
        raise ValueError(f"`name` must be one of {MOSAIC_RANGES}; got {name!r}")
    _, operands, visible = _with_feature(name, q, k)
    cfg = dataclasses.replace(mosaic_flash.Config.heuristics(q.shape[-1]), block_ranges=True)
    # at head dim 256 the Triton backward runs (it has no block ranges)
    bwd = mosaic_flash.BwdConfig(block_ranges=True) if q.shape[-1] in mosaic_flash._BWD_HEAD_DIMS else None

    def f(q, k, v, causal, segment_ids=None, mask=None):
        args = base.make_args(
            q, k, v, is_causal=causal, mask=mask, q_segment_ids=segment_ids, kv_segment_ids=segment_ids
        )
        return mosaic_flash.attention(args, config=cfg, bwd_config=bwd, interpret=interpret)[0]

    return f, operands, visible


def run_features(impls, B, L, N, H, iters, dtype, smoke=False):
    """``[(feature, {"jb": seconds with it, column: seconds of FLASH without it}, jb's choice, the
    fraction of pairs visible with the feature)]`` for
    forward + backward (non-causal), where ``column`` is the FLASH kernel that runs the call without the
    feature under the default flags (``jb_mosaic`` on sm90 in half precision, else ``jb_pallas``); with
    a ``jb_mosaic`` column, then the features the Mosaic GPU kernels also run, under its flags
    (``{"jb": with it, "jb_mosaic": without it}``; those the first rows already timed on it are not
    repeated), and on a GPU the :data:`MOSAIC_RANGES` rows. ``smoke``: the CPU check, whose baseline is
    the interpreted Triton kernel."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32).astype(dtype) for _ in range(3))

    def timed(fn, scope, what, extra=None):
        try:
            return time_jax(fn, scope, q, k, v, False, True, iters, extra)
        except Exception as err:  # noqa: BLE001 - reported, the sweep goes on
            _failed("jb", f"{what}, fwd+bwd B={B} L={L} H={H}", err)  # every row here is one of ours
            return math.nan

    column = "jb_pallas"
    if smoke:
        plain = timed(*impls.get("jb_pallas", (_interpreted_pallas, None)), "FLASH (interpreted)")
    else:  # FLASH under the default kernel choice (the Mosaic GPU kernel on sm90), else Triton's
        with jb.with_backends(**FLASH_ONLY):
            if jb.explain(q, k, v).implementation == "mosaic_flash":
                column = "jb_mosaic"
        plain = timed(_jb, FLASH_ONLY, f"FLASH ({column})")
        if plain != plain and column == "jb_mosaic":  # NaN: the Mosaic kernel failed; Triton's
            column = "jb_pallas"
            plain = timed(_jb, TRITON_ONLY, "FLASH (jb_pallas)")

    out = []
    for name in FEATURES:
        fn, ops, visible = _with_feature(name, q, k)
        if name == "softcap":
            e = jb.explain(q, k, v, logits_soft_cap=30.0)
        elif name == "dropout":
            e = jb.explain(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
        else:
            e = jb.explain(q, k, v, segment_ids=jnp.zeros((B, L), jnp.int32))
        label = f"{e.chosen.name}[{e.implementation}] {name}" if e.chosen is not None else name
        out.append((name, {"jb": timed(fn, None, f"feature {name}", ops), column: plain}, label, visible))
    if "jb_mosaic" in impls:  # last (see jax_impls): the features the Mosaic GPU kernels run
        mosaic_fn, mosaic_scope = impls["jb_mosaic"]
        if column != "jb_mosaic":
            plain = timed(mosaic_fn, mosaic_scope, "jb_mosaic")
        if plain != plain:  # NaN: the kernel failed without the features
            return out
        for name in MOSAIC_FEATURES:
            if column == "jb_mosaic" and name in FEATURES:
                continue  # timed on it above
            fn, ops, visible = _with_feature(name, q, k)
            t = timed(fn, mosaic_scope, f"feature {name} (mosaic)", ops)
            label = f"FLASH[mosaic_flash] {name} (flash_cuda_kernel='mosaic', in the jb column)"
            out.append((name, {"jb": t, "jb_mosaic": plain}, label, visible))
        for name in MOSAIC_RANGES if not smoke else ():  # compiled kernels only
            fn, ops, visible = _with_block_ranges(name, q, k)
            t = timed(fn, None, f"feature {name} (mosaic, block ranges)", ops)
            label = f"mosaic_flash {name}, block_ranges=True (called directly, in the jb column)"
            out.append((name, {"jb": t, "jb_mosaic": plain}, label, visible))
    return out


def best_of_ours_and_cudnn(res):
    picks = [
        res[n] for n in ("cudnn", "jb_pallas", "jb_mosaic") if res.get(n, math.nan) == res.get(n, math.nan)
    ]
    return min(picks) if picks else math.nan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--decode-lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--no-decode", action="store_true")
    p.add_argument(
        "--no-features",
        action="store_true",
        help="skip the rows of softcap / segment ids / dropout (fwd+bwd, largest head dim, L = 4k)",
    )
    p.add_argument("--tokens", type=int, default=16384, help="batch x length")
    p.add_argument("--model-dim", type=int, default=2048, help="heads x head dim")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--impls", nargs="+", default=None, help="subset of rows, e.g. jb cudnn torch_flash")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--quick", action="store_true", help="head dims 64/128, L 4k/16k, decode 16k/128k")
    p.add_argument("--md", default=None, help="also write the table as markdown to this file")
    p.add_argument("--png", default="attention_gpu.png")
    p.add_argument(
        "--smoke", action="store_true", help="CPU check of the script: tiny shapes, interpret mode"
    )
    a = p.parse_args(argv)
    FAILURES.clear()  # this run's

    if a.quick:
        a.head_dims, a.lengths, a.decode_lengths = [64, 128], [4096, 16384], [16384, 131072]
    if a.smoke:
        a.lengths, a.head_dims, a.tokens, a.model_dim, a.iters, a.decode_lengths = [32], [16], 64, 32, 2, [64]
        a.no_torch = True
    elif jax.default_backend() != "gpu":
        sys.exit("attention_gpu.py needs a GPU (or pass --smoke for a CPU check of the script)")
    impls = jax_impls(a.smoke)
    torch_names = list(TORCH_IMPLS) if not a.no_torch and torch_cuda() is not None else []
    if a.impls:
        impls = {k: v for k, v in impls.items() if k in a.impls}
        torch_names = [n for n in torch_names if n in a.impls]
    names = list(impls) + torch_names
    dtype = jnp.dtype(a.dtype)
    device = jax.devices()[0].device_kind
    max_xla = 8 << 30
    head = (
        f"Attention on {device}, {dtype.name}, jax {jax.__version__}"
        + (f", torch {torch_cuda().__version__}" if torch_names else "")
        + f". Training rows: TFLOP/s ({a.tokens} tokens, model dim {a.model_dim}); decode rows: "
        "microseconds per call (T=1, GQA 32/8 heads of 128, batch 4). `jb/best`: the fastest time of "
        "cudnn, jb_pallas and jb_mosaic over jb's (> 1: jb is faster; >= 0.97 is the goal); on a feature "
        "row, jb's speed with the feature (cuDNN cannot run it) over FLASH's without it (in the column of "
        "the kernel FLASH runs it on: jb_pallas, or jb_mosaic on sm90), or on a mosaic_flash feature row "
        "over jb_mosaic's (>= 0.8 is the goal). Speeds count the pairs a feature leaves to compute: 1/4 "
        "with 4 packed segments, about 1/4 with the window; its TFLOP/s cell in the jb column too."
    )

    rows = []  # (section, mode, H, L, causal, {name: seconds}, flops, jb's choice, {name: flops})

    def add(row):
        """Keeps a finished row: its table line to stderr at once, and the markdown file rewritten, so
        that a run killed mid-compile (a time limit's SIGKILL) keeps every row done before it."""
        rows.append(row)
        cols = _columns(names, rows)
        print("  row: " + _line(row, cols), file=sys.stderr, flush=True)
        if a.md:
            write_table(a.md, _table(head, cols, rows) + f"\n\n(in progress: {len(rows)} rows so far)")

    interrupted = False
    try:
        for mode in a.modes:
            bwd = mode == "fwd+bwd"
            for H in a.head_dims:
                for L in a.lengths:
                    B, N = max(1, a.tokens // L), max(1, a.model_dim // H)
                    for causal in (False, True):
                        res, label = run_case(
                            impls, torch_names, B, L, L, N, N, H, causal, bwd, a.iters, dtype, max_xla
                        )
                        add(("train", mode, H, L, causal, res, flops(B, N, L, L, H, causal, bwd), label, {}))
        if not a.no_features:  # fwd+bwd at the largest head dim asked for, L = 4k (32 in --smoke)
            H, L = max(a.head_dims), 32 if a.smoke else 4096
            B, N = max(1, a.tokens // L), max(1, a.model_dim // H)
            f = flops(B, N, L, L, H, False, True)
            for name, res, label, visible in run_features(impls, B, L, N, H, a.iters, dtype, smoke=a.smoke):
                add(("feature", "fwd+bwd", H, L, False, res, f, label, {"jb": f * visible}))
        if not a.no_decode:  # one query row, GQA 32 / 8 heads of 128, batch 4
            B, N, K, H = (1, 4, 2, 16) if a.smoke else (4, 32, 8, 128)
            for S in a.decode_lengths:
                res, label = run_case(
                    impls, torch_names, B, 1, S, N, K, H, False, False, a.iters, dtype, max_xla
                )
                add(("decode", "fwd", H, S, False, res, flops(B, N, 1, S, H, False, False), label, {}))
    except KeyboardInterrupt:  # a time limit's SIGINT (benchmarks/gpu_session.sh): keep the rows done
        interrupted = True
        print(f"interrupted after {len(rows)} rows: writing those", file=sys.stderr, flush=True)
    if interrupted and not rows:
        sys.exit(130)
    names = _columns(names, rows)
    text = _table(head, names, rows)
    if interrupted:
        text += f"\n\n(interrupted: {len(rows)} rows done)"
    print("\n" + text)
    if a.md:
        write_table(a.md, text)
    write_png(rows, names, a, device, dtype)
    if interrupted:
        sys.exit(130)
    if any(name.startswith("jb") for name, _, _ in FAILURES):
        sys.exit(3)  # one of our own kernels failed somewhere: the summary must not say exit 0
    return rows


def _columns(names, rows):
    """``names``, then any column a row timed that ``--impls`` left out (a feature row's baseline)."""
    names = list(names)
    for row in rows:
        names += [n for n in row[5] if n not in names and n != "jb"]
    return names


def _line(row, names):
    section, mode, H, L, causal, res, f, label, col_flops = row
    ok = lambda n: n in res and res[n] == res[n]  # noqa: E731 - timed (not NaN)
    if section == "decode":
        cells = [f"{res[n] * 1e6:.1f}" if ok(n) else "-" for n in names]
    else:
        cells = [f"{col_flops.get(n, f) / res[n] / 1e12:.1f}" if ok(n) else "-" for n in names]
    best, mine = best_of_ours_and_cudnn(res), res.get("jb", math.nan)
    # speed ratio: on a feature row the jb cell does the visible pairs' work only
    scaled = best * col_flops.get("jb", f) / f if best == best else best
    return (
        f"| {section} | {mode} | {H} | {L} | {causal} | "
        + " | ".join(cells)
        + f" | {ratio(scaled, mine)} | {label} |"
    )


def _table(head, names, rows):
    lines = [
        head,
        "",
        "| section | pass | H | L or S | causal | " + " | ".join(names) + " | jb/best | jb runs |",
        "|" + "---|" * (len(names) + 7),
    ]
    lines += [_line(row, names) for row in rows]
    if FAILURES:
        lines += ["", "Failed (the first line of each error; the log has the rest):"]
        lines += [f"- {name}, {case}: {err}" for name, case, err in FAILURES]
    return "\n".join(lines)


def write_png(rows, names, a, device, dtype):
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r[1], r[2], r[4]) for r in rows if r[0] == "train"})
    decode = [r for r in rows if r[0] == "decode"]
    n = len(panels) + (1 if decode else 0)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.6), squeeze=False)
    for ax, (mode, H, causal) in zip(axes[0], panels):
        sel = [r for r in rows if r[0] == "train" and (r[1], r[2], r[4]) == (mode, H, causal)]
        for name in names:
            ax.plot(
                [r[3] for r in sel],
                [r[6] / r[5].get(name, math.nan) / 1e12 for r in sel],
                marker="o",
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode}, head dim {H}, {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    if decode:
        ax = axes[0][-1]
        for name in names:
            ax.plot(
                [r[3] for r in decode],
                [r[5].get(name, math.nan) * 1e6 for r in decode],
                marker="o",
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title("decode (T=1, GQA), lower is better", fontsize=9)
        ax.set_xlabel("KV length")
        ax.set_ylabel("microseconds")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Attention, {device}, {dtype.name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
