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
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

__all__ = [
    "gpu_call",
    "triton_call",
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


# ----------------------------------------------------------------------------------------------
# Multi-platform lowering of a GPU pallas_call (Triton or Mosaic GPU).
# ----------------------------------------------------------------------------------------------
#
# `jax.lax.platform_dependent(cpu=xla_path, cuda=triton_path)` lowers *both* branches for every
# lowering platform of the module, and a Triton `pallas_call` refuses to lower for "cpu" ("Only
# interpret mode is supported on CPU backend"), so an export for ("cpu", "cuda") failed. This
# primitive wraps the pallas_call: on "cuda" it lowers to the GPU kernel; in a multi-platform
# lowering its other-platform branch (never selected by the dispatch's platform_dependent) is a
# stand-in of the same outputs in plain, correct HLO (the kernel in interpret mode, or an XLA
# path). Lowered for "cpu" alone it raises, like Pallas does.

_gpu_call_p = jex_core.Primitive("jb_pallas_gpu_call")
_gpu_call_p.multiple_results = True


def _gpu_call_impl(*args, gpu, cpu):
    del cpu
    return jex_core.jaxpr_as_fun(gpu)(*args)


def _gpu_call_abstract_eval(*avals, gpu, cpu):
    del avals, cpu
    return list(gpu.out_avals)


def _gpu_call_lower_gpu(ctx, *args, gpu, cpu):
    del cpu
    return mlir.lower_fun(jex_core.jaxpr_as_fun(gpu), multiple_results=True)(ctx, *args)


def _gpu_call_lower_other(ctx, *args, gpu, cpu):
    del gpu
    platforms = ctx.platforms or ctx.module_context.platforms
    if len(ctx.module_context.platforms) == 1:
        raise ValueError(
            f"the Pallas GPU kernels lower for CUDA only, not for "
            f"{tuple(platforms)}; pass interpret=True (testing) or use the XLA backend"
        )
    return mlir.lower_fun(jex_core.jaxpr_as_fun(cpu), multiple_results=True)(ctx, *args)


def _gpu_call_batch(args, dims, *, gpu, cpu):
    axes = [d if isinstance(d, int) else None for d in dims]  # not-mapped dims are None here
    fg = jax.vmap(jex_core.jaxpr_as_fun(gpu), in_axes=axes)
    fc = jax.vmap(jex_core.jaxpr_as_fun(cpu), in_axes=axes)
    outs = bind_gpu_call(fg, fc, args)
    return outs, [0] * len(outs)


def bind_gpu_call(fn_gpu, fn_cpu, leaves):
    gpu = jax.make_jaxpr(lambda *a: tuple(fn_gpu(*a)))(*leaves)
    cpu = jax.make_jaxpr(lambda *a: tuple(fn_cpu(*a)))(*leaves)
    return _gpu_call_p.bind(*leaves, gpu=gpu, cpu=cpu)


_gpu_call_p.def_impl(_gpu_call_impl)
_gpu_call_p.def_abstract_eval(_gpu_call_abstract_eval)
mlir.register_lowering(_gpu_call_p, _gpu_call_lower_other)
for _p in ("cuda", "rocm"):
    mlir.register_lowering(_gpu_call_p, _gpu_call_lower_gpu, platform=_p)
batching.primitive_batchers[_gpu_call_p] = _gpu_call_batch


def gpu_call(gpu_fn: Callable, other_fn: Callable, operands: tuple):
    """``gpu_fn(*operands)`` (a tuple of arrays) lowered for CUDA; in a multi-platform lowering its
    branch for any other platform is ``other_fn`` (same outputs, never selected there: see above)."""
    leaves = list(operands)
    out_tree = jax.tree.structure(jax.eval_shape(gpu_fn, *leaves))
    outs = bind_gpu_call(
        lambda *a: jax.tree.leaves(gpu_fn(*a)), lambda *a: jax.tree.leaves(other_fn(*a)), leaves
    )
    return jax.tree.unflatten(out_tree, outs)


def triton_call(make_call: Callable, operands: tuple, *, interpret: bool):
    """Runs ``make_call(interpret)(*operands)`` (a ``pl.pallas_call``; ``None`` operands allowed).

    With ``interpret=False`` the call is wrapped so that it also lowers inside a multi-platform
    (e.g. ``platforms=("cpu", "cuda")``) export (`pallas_kernels.gpu.gpu_call`; its other-platform
    branch, never selected, is the kernel in interpret mode).
    """
    if interpret:
        return make_call(True)(*operands)
    leaves, tree = jax.tree.flatten(operands)
    out_tree = jax.tree.structure(
        jax.eval_shape(lambda *a: make_call(False)(*jax.tree.unflatten(tree, a)), *leaves)
    )

    def flat(interp):
        return lambda *a: jax.tree.leaves(make_call(interp)(*jax.tree.unflatten(tree, a)))

    outs = bind_gpu_call(flat(False), flat(True), leaves)
    return jax.tree.unflatten(out_tree, outs)
