"""`jb.nn`: flax nnx building blocks that follow the backend flags.

* `MultiHeadAttention` / `attention_fn`: the `torch.backends.mha` fast path (fused SDPA through
  `jbackends.attention` when `jb.mha.get_fastpath_enabled()`, else the plain weights-then-sum path).
* `Int4Linear` / `quantize_4bit`: int4 weight layers (from `jbackends._src.nn_int4`).

Example:
  >>> import jax.numpy as jnp, jbackends as jb
  >>> jb.nn.attention_fn(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4))).shape
  (1, 3, 2, 4)
"""

from jbackends._src.nn_attention import MultiHeadAttention as MultiHeadAttention
from jbackends._src.nn_attention import attention_fn as attention_fn
from jbackends._src.nn_int4 import Int4Linear as Int4Linear
from jbackends._src.nn_int4 import quantize_4bit as quantize_4bit
