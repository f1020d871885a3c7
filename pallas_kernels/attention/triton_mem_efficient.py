"""Memory-efficient attention on GPU: the Pallas Triton flash kernels plus bias / boolean-mask tiles.

The forward is :func:`triton_flash.forward` with the additive ``bias`` and the boolean ``mask`` read tile by
tile inside the key loop (a ``[block_q, block_k]`` tile per step; dimensions the bias broadcasts
over are read once as a ``[1, block_k]`` / ``[block_q, 1]`` tile and broadcast on chip, never
materialised at ``[B, N, T, S]``). The backward is :func:`triton_flash_vjp.backward`, which also returns
the bias gradient ``dS`` (tiles for a full bias, on-chip row / column partial sums for a bias
broadcast over keys / queries, summed over broadcast batch / head dims afterwards). The bias
gradient is only computed when the bias is differentiated.

Everything :mod:`triton_flash` supports is supported here too (causal with any ``diag_offset``, window,
softcap, lengths, segment ids, GQA / MQA by index map, dropout with the shared keep-mask, any
``T`` / ``S``, head dims up to 256).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, triton_mem_efficient
  >>> q = jax.random.normal(jax.random.key(0), (1, 9, 2, 16))
  >>> bias = jax.random.normal(jax.random.key(1), (1, 1, 9, 9))
  >>> args = base.make_args(q, q, q, bias=bias, is_causal=True)
  >>> out, lse = triton_mem_efficient.attention(args, interpret=True)
  >>> bool(jnp.allclose(out, base.reference(args)[0], atol=1e-4))
  True
"""

from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp

from pallas_kernels.attention import base, triton_common as common, triton_flash, triton_flash_vjp
from pallas_kernels.attention.triton_tuning import Config, heuristics

__all__ = ["Config", "heuristics", "unsupported", "attention"]

_BIAS_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def unsupported(args: base.AttentionArgs, platform: str) -> list:
    """Why the memory-efficient Pallas kernel cannot run ``args`` on ``platform`` (empty if it can).

    Forward and backward share these constraints (the bias gradient included).

    Example:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels.attention import base, triton_mem_efficient
      >>> x = jnp.ones((1, 8, 2, 16), jnp.float16)
      >>> triton_mem_efficient.unsupported(base.make_args(x, x, x, mask=jnp.ones((1, 1, 8, 8), bool)), "cuda")
      []
      >>> triton_mem_efficient.unsupported(base.make_args(x, x, x), "cpu")[0][:40]
      'Pallas Triton kernels need a CUDA GPU; p'
    """
    reasons = common.common_unsupported(args, platform)
    if args.bias is not None and jnp.dtype(args.bias.dtype) not in _BIAS_DTYPES:
        reasons.append(f"bias dtype {args.bias.dtype} is not supported (float16, bfloat16, float32)")
    return reasons


def attention(
    args: base.AttentionArgs,
    *,
    config: Optional[Config] = None,
    interpret: bool = False,
    allow_tf32: bool = False,
    bwd_config: Optional[triton_flash_vjp.Config] = None,
    **opts,
):
    """Attention with bias / mask tiles (Pallas Triton); differentiable w.r.t. q, k, v and bias.

    Args:
      args: canonical arguments (:func:`base.make_args`).
      config: forward :class:`triton_tuning.Config` (default :meth:`Config.heuristics`).
      interpret: run the kernels in the Pallas interpreter (CPU testing).
      allow_tf32: float32 inputs use TF32 tensor-core dots.
      bwd_config: backward :class:`triton_flash_vjp.Config`.
      **opts: ignored dispatch options.

    Returns:
      ``(out [B, T, N, Hv], lse [B, N, T] float32)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pallas_kernels.attention import base, triton_mem_efficient
      >>> x = jax.random.normal(jax.random.key(0), (1, 5, 1, 16))
      >>> b = jnp.zeros((1, 1, 5, 5))
      >>> f = lambda b: triton_mem_efficient.attention(base.make_args(x, x, x, bias=b), interpret=True)[0].sum()
      >>> jax.grad(f)(b).shape
      (1, 1, 5, 5)
    """
    del opts
    common.check_config(config, Config)
    reasons = unsupported(args, "cuda")
    if reasons:
        raise ValueError("mem_efficient (Pallas) cannot run this call: " + "; ".join(reasons))
    fwd = functools.partial(
        triton_flash.forward,
        config=config,
        interpret=interpret,
        allow_tf32=allow_tf32,
        name="jb_mem_efficient_fwd",
    )
    return triton_flash_vjp.differentiable(
        args, fwd=fwd, bwd_config=bwd_config, interpret=interpret, allow_tf32=allow_tf32
    )
