"""The SDPA implementations: per backend and lowering platform, an ordered list of `Implementation`s.

Adding a kernel is one `Implementation` here plus its module under `pallas_kernels/attention/`; the
dispatcher (`attention_dispatch`) tries a backend's implementations for a platform in this order (or a
ranker's, see `dispatch.set_ranker`) and runs the first that can run the call. Kernel modules are
imported at their first use.

======================  ===============================  =====================================
backend                 cuda                             cpu / any other platform
======================  ===============================  =====================================
FLASH_ATTENTION         triton_decode, mosaic_flash,     cpp_flash (cpu only), xla_flash
                        triton_flash
EFFICIENT_ATTENTION     triton_mem_efficient             xla_mem_efficient
CUDNN_ATTENTION         cudnn                            (none)
MATH                    math                             math
======================  ===============================  =====================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jbackends._src.dispatch import Implementation, lazy
from jbackends._src.sdp_backends import SDPBackend

__all__ = ["IMPLEMENTATIONS", "BY_NAME", "implementations", "flag_filter"]

_PKG = "pallas_kernels.attention"
_ANY = "*"  # the list for every platform without its own


def _reasons(path: str):
    fn = lazy(f"{_PKG}.{path}")
    return lambda args, platform, device: fn(args, platform)


def _triton_missing() -> list:
    """The Pallas Triton backend is deprecated since jax 0.11: once a JAX drops it, its kernels say so
    and dispatch moves on (cuDNN, XLA)."""
    from pallas_kernels import triton_backend  # noqa: PLC0415 - loads Pallas: only when asked

    return triton_backend.missing()


def _triton_reasons(path: str):
    fn = _reasons(path)
    return lambda args, platform, device: _triton_missing() or fn(args, platform, device)


def _tf32(flags: Any, platform: str) -> dict:
    del platform
    return dict(allow_tf32=bool(flags.allow_tf32))


def _math_options(flags: Any, platform: str) -> dict:
    del platform
    return dict(low_precision=bool(flags.allow_fp16_bf16_reduction_math_sdp))


def _cudnn_reasons(args, platform, device):
    return lazy(f"{_PKG}.cudnn:unsupported")(args, platform, **dict(device))


def _mosaic_reasons(args, platform, device):
    cc = dict(device).get("compute_capability")
    return lazy(f"{_PKG}.mosaic_flash:unsupported")(args, platform, compute_capability=cc)


TRITON_DECODE = Implementation(
    "triton_decode",
    "Pallas Triton",
    ("cuda",),
    _triton_reasons("triton_decode:unsupported"),
    lazy(f"{_PKG}.triton_decode:attention"),
    _tf32,
    "split-K decode kernel for short queries (T <= 16); fused flash backward",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
TRITON_FLASH = Implementation(
    "triton_flash",
    "Pallas Triton",
    ("cuda",),
    _triton_reasons("triton_flash:unsupported"),
    lazy(f"{_PKG}.triton_flash:attention"),
    _tf32,
    "FlashAttention-2 forward and fused backward",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
MOSAIC_FLASH = Implementation(
    "mosaic_flash",
    "Pallas Mosaic GPU",
    ("cuda",),
    _mosaic_reasons,
    lazy(f"{_PKG}.mosaic_flash:attention"),
    _tf32,
    "FlashAttention-3 for sm90 (warp-specialized, TMA, WGMMA), forward and backward; 1.2-2.8x the "
    "speed of triton_flash (H200, bf16, head dims 64 / 128, L 4k / 16k, 2026-11-27)",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
CPP_FLASH = Implementation(
    "cpp_flash",
    "C++ (jax.ffi)",
    ("cpu",),
    _reasons("cpp_flash:unsupported"),
    lazy(f"{_PKG}.cpp_flash:attention"),
    description="FlashAttention-2 CPU kernel, AVX-512 / AVX2 + FMA, threaded; soft cap, bias, boolean mask",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
XLA_FLASH = Implementation(
    "xla_flash",
    "XLA",
    None,
    _reasons("xla_flash:unsupported"),
    lazy(f"{_PKG}.xla_flash:attention"),
    description="blockwise FlashAttention-2 in XLA (O(L) memory)",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
TRITON_MEM_EFFICIENT = Implementation(
    "triton_mem_efficient",
    "Pallas Triton",
    ("cuda",),
    _triton_reasons("triton_mem_efficient:unsupported"),
    lazy(f"{_PKG}.triton_mem_efficient:attention"),
    _tf32,
    "flash tiling with bias / mask tiles",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
XLA_MEM_EFFICIENT = Implementation(
    "xla_mem_efficient",
    "XLA",
    None,
    _reasons("xla_mem_efficient:unsupported"),
    lazy(f"{_PKG}.xla_mem_efficient:attention"),
    description="blockwise XLA with bias / mask tiles",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
CUDNN = Implementation(
    "cudnn",
    "cuDNN (jax.nn)",
    ("cuda",),
    _cudnn_reasons,
    lazy(f"{_PKG}.cudnn:attention"),
    description="jax.nn.dot_product_attention(implementation='cudnn')",
    forward_mode=False,  # a custom_vjp: reverse-mode gradients only
)
MATH = Implementation(
    "math",
    "XLA",
    None,
    _reasons("base:unsupported"),
    lazy(f"{_PKG}.base:attention"),
    _math_options,
    "the reference: materialised scores, float32 softmax",
    forward_mode=True,  # plain JAX ops: jax.jvp, jacfwd and hessian run through it
    symbolic_shapes=True,  # and shape-polymorphic exports
)

#: backend -> {lowering platform, or "*" for every other one: implementations in the order tried}.
IMPLEMENTATIONS: dict[SDPBackend, dict[str, tuple[Implementation, ...]]] = {
    SDPBackend.FLASH_ATTENTION: {
        # mosaic_flash ahead of triton_flash: on an H200 (2026-11-27, docs/gpu/README.md) it ran at
        # 1.19-2.04x triton_flash's speed forward and 1.27-2.75x forward + backward (bf16, head dims 64 /
        # 128, L 4k / 16k, causal and not), and passed the compiled lane cases it reached. It runs
        # sm90 and half precision only: other calls go on to triton_flash, and so do local windows
        # under 'auto' (flag_filter) until the lane has run its window cases compiled. Short queries
        # stay with the split-K decode kernel.
        "cuda": (TRITON_DECODE, MOSAIC_FLASH, TRITON_FLASH),
        "cpu": (CPP_FLASH, XLA_FLASH),
        _ANY: (XLA_FLASH,),
    },
    SDPBackend.EFFICIENT_ATTENTION: {"cuda": (TRITON_MEM_EFFICIENT,), _ANY: (XLA_MEM_EFFICIENT,)},
    SDPBackend.CUDNN_ATTENTION: {"cuda": (CUDNN,)},
    SDPBackend.MATH: {_ANY: (MATH,)},
}

#: implementation name -> implementation.
BY_NAME: dict[str, Implementation] = {
    impl.name: impl for table in IMPLEMENTATIONS.values() for impls in table.values() for impl in impls
}


def implementations(backend: int, platform: str) -> tuple[Implementation, ...]:
    """The implementations of ``backend`` when lowering for ``platform``, in the order tried."""
    table = IMPLEMENTATIONS[SDPBackend(int(backend))]
    return table.get(platform, table.get(_ANY, ()))


def flag_filter(flags: Any, backend: int, platform: str, args: Any = None) -> Mapping[str, str]:
    """The implementations the flags exclude for the call ``args`` (name -> reason). ``flash_cpu_kernel``
    filters FLASH's list when lowering for CPU ('cpp': only the C++ kernel; 'xla': never it);
    ``flash_cuda_kernel`` filters it when lowering for CUDA ('auto': all, in registry order, except the
    Mosaic GPU kernel for local windows, which the GPU lane has run compiled in one case only so far;
    'triton': only the Triton kernels; 'mosaic': only the Mosaic GPU kernel)."""
    if int(backend) != SDPBackend.FLASH_ATTENTION:
        return {}
    if platform == "cpu":
        mode = flags.flash_cpu_kernel
        if mode == "cpp":
            return {XLA_FLASH.name: "flash_cpu_kernel='cpp' (only the C++ kernel may run FLASH on CPU)"}
        if mode == "xla":
            return {CPP_FLASH.name: "flash_cpu_kernel='xla' (the C++ kernel is not used)"}
        return {}
    if platform == "cuda":
        mode = flags.flash_cuda_kernel
        if mode == "triton":
            return {MOSAIC_FLASH.name: "flash_cuda_kernel='triton' (the Mosaic GPU kernel is not used)"}
        if mode == "auto" and args is not None and args.window is not None:
            return {
                MOSAIC_FLASH.name: (
                    "flash_cuda_kernel='auto' keeps local windows on the Triton kernel until the GPU lane "
                    "has run the Mosaic GPU kernel's window cases compiled (flash_cuda_kernel='mosaic' "
                    "selects it)"
                )
            }
        if mode == "mosaic":
            why = "flash_cuda_kernel='mosaic' (only the Mosaic GPU kernel may run FLASH on CUDA)"
            return {TRITON_DECODE.name: why, TRITON_FLASH.name: why}
    return {}
