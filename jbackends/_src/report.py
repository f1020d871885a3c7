"""`python -m jbackends`: an environment and backends report, like torch's collect_env.

Sections: versions, devices, CPU, every backend/kernel and whether it can run here (with the reason when it
cannot), and every flag with its value and its torch spelling. Each section is computed independently: a
failure in one is printed in place and does not hide the others.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
from collections.abc import Callable, Iterator

from jbackends._src import flags as _flags

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
            d.metadata["Name"] for d in importlib.metadata.distributions()
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


def _optional_section(module: str, func: str) -> Callable[[], Iterator[tuple[str, str]]]:
    """A section provided by another module's `report_rows()`-style function, if that module is present."""

    def rows() -> Iterator[tuple[str, str]]:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            yield module, f"not available ({e})"
            return
        fn = getattr(mod, func, None)
        if fn is None:
            yield module, f"has no {func}()"
            return
        yield from fn()

    return rows


def _flag_rows() -> Iterator[tuple[str, str]]:
    snap = _flags.current_flags()
    for f in _flags.FLAGS.values():
        torch = f.torch[0] if f.torch else ""
        kind = "traced" if f.traced else ("compile-time" if f.compiler_options else "runtime")
        yield f.name, f"{getattr(snap, f.name)!r:<22} {kind:<12} {torch}"


SECTIONS: tuple[tuple[str, Callable[[], Iterator[tuple[str, str]]]], ...] = (
    ("Versions", _versions),
    ("Devices", _devices),
    ("CPU", _optional_section("jbackends.cpu", "report_rows")),
    ("Attention backends (this platform)", _optional_section("jbackends.attention", "report_rows")),
    ("int4 matmul engines", _optional_section("jbackends.quantized", "report_rows")),
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
