"""`torch.backends.mha`, for JAX: `get_fastpath_enabled()` / `set_fastpath_enabled(bool)`.

Generated from the flag `mha_fastpath` (traced: a change retraces). It drives `jb.nn.MultiHeadAttention`
and `jb.nn.attention_fn`: when on, and the call has no active dropout, no `module` to sow attention
weights into and no explicit `precision`, attention runs through the fused SDPA dispatch
`jbackends.attention.dot_product_attention`; otherwise through the plain path (explicit weights, then the
weighted sum). Scoped form: `jb.with_backends(mha_fastpath=False)`.

Example:
  >>> import jbackends as jb
  >>> jb.mha.get_fastpath_enabled()
  True
"""

import sys as _sys

from jbackends._src import mirror as _mirror

_mirror.install(_sys.modules[__name__])
