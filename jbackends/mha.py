"""`torch.backends.mha`, for JAX: `get_fastpath_enabled()` / `set_fastpath_enabled(bool)`.
"""

import sys as _sys

from jbackends._src import mirror as _mirror

_mirror.install(_sys.modules[__name__])
