"""What the Pallas Triton kernels compile to on an NVIDIA GPU, read on a machine without one.

For one call (an int4 matmul or an attention forward / backward / decode) and one config or its whole
search space, the script lowers the kernel as an export for CUDA would (`pallas_kernels.gpu.cuda_target`,
an abstract H100), captures the Triton IR JAX hands to XLA, compiles that IR for the target (sm90 by
default) with the `triton` package's own compiler, and reads ptxas's report and the SASS:

* registers per thread and spill bytes (stores / loads to local memory),
* shared memory (bytes; more than the target has means the config cannot launch),
* the MMA instructions, with where their A operand comes from (``A:regs`` or ``A:smem``): on sm90 a
  warpgroup MMA (``HGMMA`` / ``IGMMA``) reads B from shared memory and A from either; the older
  ``HMMA`` / ``IMMA`` (``mma.sync``) read registers,
* the count of ``STS`` (register to shared-memory stores; the asynchronous copies from global memory,
  ``LDGSTS``, are not counted) and of ``BAR`` barriers in the kernel, and of all SASS instructions.

It measures nothing: no GPU runs here. It says which instructions a config gets and where it runs out of
registers, before a GPU session spends time on it (``benchmarks/tune_gpu.py`` measures).

**Caveat.** The `triton` package is not the Triton that XLA builds into jaxlib (XLA keeps its own build,
with passes of its own), and its ptxas may be newer than the GPU machine's CUDA. The IR is the same;
the code generated from it can differ, registers and spills most. Read the numbers as those of a nearby
compiler.

Needs ``pip install triton`` (about 300 MB; not a dependency of jbackends) and jax >= 0.11 (its abstract
GPU device; with an older jax the lowering asks for a local GPU).

    python benchmarks/kernel_resources.py int4 --op dyn_quant --rows 256             # the default config
    python benchmarks/kernel_resources.py int4 --op weight_only --rows 1 16 --space --options
    python benchmarks/kernel_resources.py int4 --op dyn_quant --rows 256 --config 128,128,128,1,8,2 swap_ab
    python benchmarks/kernel_resources.py attention --kernel bwd --head-dim 128 --space
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Optional
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import export  # noqa: E402

from pallas_kernels import gpu  # noqa: E402

TRITON_CALL = "__gpu$xla.gpu.triton"
SM90_SHARED_BYTES = 227 * 1024  # the most one block may ask for on sm90


@dataclasses.dataclass
class Kernel:
    """One Pallas Triton kernel as JAX lowered it: its Triton IR (text) and launch parameters."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    grid: tuple


def capture(fn: Callable, *args, device_kind: str = "NVIDIA H100 80GB HBM3") -> list:
    """The :class:`Kernel` s of every Pallas Triton call ``fn(*args)`` lowers to for CUDA on
    ``device_kind`` (no GPU needed: the lowering is that of an export), in lowering order.

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.int4_matmul import base, triton
      >>> q, s = base.quantize_4bit(jnp.ones((64, 128)), 64)
      >>> p = base.PackedInt4Weight(q, s, None, 64, 128, 64)
      >>> [k.name for k in capture(lambda x: triton.weight_only_matmul(x, p), jnp.ones((2, 128), jnp.bfloat16))]
      ['jb_int4_w4a16']
    """
    from jax._src.pallas.triton import lowering, pallas_call_registration as reg  # noqa: PLC0415

    found, pending = [], []
    lower = lowering.lower_jaxpr_to_triton_module
    custom_call = reg.mlir.custom_call

    def lower_and_keep(*a, **kw):
        result = lower(*a, **kw)
        pending.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    def custom_call_and_keep(call_target_name, *a, backend_config=None, **kw):
        if call_target_name == TRITON_CALL:
            ints = {k: int(re.search(r"-?\d+", str(backend_config[k])).group(0)) for k in _LAUNCH}
            found.append(
                Kernel(
                    name=str(backend_config["name"]).strip('"'),
                    ttir=pending.pop(),
                    num_warps=ints["num_warps"],
                    num_stages=ints["num_stages"],
                    grid=(ints["grid_x"], ints["grid_y"], ints["grid_z"]),
                )
            )
        return custom_call(call_target_name, *a, backend_config=backend_config, **kw)

    checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with mock.patch.object(lowering, "lower_jaxpr_to_triton_module", lower_and_keep):
        with mock.patch.object(reg.mlir, "custom_call", custom_call_and_keep), gpu.cuda_target(device_kind):
            # a new function each time: JAX caches lowerings by function, and a cached one lowers nothing
            export.export(jax.jit(lambda *a: fn(*a)), platforms=["cuda"], disabled_checks=checks)(*args)
    return found


_LAUNCH = ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")
_SASS_LINE = re.compile(
    r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);"
)


def _tool(name: str, arch: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415

    ptxas = get_ptxas(arch).path
    return ptxas if name == "ptxas" else os.path.join(os.path.dirname(ptxas), name)


def compile_report(kernel: Kernel, arch: int = 90) -> dict:
    """Compiles ``kernel`` for ``sm_<arch>`` with the `triton` package and reports what ptxas and the
    SASS say (see the module docstring). Raises ImportError without `triton`."""
    # Floating-point contraction (a * b + c to an FMA) on, as Triton had it by default until 3.9 asked.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="jb_kernel_") as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as f:
            f.write(kernel.ttir)
        options = {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages}
        compiled = triton.compile(path, target=GPUTarget("cuda", arch, 32), options=options)
        ptx = os.path.join(d, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        cubin = os.path.join(d, "kernel.cubin")
        ptxas = subprocess.run(
            [_tool("ptxas", arch), "-v", "--gpu-name", gpu_name, ptx, "-o", cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [_tool("cuobjdump", arch), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"Used (\d+) registers", ptxas)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    ops, mmas = collections.Counter(), collections.Counter()
    for line in sass.splitlines():
        m = _SASS_LINE.match(line)
        if not m:
            continue
        op, mods, operands = m.groups()
        ops[op] += 1
        if op.endswith("MMA"):
            shape = mods.lstrip(".").split(".")
            a = [x.strip() for x in operands.split(",")][1] if operands.count(",") >= 2 else ""
            where = "smem" if a.startswith("gdesc") else "regs"
            mmas[f"{op}.{'.'.join(shape[:3])} A:{where}"] += 1
    return {
        "kernel": kernel.name,
        "warps": kernel.num_warps,
        "stages": kernel.num_stages,
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(spills.group(1)) if spills else None,
        "spill_loads": int(spills.group(2)) if spills else None,
        "shared_bytes": int(compiled.metadata.shared),
        "mma": dict(mmas),
        "sts": ops["STS"],
        "barriers": ops["BAR"],
        "instructions": sum(ops.values()),
        "ops": dict(ops),
    }


def _int4_calls(op: str, rows: list, K: int, N: int, groupsize: int):
    from pallas_kernels.int4_matmul import base, triton  # noqa: PLC0415

    q, s = base.quantize_4bit(jnp.zeros((N, K), jnp.float32), groupsize)
    packed = base.PackedInt4Weight(q, s, None, groupsize, K, N)
    dtype = jnp.bfloat16 if op == "weight_only" else jnp.float32
    kernel = triton.weight_only_matmul if op == "weight_only" else triton.dyn_quant_matmul
    for M in rows:
        x = jax.ShapeDtypeStruct((M, K), dtype)
        call = base.Int4Call.of(op, x, packed)
        yield (
            f"{op} M={M} K={K} N={N} g={groupsize}",
            call,
            (lambda cfg, x=x: (lambda x: kernel(x, packed, config=cfg), (x,))),
        )


def _attention_calls(kernel: str, head_dim: int, lengths: list, causal: bool):
    from pallas_kernels.attention import base, triton_decode, triton_flash, triton_flash_vjp  # noqa: PLC0415

    for L in lengths:
        B, N = max(1, 16384 // L), max(1, 2048 // head_dim)
        if kernel == "decode":
            q = jax.ShapeDtypeStruct((4, 1, 32, head_dim), jnp.bfloat16)
            k = jax.ShapeDtypeStruct((4, L, 8, head_dim), jnp.bfloat16)
        else:
            q = k = jax.ShapeDtypeStruct((B, L, N, head_dim), jnp.bfloat16)
        args = jax.eval_shape(
            lambda q, k: base.make_args(q, k, k, is_causal=causal and kernel != "decode"), q, k
        )
        label = f"{kernel} H={head_dim} L={L}{' causal' if causal else ''}"

        def make(cfg, args=args):
            if kernel == "fwd":
                return (lambda a: triton_flash.forward(a, config=cfg)), (args,)
            if kernel == "decode":
                return (lambda a: triton_decode.forward(a, config=cfg)), (args,)
            # the backward alone: the forward's outputs are arguments
            out, lse = jax.eval_shape(lambda a: triton_flash.forward(a, config=triton_flash.Config()), args)
            return (lambda a, out, lse: triton_flash_vjp.backward(a, out, lse, out, config=cfg)), (
                args,
                out,
                lse,
            )

        yield label, args, make


def _config_class(what: str, op_or_kernel: str):
    if what == "int4":
        from pallas_kernels.int4_matmul.triton_config import Config  # noqa: PLC0415

        return Config
    from pallas_kernels.attention import triton_tuning  # noqa: PLC0415

    return {
        "fwd": triton_tuning.Config,
        "bwd": triton_tuning.BackwardConfig,
        "decode": triton_tuning.DecodeConfig,
    }[op_or_kernel]


def _parse_config(cls, text: list):
    """``["128,128,64,1,8,3", "swap_ab"]`` -> ``cls(128, 128, 64, 1, 8, 3, swap_ab=True)``."""
    ints = [int(v) for v in text[0].split(",")]
    flags = {name: True for name in text[1:]}
    return cls(*ints, **flags)


def _row(cfg, r: Optional[dict], error: Optional[str]) -> str:
    fields = dataclasses.asdict(cfg)
    c = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in fields.items())
    if r is None:
        return f"| {c} | - | - | - | - | - | - | failed: {error} |"
    over = " (over sm90's 227 KiB)" if r["shared_bytes"] > SM90_SHARED_BYTES else ""
    mma = ", ".join(f"{k} x{n}" for k, n in sorted(r["mma"].items())) or "none"
    spill = f"{r['spill_stores']}/{r['spill_loads']}"
    return (
        f"| {c} | {r['kernel']} | {r['registers']} | {spill} | {r['shared_bytes']}{over} | "
        f"{r['sts']} / {r['barriers']} | {r['instructions']} | {mma} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    i4 = sub.add_parser("int4", help="the int4 W4A16 / W4A8 kernels")
    i4.add_argument("--op", choices=("weight_only", "dyn_quant"), default="weight_only")
    i4.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    i4.add_argument("--k", type=int, default=4096)
    i4.add_argument("--n", type=int, default=4096)
    i4.add_argument("--groupsize", type=int, default=128)
    i4.add_argument("--options", action="store_true", help="with --space: the options not yet measured too")
    at = sub.add_parser("attention", help="the Triton attention kernels")
    at.add_argument("--kernel", choices=("fwd", "bwd", "decode"), default="fwd")
    at.add_argument("--head-dim", type=int, default=128)
    at.add_argument("--lengths", type=int, nargs="+", default=[4096])
    at.add_argument("--causal", action="store_true")
    for s in (i4, at):
        s.add_argument("--space", action="store_true", help="every config of the search space")
        s.add_argument(
            "--config", nargs="+", help="one config: its integer fields comma-separated, then flags"
        )
        s.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90)")
        s.add_argument(
            "--device-kind", default="NVIDIA H100 80GB HBM3", help="the abstract device lowered for"
        )
    a = p.parse_args(argv)
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError:
        p.error("this script compiles with the `triton` package: pip install triton")

    key = a.op if a.what == "int4" else a.kernel
    cls = _config_class(a.what, key)
    device = {"compute_capability": a.arch / 10, "num_sms": 132}
    if a.what == "int4":
        calls = _int4_calls(a.op, a.rows, a.k, a.n, a.groupsize)
    else:
        calls = _attention_calls(a.kernel, a.head_dim, a.lengths, a.causal)
    print(
        f"Pallas Triton kernels compiled for sm_{a.arch} by triton {triton.__version__} (jax {jax.__version__})."
    )
    print("Static: registers and spills from ptxas -v, the rest from the SASS; no GPU ran anything.\n")
    for label, subject, make in calls:
        if a.config:
            configs = [_parse_config(cls, a.config)]
        elif a.space:
            kw = {"options": True} if a.what == "int4" and a.options else {}
            configs = cls.search_space(subject, **kw)
        else:
            configs = [cls.heuristics(subject, device)]
        print(f"### {label}\n")
        print("| config | kernel | registers | spill bytes st/ld | shared bytes | STS / BAR | SASS | MMA |")
        print("|---|---|---|---|---|---|---|---|")
        for cfg in configs:
            fn, fn_args = make(cfg)
            try:
                for k in capture(fn, *fn_args, device_kind=a.device_kind):
                    print(_row(cfg, compile_report(k, a.arch), None), flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not lower or compile is a row
                print(
                    _row(cfg, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"),
                    flush=True,
                )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
