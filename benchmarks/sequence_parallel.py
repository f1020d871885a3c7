"""Sequence parallelism: attention with q / k / v split along the sequence over a mesh (a ring).

    python benchmarks/sequence_parallel.py                      # 8 virtual CPU devices, L 4k-32k
    python benchmarks/sequence_parallel.py --lengths 8192 --devices 4

For each length: causal flash attention forward + backward (bf16 off, float32; B=1, 8 heads of 64)
on inputs split along the sequence over ``--devices`` devices (the ring of ``docs/sharding.md``),
against the same call on unsplit inputs on one device. Columns: wall time per call (median of
``--repeats`` after a warm-up), the compiled per-device temporary memory (``memory_analysis``; the
blockwise XLA engine, whose buffers XLA sees), and the ratios split / whole.

On a CPU the "devices" are virtual (``--xla_force_host_platform_device_count``) and share the same
cores, so the time column shows the ring's overhead, not a speed-up; the memory column is what a
real multi-device run gets per device. On a GPU mesh pass ``--devices`` up to the number of GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--kernel",
        default="xla",
        choices=["xla", "auto"],
        help="flash_cpu_kernel: the blockwise XLA engine or the C++ kernel",
    )
    a = p.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={a.devices}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

    import jbackends as jb  # noqa: PLC0415

    devices = jax.devices()[: a.devices]
    mesh = jax.sharding.Mesh(devices, ("seq",))

    def step(q, k, v):
        def loss(q, k, v):
            with jb.sdpa_kernel([jb.SDPBackend.FLASH_ATTENTION]), jb.with_backends(flash_cpu_kernel=a.kernel):
                return (jb.dot_product_attention(q, k, v, is_causal=True) ** 2).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    f = jax.jit(step)
    print(
        f"{len(devices)} {devices[0].platform} devices; causal flash fwd+bwd, f32, B=1, H=8, D=64, "
        f"flash_cpu_kernel={a.kernel}"
    )
    print(
        f"{'L':>7} | {'whole ms':>9} | {'split ms':>9} | {'time split/whole':>16} | "
        f"{'whole temp MiB':>14} | {'split temp/dev MiB':>18} | {'mem split/whole':>15}"
    )
    for L in a.lengths:
        row = {}
        for name, spec in (("whole", None), ("split", P(None, "seq"))):
            sharding = NamedSharding(mesh, spec if spec is not None else P())
            if spec is None:
                sharding = jax.sharding.SingleDeviceSharding(devices[0])
            x = jax.device_put(jax.random.normal(jax.random.key(L), (1, L, 8, 64), jnp.float32), sharding)
            compiled = f.lower(x, x, x).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            jax.block_until_ready(compiled(x, x, x))
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                jax.block_until_ready(compiled(x, x, x))
                times.append(time.perf_counter() - t)
            row[name] = (sorted(times)[len(times) // 2] * 1e3, temp / 2**20)
        (tw, mw), (ts, ms) = row["whole"], row["split"]
        print(
            f"{L:>7} | {tw:>9.1f} | {ts:>9.1f} | {ts / tw:>16.2f} | {mw:>14.1f} | {ms:>18.1f} | "
            f"{ms / mw:>15.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
