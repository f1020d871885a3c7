"""`torch.backends.cuda`, for JAX: SDPA backend switches and `cuda.matmul` precision attributes.

Functions and attributes are generated from the flag registry (`jbackends/_src/flag_declarations.py`):
`enable_flash_sdp(bool)` / `flash_sdp_enabled()`, the same for `mem_efficient`, `math`, `cudnn`,
`allow_fp16_bf16_reduction_math_sdp(bool)`, and `matmul.allow_tf32`,
`matmul.allow_fp16_reduced_precision_reduction`, `matmul.allow_bf16_reduced_precision_reduction`.
Setters change process defaults; getters return the value in force (scopes included).

Also here (docs/backends.md has the full table): `is_built()` (a CUDA jaxlib plugin is installed),
`is_available()` (JAX has a CUDA device), `preferred_linalg_library(backend=None)` (GPU eigensolver of
`jb.linalg.eig`), `preferred_blas_library(backend=None)` (cuBLASLt on/off through `jb.jit`),
`preferred_rocm_fa_library` (only "default") and `cufft_plan_cache` (compiled-FFT LRU used by `jb.fft`).

Example:
  >>> import jbackends as jb
  >>> jb.cuda.matmul.allow_tf32
  False
"""

import sys as _sys

from jbackends._src import mirror as _mirror
from jbackends._src import platforms as _platforms
from jbackends._src.fft import cufft_plan_cache as cufft_plan_cache

# --- non-flag rows of torch.backends.cuda ---


def is_built() -> bool:
    """Whether a CUDA-enabled jaxlib plugin (jax-cuda12/13-plugin) is installed.

    Like torch's, this does not mean a GPU is usable here; see `is_available()`.

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.cuda.is_built(), bool)
      True
    """
    return _platforms.cuda_built()


def is_available() -> bool:
    """Whether JAX has a CUDA device in this process (`jax.devices("cuda")` is not empty).

    Example:
      >>> import jbackends as jb
      >>> isinstance(jb.cuda.is_available(), bool)
      True
    """
    return bool(_platforms.devices("cuda"))


def preferred_rocm_fa_library(backend: str | None = None) -> str:
    """torch's ROCm flash-attention library choice; JAX has none, so only `"default"` is accepted.

    jbackends' flash attention is a Pallas kernel on every GPU; choose SDPA backends with
    `jb.attention.sdpa_kernel` / `jb.cuda.enable_flash_sdp` instead. Other values raise `ValueError`.

    Example:
      >>> import jbackends as jb
      >>> jb.cuda.preferred_rocm_fa_library()
      'default'
    """
    if backend is not None and (not isinstance(backend, str) or backend.lower() != "default"):
        raise ValueError(
            f"preferred_rocm_fa_library: {backend!r} is not available in JAX (no AOTriton/CK "
            "flash-attention binding); only 'default' is accepted. Pick SDPA backends with "
            "jb.attention.sdpa_kernel or jb.cuda.enable_flash_sdp"
        )
    return "default"


def is_ck_sdpa_available() -> bool:
    """False: JAX has no ROCm composable-kernel (CK) attention; use `jb.attention.sdpa_kernel` backends.

    Example:
      >>> import jbackends as jb
      >>> jb.cuda.is_ck_sdpa_available()
      False
    """
    return False


_WORKSPACE_DOC = """None: XLA sizes the {lib} workspace itself, per GEMM call (a scratch output of each cuBLAS /
    cuBLASLt custom call in the compiled HLO, sized by XLA for the GPU); there is no process-wide size
    to read or set (torch reads
    CUBLAS_WORKSPACE_CONFIG / CUBLASLT_WORKSPACE_SIZE, which XLA ignores). Inspect an executable's memory
    with `jax.jit(f).lower(...).compile().memory_analysis()`.

    Example:
      >>> import jbackends as jb
      >>> jb.cuda.{name}() is None
      True
    """


def cublas_workspace_size() -> None:
    return None


def cublaslt_workspace_size() -> None:
    return None


def blas_workspace_size() -> None:
    return None


cublas_workspace_size.__doc__ = _WORKSPACE_DOC.format(lib="cuBLAS", name="cublas_workspace_size")
cublaslt_workspace_size.__doc__ = _WORKSPACE_DOC.format(lib="cuBLASLt", name="cublaslt_workspace_size")
blas_workspace_size.__doc__ = _WORKSPACE_DOC.format(lib="BLAS", name="blas_workspace_size")


# --- SDPA helpers (torch.backends.cuda.SDPAParams, can_use_*, sdp_kernel) ---
from jbackends.attention import SDPAParams as SDPAParams  # noqa: E402
from jbackends.attention import can_use_cudnn_attention as can_use_cudnn_attention  # noqa: E402
from jbackends.attention import can_use_efficient_attention as can_use_efficient_attention  # noqa: E402
from jbackends.attention import can_use_flash_attention as can_use_flash_attention  # noqa: E402
from jbackends.attention import is_flash_attention_available as is_flash_attention_available  # noqa: E402
from jbackends.attention import sdp_kernel as sdp_kernel  # noqa: E402
# --- end SDPA helpers ---

_mirror.install(_sys.modules[__name__])
