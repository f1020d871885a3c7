"""Measured speed between SDPA backends: the default order on a device where one is known to be faster.

torch's priority list is one fixed order for every call. Ours is too, except where a measurement says
another enabled backend is faster for the call on this device: while the user has set no priority
(``sdpa_prefer_faster`` on: setting ``sdpa_priority`` in any way, ``sdpa_kernel(..., set_priority=True)``
included, turns it off), dispatch tries the faster backend first, and ``explain()`` gives the measurement as the
reason the others were not used. Outside a measured envelope nothing moves: a guess is not a
measurement.

Each :class:`Measurement` is one envelope of calls (platform, compute capability, dtypes, head dims,
lengths) in which ``faster`` beat every backend in ``than`` on every row measured, with where and how it
was measured. Add a row with :func:`add` (or edit :data:`MEASURED`) after a benchmark run on a device
(``benchmarks/attention_gpu.py`` prints the ratios).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping, Optional, Sequence

from jbackends._src.sdp_backends import DEFAULT_ORDER, SDPBackend
from pallas_kernels.attention import base

__all__ = ["Measurement", "MEASURED", "add", "applies", "faster_first"]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """``faster`` beat each backend of ``than`` on every row measured inside this envelope.

    The envelope: lowering ``platform``; a device of at least ``min_compute_capability``; q/k/v of one of
    ``dtypes``; ``min_head_dim <= head dim <= max_head_dim`` (q/k and v alike); query and key lengths of
    at least ``min_length``, queries of at most ``max_q_length`` rows (None: any) and keys of at least
    ``min_kv_length``. ``evidence`` says what was measured, on what and when (shown by ``explain()``).
    """

    faster: SDPBackend
    than: tuple
    platform: str
    min_compute_capability: float
    dtypes: tuple
    min_head_dim: int
    max_head_dim: int
    min_length: int
    evidence: str
    max_q_length: Optional[int] = None
    min_kv_length: int = 0

    def __post_init__(self):
        if not isinstance(self.faster, SDPBackend) or not all(isinstance(b, SDPBackend) for b in self.than):
            raise TypeError("Measurement: `faster` and `than` must be SDPBackend members")
        if self.faster in self.than:
            raise ValueError(f"Measurement: {self.faster.name} cannot be faster than itself")


MEASURED: list[Measurement] = [
    Measurement(
        faster=SDPBackend.CUDNN_ATTENTION,
        than=(SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
        platform="cuda",
        min_compute_capability=9.0,
        dtypes=("bfloat16", "float16"),
        min_head_dim=64,
        max_head_dim=128,
        min_length=1024,
        evidence=(
            "measured faster here: cuDNN ran at 1.05-1.18x the speed of our Pallas Mosaic GPU flash "
            "kernel forward+backward and 1.00-1.09x forward, except the causal forward at head dim 128, "
            "L 16k, where ours was 2% faster (H200, bf16, head dims 64/128, L 4k/16k, causal and not, "
            "2026-11-27; L 1k-2k not measured against it), and at 1.2-3.2x our Pallas Triton flash "
            "kernel's (the memory-efficient kernel shares its tiling; H100, L 1k-16k, 2026-11-23); "
            "benchmarks/attention_gpu.py, jax 0.11.2, CUDA 13"
        ),
    ),
    Measurement(
        faster=SDPBackend.CUDNN_ATTENTION,
        than=(SDPBackend.FLASH_ATTENTION,),
        platform="cuda",
        min_compute_capability=9.0,
        dtypes=("bfloat16",),
        min_head_dim=128,
        max_head_dim=128,
        min_length=1,
        max_q_length=1,
        min_kv_length=131072,
        evidence=(
            "measured faster here: at decode (1 query row, 128k keys, GQA 32/8 heads of 128, batch 4) "
            "cuDNN took 573 us and our Pallas Triton decode kernel 626 us (at 16k keys they tied, 110 us; "
            "H200, bf16; benchmarks/attention_gpu.py, jax 0.11.2, CUDA 13, 2026-11-26)"
        ),
    ),
]
_LOCK = threading.Lock()


def add(measurement: Measurement) -> None:
    """Adds a measured envelope (process-wide, read at trace time: not part of the jit key)."""
    if not isinstance(measurement, Measurement):
        raise TypeError(f"add: expected a Measurement, got {type(measurement).__name__}")
    with _LOCK:
        MEASURED.append(measurement)


def applies(
    m: Measurement, args: base.AttentionArgs, platform: str, device: Optional[Mapping[str, Any]]
) -> bool:
    """Whether the call ``args`` lowered for ``platform`` on ``device`` lies inside ``m``'s envelope.
    An unknown device (no compute capability) is outside every envelope."""
    cc = (device or {}).get("compute_capability")
    return (
        platform == m.platform
        and cc is not None
        and cc >= m.min_compute_capability
        and str(args.dtype) in m.dtypes
        and m.min_head_dim <= min(args.head_dim, args.v_head_dim)
        and max(args.head_dim, args.v_head_dim) <= m.max_head_dim
        and min(args.q_len, args.kv_len) >= m.min_length
        and (m.max_q_length is None or args.q_len <= m.max_q_length)
        and args.kv_len >= m.min_kv_length
        # measured on plain calls (causal or not): a bias, lengths or a window were not measured
        and args.bias is None
        and args.q_seq_lengths is None
        and args.kv_seq_lengths is None
        and args.window is None
    )


def faster_first(
    order: Sequence[int],
    flags: Any,
    args: base.AttentionArgs,
    platform: str,
    device: Optional[Mapping[str, Any]],
) -> tuple[tuple, dict]:
    """``order`` with a backend measured faster for this call moved ahead of those it beat, and
    ``{backend moved behind: (the faster backend, the evidence)}``. Unchanged while the user has set a
    priority."""
    order = tuple(order)
    if not flags.sdpa_prefer_faster or tuple(flags.sdpa_priority) != tuple(int(b) for b in DEFAULT_ORDER):
        return order, {}
    with _LOCK:
        measured = tuple(MEASURED)
    why: dict[int, tuple] = {}
    for m in measured:
        if not applies(m, args, platform, device) or int(m.faster) not in order:
            continue
        beaten = [int(b) for b in m.than if int(b) in order]
        first = min([order.index(b) for b in beaten], default=None)
        if first is None or order.index(int(m.faster)) < first:
            continue
        rest = [b for b in order if b != int(m.faster)]
        order = tuple(rest[:first] + [int(m.faster)] + rest[first:])
        why.update({b: (int(m.faster), m.evidence) for b in beaten})
    return order, why
