"""`torch.backends.cuda`, for JAX: SDPA backend switches and `cuda.matmul` precision attributes.

Functions and attributes are generated from the flag registry (`jbackends/_src/flags.py`):
`enable_flash_sdp(bool)` / `flash_sdp_enabled()`, the same for `mem_efficient`, `math`, `cudnn`,
`allow_fp16_bf16_reduction_math_sdp(bool)`, and `matmul.allow_tf32`,
`matmul.allow_fp16_reduced_precision_reduction`, `matmul.allow_bf16_reduced_precision_reduction`.
Setters change process defaults; getters return the value in force (scopes included).

Example:
  >>> import jbackends as jb
  >>> jb.cuda.matmul.allow_tf32
  False
"""

import sys as _sys

from jbackends._src import mirror as _mirror

_mirror.install(_sys.modules[__name__])
