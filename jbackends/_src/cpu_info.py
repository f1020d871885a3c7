"""Host CPU features, read from the OS, and the instruction set XLA's CPU backend will target.

Sources, in order: `/proc/cpuinfo` (Linux), `sysctl` (macOS / BSD), `platform.machine()` (everything
else). No guessing: a feature is reported only when the OS lists it.

XLA:CPU compiles with LLVM for the host CPU (`llvm::sys::getHostCPUFeatures`), optionally capped by
the `--xla_cpu_max_isa` flag (values SSE4_2, AVX, AVX2, AVX512, AVX512_VNNI, AVX512_BF16, AMX,
AMX_FP16, verified against the installed jaxlib). `xla_cpu_target()` therefore reports the highest of
those ISAs that the host lists, capped by `XLA_FLAGS=--xla_cpu_max_isa=...` when given.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from typing import Any

# XLA's --xla_cpu_max_isa values, lowest to highest, with the /proc/cpuinfo flags each one needs.
_XLA_ISAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("SSE4_2", ("sse4_2",)),
    ("AVX", ("avx",)),
    ("AVX2", ("avx2", "fma")),
    ("AVX512", ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
    ("AVX512_VNNI", ("avx512_vnni",)),
    ("AVX512_BF16", ("avx512_bf16",)),
    ("AMX", ("amx_bf16", "amx_int8", "amx_tile")),
    ("AMX_FP16", ("amx_fp16",)),
)
XLA_CPU_ISAS: tuple[str, ...] = tuple(name for name, _ in _XLA_ISAS)

# macOS sysctl machdep.cpu.* spellings -> Linux /proc/cpuinfo spellings.
_SYSCTL_ALIASES = {
    "sse4.2": "sse4_2",
    "sse4.1": "sse4_1",
    "avx1.0": "avx",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
}


def _read_proc_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The feature words of the first processor in `/proc/cpuinfo` text (x86 `flags`, arm `Features`)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return frozenset()


def _sysctl_features() -> frozenset[str]:
    words: set[str] = set()
    for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features", "machdep.cpu.extfeatures"):
        try:
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0:
            words.update(w.lower() for w in out.stdout.split())
    # Apple silicon lists hw.optional.* booleans instead.
    for key, word in (("hw.optional.arm.FEAT_SVE", "sve"), ("hw.optional.neon", "asimd")):
        try:
            out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip() == "1":
            words.add(word)
    return frozenset(_SYSCTL_ALIASES.get(w, w) for w in words)


@functools.lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """The CPU feature words the OS reports (lower case, Linux spelling)."""
    text = _read_proc_cpuinfo()
    if text is not None:
        return parse_cpuinfo(text)
    if platform.system() in ("Darwin", "FreeBSD"):
        return _sysctl_features()
    return frozenset()


def capability_from(machine: str, features: frozenset[str]) -> str:
    """torch's `get_cpu_capability()` answer for a machine name and its feature words.

    x86: "AVX512" when avx512f/bw/dq/vl are all present, "AVX2" when avx2 and fma are, "NO AVX" when the
    CPU has no AVX at all, else "DEFAULT". ppc64le: "VSX". s390x: "Z VECTOR". aarch64: "SVE256" when SVE
    is listed (torch additionally checks the vector length, which the OS does not report; we say "SVE"),
    else "DEFAULT".
    """
    m = machine.lower()
    if m in ("x86_64", "amd64", "i386", "i686", "x86"):
        if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= features:
            return "AVX512"
        if {"avx2", "fma"} <= features:
            return "AVX2"
        if "avx" not in features:
            return "NO AVX"
        return "DEFAULT"
    if m.startswith("ppc64"):
        return "VSX"
    if m == "s390x":
        return "Z VECTOR"
    if m in ("aarch64", "arm64") and "sve" in features:
        return "SVE"
    return "DEFAULT"


def _max_isa_from_xla_flags(xla_flags: str | None) -> str | None:
    if not xla_flags:
        return None
    match = re.search(r"--xla_cpu_max_isa=([A-Za-z0-9_\"']*)", xla_flags)
    if not match:
        return None
    value = match.group(1).strip("\"'").upper()
    return value or None


def xla_cpu_target(
    machine: str | None = None, features: frozenset[str] | None = None, xla_flags: str | None = None
) -> dict[str, Any]:
    """What XLA's CPU backend will generate code for on this host.

    Returns a dict with `machine`, `isa` (highest XLA ISA the host supports, capped by
    `--xla_cpu_max_isa`; None on non-x86 hosts, where XLA targets the host's own feature set), `host_isa`
    (the uncapped value), `max_isa_flag` (the flag value in force or None) and `isas` (the ISAs XLA knows).
    """
    machine = machine if machine is not None else platform.machine()
    features = features if features is not None else host_features()
    xla_flags = xla_flags if xla_flags is not None else os.environ.get("XLA_FLAGS", "")
    host_isa = None
    if machine.lower() in ("x86_64", "amd64"):
        for name, needs in _XLA_ISAS:
            if set(needs) <= features:
                host_isa = name
            else:
                break
    cap = _max_isa_from_xla_flags(xla_flags)
    isa = host_isa
    if cap is not None and host_isa is not None and cap in XLA_CPU_ISAS:
        isa = XLA_CPU_ISAS[min(XLA_CPU_ISAS.index(cap), XLA_CPU_ISAS.index(host_isa))]
    return {"machine": machine, "isa": isa, "host_isa": host_isa, "max_isa_flag": cap, "isas": XLA_CPU_ISAS}


@functools.lru_cache(maxsize=1)
def probe_cpu_dot_hlo() -> str:
    """Optimised HLO text of a small float32 dot compiled by XLA:CPU with this process's XLA_FLAGS.

    Used to report, from what XLA actually emits, which libraries XLA:CPU calls (XNNPACK/YNNPACK
    fusions, oneDNN custom calls). Compiled once per process (a few tens of milliseconds).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    cpu = jax.devices("cpu")[0]
    spec = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=SingleDeviceSharding(cpu))
    return jax.jit(lambda a, b: a @ b).lower(spec, spec).compile().as_text()


def cpu_dot_libraries(hlo: str | None = None) -> frozenset[str]:
    """Which libraries the probe dot was lowered to: subset of {"xnnpack", "ynnpack", "onednn"}."""
    text = (hlo if hlo is not None else probe_cpu_dot_hlo()).lower()
    found = set()
    if "__xnn_fusion" in text or "xnn_fusion" in text:
        found.add("xnnpack")
    if "__ynn_fusion" in text or "ynn_fusion" in text:
        found.add("ynnpack")
    if "onednn" in text:
        found.add("onednn")
    return frozenset(found)
