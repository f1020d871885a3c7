"""`torch.backends.cpu`, for JAX: `get_cpu_capability()` and what XLA's CPU backend targets.

Example:
  >>> import jbackends as jb
  >>> jb.cpu.get_cpu_capability() in ("DEFAULT", "VSX", "Z VECTOR", "NO AVX", "AVX2", "AVX512", "SVE")
  True
"""

from __future__ import annotations

import platform as _platform
from typing import Any

from jbackends._src import cpu_info as _cpu_info

__all__ = ["get_cpu_capability", "xla_cpu_target"]


def get_cpu_capability() -> str:
    """The host CPU's vector capability, in torch's vocabulary, read from the OS.

    One of "DEFAULT", "VSX" (ppc64le), "Z VECTOR" (s390x), "NO AVX", "AVX2", "AVX512" (x86) or "SVE"
    (aarch64 with SVE). Features come from `/proc/cpuinfo` on Linux and `sysctl` on macOS; nothing is
    guessed. What XLA will actually generate is `xla_cpu_target()`.

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.cpu.get_cpu_capability(), str)
      True
    """
    return _cpu_info.capability_from(_platform.machine(), _cpu_info.host_features())


def xla_cpu_target() -> dict[str, Any]:
    """The instruction set XLA:CPU compiles for here: the host ISA capped by `--xla_cpu_max_isa`.

    Returns:
      A dict with `machine`, `isa` (e.g. "AVX512_BF16"; None off x86, where XLA uses the host's
      features), `host_isa`, `max_isa_flag` (from `XLA_FLAGS`, or None) and `isas` (XLA's ISA names).

    Example:
      >>> import jbackends as jb
      >>> sorted(jb.cpu.xla_cpu_target())
      ['host_isa', 'isa', 'isas', 'machine', 'max_isa_flag']
    """
    return _cpu_info.xla_cpu_target()
