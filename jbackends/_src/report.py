"""`python -m jbackends`: an environment and backends report, like torch's collect_env.

Sections: versions, devices, CPU, every backend/kernel and whether it can run here (with the reason when it
cannot), and every flag with its value and its torch spelling. Each section is computed independently: a
failure in one is printed in place and does not hide the others.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from collections.abc import Callable, Iterator

from jbackends._src import flag_declarations as _flag_declarations
from jbackends._src import flag_state as _flag_state

_PACKAGES = ("jax", "jaxlib", "flax", "chex", "opt_einsum", "numpy", "ml_dtypes", "torch", "tokamax")


def _versions() -> Iterator[tuple[str, str]]:
    yield "python", sys.version.split()[0]
    yield "platform", platform.platform()
    for name in _PACKAGES:
        try:
            yield name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            yield name, "not installed"
    try:
        plugins = sorted(
            d.metadata["Name"]
            for d in importlib.metadata.distributions()
            if (d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda", "jax-rocm", "jax-metal"))
        )
    except Exception:  # pragma: no cover - metadata of a broken install
        plugins = []
    yield "jax GPU plugins", ", ".join(plugins) or "none (CPU-only jaxlib)"


def _devices() -> Iterator[tuple[str, str]]:
    import jax

    yield "default backend", jax.default_backend()
    for d in jax.devices():
        yield f"device {d.id}", f"{d.platform}: {getattr(d, 'device_kind', '?')}"


def _cpu_rows() -> Iterator[tuple[str, str]]:
    from jbackends import cpu

    yield "capability (torch spelling)", cpu.get_cpu_capability()
    for name in ("get_xla_cpu_target", "xla_cpu_target"):
        if hasattr(cpu, name):
            yield "XLA CPU target", str(getattr(cpu, name)())


def _attention_rows() -> Iterator[tuple[str, str]]:
    import jax
    import jax.numpy as jnp

    from jbackends import attention

    q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 4096, 4096), jnp.bfloat16)
    calls = (("causal, L=4096, bf16", dict(is_causal=True)), ("additive bias", dict(bias=bias)))
    targets = (("this machine", {}), ("cuda sm90", dict(platform="cuda", compute_capability=9.0)))
    for where, target in targets:
        for label, kw in calls:
            e = attention.explain(q, q, q, **target, **kw)
            chosen = e.chosen.name if e.chosen is not None else "none"
            yield f"{where}: {label}", f"{chosen} ({e.implementation})"
            for backend, reason in e.reasons.items():
                yield f"    not {backend.name}", reason


def _int4_rows() -> Iterator[tuple[str, str]]:
    from jbackends import quantized
    from pallas_kernels.int4_matmul import cpp as int4_cpp

    yield "engines", ", ".join(quantized.supported_engines)
    yield (
        "C++ CPU kernel (XLA FFI)",
        (
            f"built, {int4_cpp.isa()}"
            if int4_cpp.available()
            else f"{int4_cpp.unavailable_reason()}: pure-XLA fallback in use"
        ),
    )
    yield "Pallas GPU kernels", "W4A16 and W4A8 (Triton), chosen per lowering platform"


def _flag_rows() -> Iterator[tuple[str, str]]:
    snap = _flag_state.current_flags()
    for f in _flag_declarations.FLAGS.values():
        torch = f.torch[0] if f.torch else ""
        # traced: part of the jit key (a change retraces); compile-time: XLA options through jb.jit
        kinds = [k for k, on in (("traced", f.traced), ("compile-time", f.compiler_options)) if on]
        kind = "+".join(kinds) or "runtime"
        yield f.name, f"{getattr(snap, f.name)!r:<22} {kind:<19} {torch}"


SECTIONS: tuple[tuple[str, Callable[[], Iterator[tuple[str, str]]]], ...] = (
    ("Versions", _versions),
    ("Devices", _devices),
    ("CPU", _cpu_rows),
    ("Attention backends", _attention_rows),
    ("int4 matmul engines", _int4_rows),
    ("Flags (value, kind, torch name)", _flag_rows),
)


def main() -> int:
    width = 40
    for title, rows in SECTIONS:
        print(f"\n== {title} ==")
        try:
            for key, value in rows():
                print(f"{key:<{width}} {value}")
        except Exception as e:  # keep going: one broken section must not hide the others
            print(f"{'(section failed)':<{width}} {type(e).__name__}: {e}")
    print()
    return 0
