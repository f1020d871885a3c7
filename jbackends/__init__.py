"""jbackends: a JAX/XLA-native `torch.backends`.

Choose and trust the kernels that run: attention backends, matmul precision, int4 weights, and why a
kernel was or wasn't picked. Flags are declared once (`jbackends/_src/flag_declarations.py`), held in a
`contextvars`-based config that JAX traces through: the flags in force when a function is traced decide
the kernel, and a change of flags makes `jax.jit` retrace.

Example:
  >>> import jax, jbackends as jb
  >>> @jb.with_backends(flash=True, math=False)
  ... @jax.jit
  ... def f(x):
  ...     return x + 1
"""

import sys as _sys

from jbackends._src import flags as _flags_module
from jbackends._src.flag_declarations import FLAGS as _FLAGS
from jbackends._src.flag_declarations import BackendFlags as BackendFlags
from jbackends._src.flag_declarations import Flag as Flag
from jbackends._src.flag_scope import FlagsFrozenError as FlagsFrozenError
from jbackends._src.flag_state import FlagsOutOfSyncError as FlagsOutOfSyncError
from jbackends._src.flag_scope import FlagsTracingError as FlagsTracingError
from jbackends._src.jit import compiler_options as compiler_options
from jbackends._src.flag_state import current_flags as current_flags
from jbackends._src.flag_scope import disable_global_flags as disable_global_flags
from jbackends._src.flag_scope import enable_global_flags as enable_global_flags
from jbackends._src.flag_scope import flags_frozen as flags_frozen
from jbackends._src.jit import jit as jit
from jbackends._src.flag_scope import propagate as propagate
from jbackends._src.flag_scope import reset_flags as reset_flags
from jbackends._src.flag_scope import set_flags as set_flags
from jbackends._src.flag_state import sync as sync
from jbackends._src.flag_scope import with_backends as with_backends
from jbackends._src import mirror as _mirror

from jbackends import cuda as cuda
from jbackends import cudnn as cudnn
from jbackends import mha as mha
from jbackends import mkl as mkl
from jbackends import mkldnn as mkldnn
from jbackends import opt_einsum as opt_einsum

# --- backend modules (cpu, mps, einsum, fft, verbose, conv, nn, xeon, ...) ---
from jbackends import conv as conv
from jbackends import cpu as cpu
from jbackends import cusparselt as cusparselt
from jbackends import fft as fft
from jbackends import kleidiai as kleidiai
from jbackends import linalg as linalg
from jbackends import miopen as miopen
from jbackends import mps as mps
from jbackends import nnpack as nnpack
from jbackends import openmp as openmp
from jbackends import xeon as xeon
from jbackends import xnnpack as xnnpack
from jbackends._src.einsum import einsum as einsum
from jbackends._src.einsum import einsum_path as einsum_path
from jbackends._src.verbose import timed as timed
from jbackends._src.verbose import verbose as verbose

# --- attention / quantized ---
from jbackends import attention as attention
from jbackends.attention import SDPBackend as SDPBackend
from jbackends.attention import dot_product_attention as dot_product_attention
from jbackends.attention import explain as explain
from jbackends.attention import scaled_dot_product_attention as scaled_dot_product_attention
from jbackends.attention import sdpa_kernel as sdpa_kernel
# --- end attention / quantized exports ---

import types as _types

flags = _types.SimpleNamespace(**_FLAGS)
flags.__doc__ = "The flag declarations by short name: `jb.flags.deterministic.value`, `.set(v)`, `(v)` scope."

__version__ = "0.1.0"

# Optional heavy dependencies load on first use, not at `import jbackends` (flax alone costs more than
# jax's own import): `jb.nn` (flax nnx layers) and `jb.quantized` (the int4 kernels, whose GPU path
# loads Pallas and Triton) are imported when first accessed.
_LAZY_SUBMODULES = ("nn", "quantized")
# Pallas' core is cheap and declares trace-context configs: imported for the first time mid-program (by
# a kernel), it would grow JAX's trace context and make every jitted function retrace once. Its GPU
# back ends (Triton, Mosaic) stay lazy.
import jax.experimental.pallas as _pallas  # noqa: E402,F401

# The C++ CPU kernels' FFI targets are registered at import (ctypes loads, nothing compiled): a
# deserialized `jax.export` carrying them runs in a fresh process once it has imported jbackends.
from pallas_kernels.attention import cpp_flash as _cpp_flash  # noqa: E402,F401
from pallas_kernels.int4_matmul import cpp as _int4_cpp  # noqa: E402,F401


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


_mirror.install(_sys.modules[__name__])  # set_/get_float32_matmul_precision, as torch spells them
