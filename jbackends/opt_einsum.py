"""`torch.backends.opt_einsum`, for JAX: `enabled` and `strategy` (used by `jb.einsum`).
"""

import sys as _sys

from jbackends._src import mirror as _mirror

_mirror.install(_sys.modules[__name__])
