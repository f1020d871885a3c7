"""What the GPU kernels need to know about the GPU they are lowered for.

Kernels pick tile sizes and code paths from the target's compute capability (80 for an A100, 90 for
an H100 / H200). On a machine with a GPU that is the local device's; a CPU-only machine can lower
(``jax.export(..., platforms=["cuda"])``) for a named GPU inside :func:`cuda_target`, which sets the
abstract device JAX's Pallas GPU lowering asks for since jax 0.11 ("No supported GPU devices found,
please specify an abstract GPU device using AbstractDevice").

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels import gpu
  >>> with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
  ...     gpu.compute_capability()
  90
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Mapping, Optional

import jax

__all__ = [
    "GPU_PLATFORMS",
    "TRITON_PLATFORMS",
    "cuda_target",
    "compute_capability",
    "compute_capability_of",
    "compute_capability_of_kind",
]

#: Lowering-platform names that mean an NVIDIA GPU (``"gpu"`` is JAX's device platform name).
GPU_PLATFORMS = ("cuda", "gpu")

#: Lowering-platform names Pallas Triton kernels lower for: an NVIDIA GPU, or an AMD one (``"rocm"``),
#: where the kernel needs nothing CUDA-specific (the int4 kernels; the attention kernels ask for CUDA).
TRITON_PLATFORMS = GPU_PLATFORMS + ("rocm",)

# The device kinds JAX's Pallas GPU lowering knows, by family; the first match wins ("A100" before
# "A10" is kept by the word boundary in the pattern).
_KIND_CC = (
    ("GB300", 103),
    ("B300", 103),
    ("GB200", 100),
    ("B200", 100),
    ("GB10", 121),
    ("Thor", 110),
    ("RTX PRO", 120),
    ("GH200", 90),
    ("H200", 90),
    ("H100", 90),
    ("L40", 89),
    ("L4", 89),
    ("RTX 4090", 89),
    ("A100", 80),
    ("A30", 80),
    ("A10", 86),
    ("T4", 75),
)


def compute_capability_of_kind(device_kind: str) -> Optional[int]:
    """The compute capability (e.g. ``90``) of an NVIDIA device kind string, None if unknown.

    Example:
      >>> from pallas_kernels import gpu
      >>> gpu.compute_capability_of_kind("NVIDIA A100-SXM4-80GB"), gpu.compute_capability_of_kind("TPU v5")
      (80, None)
    """
    for name, cc in _KIND_CC:
        if re.search(r"\b" + re.escape(name) + r"\b", device_kind):
            return cc
    return None


def _abstract_device():
    try:
        return jax.sharding.get_abstract_mesh().abstract_device
    except AttributeError:  # an older JAX with no abstract devices
        return None


def compute_capability() -> Optional[int]:
    """Compute capability of the GPU being lowered for: the :func:`cuda_target`, else the first local
    GPU; None when there is neither (a CPU-only machine outside :func:`cuda_target`)."""
    dev = _abstract_device()
    if dev is not None and dev.platform in GPU_PLATFORMS:
        cc = compute_capability_of_kind(dev.device_kind)
        if cc is not None:
            return cc
    try:
        local = jax.devices("gpu")[0]
        return int(str(local.compute_capability).replace(".", ""))
    except Exception:  # noqa: BLE001 - no GPU backend, or a device without the attribute
        return None


def compute_capability_of(device: Mapping[str, Any]) -> Optional[int]:
    """The compute capability (e.g. ``90``) a device record names (its ``compute_capability``, ``9.0``
    as the dispatcher writes it or ``90``); None when it names none.

    Example:
      >>> from pallas_kernels import gpu
      >>> gpu.compute_capability_of({"compute_capability": 9.0}), gpu.compute_capability_of({})
      (90, None)
    """
    cc = device.get("compute_capability")
    if cc is None:
        return None
    return int(round(float(cc) * 10)) if float(cc) < 20 else int(cc)


@contextlib.contextmanager
def cuda_target(device_kind: str = "NVIDIA H100 80GB HBM3") -> Iterator[None]:
    """Lower GPU kernels for ``device_kind`` inside this block, also on a machine with no GPU.

    Use it around ``jax.export(..., platforms=["cuda"])`` (or ``.lower()`` for CUDA). It sets an
    abstract mesh whose device is ``device_kind`` (the axes of a mesh already in force are kept), which
    is what JAX's Pallas GPU lowering reads; on a JAX without abstract devices it changes nothing.

    Args:
      device_kind: an NVIDIA device kind as JAX reports it (``jax.devices()[0].device_kind``).

    Raises:
      ValueError: ``device_kind`` names no NVIDIA GPU this module knows.
    """
    if not isinstance(device_kind, str) or compute_capability_of_kind(device_kind) is None:
        known = ", ".join(name for name, _ in _KIND_CC)
        raise ValueError(f"cuda_target: device_kind must name an NVIDIA GPU ({known}); got {device_kind!r}")
    sharding = jax.sharding
    if not hasattr(sharding, "AbstractDevice") or not hasattr(sharding, "use_abstract_mesh"):
        yield
        return
    dev = sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    # Keep the axes of a mesh already in force (its shardings still apply); else an empty mesh, which
    # carries the device and nothing else (no axes, so no sharding-in-types on eager code).
    cur = sharding.get_abstract_mesh()
    if cur is not None and not cur.empty:
        mesh = sharding.AbstractMesh(cur.axis_sizes, cur.axis_names, cur.axis_types, abstract_device=dev)
    else:
        mesh = sharding.AbstractMesh((), (), abstract_device=dev)
    with sharding.use_abstract_mesh(mesh):
        yield
