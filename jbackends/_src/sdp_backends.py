"""The SDPA backends, declared once: torch's names and values, their flags, aliases and default order.

A leaf module (it imports nothing from jbackends): the flag declarations, the dispatcher, the
implementation registry and the public API all read the backend identity from here.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

__all__ = ["SDPBackend", "RUNNABLE", "DEFAULT_ORDER", "FLAG", "ALIASES", "name_of", "lookup"]


class SDPBackend(enum.IntEnum):
    """The SDPA backends, with torch's names and values (``torch.nn.attention.SDPBackend``)."""

    ERROR = -1
    MATH = 0
    FLASH_ATTENTION = 1
    EFFICIENT_ATTENTION = 2
    CUDNN_ATTENTION = 3
    OVERRIDEABLE = 4


#: The backends jbackends can run, in value order.
RUNNABLE = (
    SDPBackend.MATH,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
)

#: The order enabled backends are tried in when the flags set none: jbackends' own, not torch's (torch
#: tries MATH before CUDNN; here cuDNN, a fused kernel, comes before the materialised MATH path).
DEFAULT_ORDER = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
)

#: backend -> the short name of the flag that enables it (`jb.with_backends(flash=False)`).
FLAG = {
    SDPBackend.MATH: "math",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "mem_efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
}

#: backend -> the help text of its flag.
HELP = {
    SDPBackend.FLASH_ATTENTION: "Allow the flash attention SDPA backend (Pallas on GPU, blockwise XLA on CPU).",
    SDPBackend.EFFICIENT_ATTENTION: "Allow the memory-efficient SDPA backend (supports an additive bias).",
    SDPBackend.MATH: "Allow the reference (math) SDPA backend, which can serve every call.",
    SDPBackend.CUDNN_ATTENTION: "Allow the cuDNN SDPA backend (GPU only, via jax.nn's cudnn implementation).",
}
#: The order the enable flags are declared (and documented) in.
DECLARATION_ORDER = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION,
)

#: Short spellings accepted wherever a backend is named by string (case-insensitive).
ALIASES = {
    "FLASH": SDPBackend.FLASH_ATTENTION,
    "EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
    "MEM_EFFICIENT": SDPBackend.EFFICIENT_ATTENTION,
    "CUDNN": SDPBackend.CUDNN_ATTENTION,
}


def name_of(backend: int) -> str:
    """``"FLASH_ATTENTION"`` for ``SDPBackend.FLASH_ATTENTION`` (or its value 1)."""
    return SDPBackend(int(backend)).name


def lookup(b: Any) -> SDPBackend | None:
    """The runnable `SDPBackend` that ``b`` names (a member, its value, its name or an alias, or a
    torch ``SDPBackend``), else None; callers raise their own error naming their argument."""
    if isinstance(b, SDPBackend):
        code = b
    elif isinstance(b, str):
        key = b.upper()
        code = ALIASES.get(key) or SDPBackend.__members__.get(key)
    elif isinstance(b, (int, np.integer)) and not isinstance(b, bool):
        code = SDPBackend._value2member_map_.get(int(b))
    elif isinstance(getattr(b, "value", None), int) and hasattr(b, "name"):  # torch's enum, or another
        code = SDPBackend._value2member_map_.get(int(b.value))
    else:
        return None
    return code if code in RUNNABLE else None
