"""`jb.nn.attention_fn` and `jb.nn.MultiHeadAttention`: the `torch.backends.mha` fast path, for flax nnx.

torch's `nn.MultiheadAttention` fast path replaces the explicit softmax(QK^T)V with the fused SDPA kernel
when `torch.backends.mha.get_fastpath_enabled()` and the call qualifies. Here:

* fast path: `jbackends.attention.dot_product_attention` (the SDPA dispatch: flash / memory-efficient /
  cuDNN / math, by the flags in force), BTNH layout;
* plain path: the explicit attention weights (`nnx.dot_product_attention_weights`, with dropout,
  `precision`, sowing into `module`) followed by the weighted sum, as flax computes it.

The fast path is taken when the `mha_fastpath` flag is on (read at trace time, part of the jit key) and the
call has no active dropout, no `module` to sow weights into and no explicit `precision` (which only the
plain path honours). Both paths compute the same function; every decision is reported to
`jb.verbose` as `op=mha`.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import attention as _flax_attention
from flax.nnx.nn import dtypes as _dtypes

from jbackends._src import flag_state as _flag_state
from jbackends._src import verbose as _verbose


def _fast_path_blockers(
    flags: Any, dropout_rate: float, deterministic: bool, module: Any, precision: Any
) -> dict[str, str]:
    if not flags.mha_fastpath:
        return {"fastpath": "jb.mha.get_fastpath_enabled() is False"}
    if dropout_rate > 0.0 and not deterministic:
        return {"fastpath": f"dropout is active (dropout_rate={dropout_rate}, deterministic=False)"}
    if module is not None:
        return {"fastpath": "module= given: attention weights are sown, which needs the explicit weights"}
    if precision is not None:
        return {"fastpath": f"precision={precision!r} is honoured by the plain path only"}
    return {}


def _plain(
    query,
    key,
    value,
    bias,
    mask,
    broadcast_dropout,
    dropout_rng,
    dropout_rate,
    deterministic,
    dtype,
    precision,
    module,
    promote_dtype,
    is_causal,
):
    weights = _flax_attention.dot_product_attention_weights(
        query,
        key,
        bias,
        mask,
        broadcast_dropout,
        dropout_rng,
        dropout_rate,
        deterministic,
        dtype,
        precision,
        module,
        promote_dtype,
        is_causal,
    )
    q_heads, v_heads = weights.shape[-3], value.shape[-2]
    if q_heads != v_heads:  # grouped-query attention: each value head serves q_heads // v_heads heads
        if q_heads % v_heads:
            raise ValueError(f"query heads ({q_heads}) must be a multiple of value heads ({v_heads})")
        rep = q_heads // v_heads
        weights = weights.reshape(weights.shape[:-3] + (v_heads, rep) + weights.shape[-2:])
        out = jnp.einsum("...hgqk,...kh1d->...qhgd", weights, value[..., None, :], precision=precision)
        return out.reshape(out.shape[:-3] + (q_heads, out.shape[-1]))
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def _fused(query, key, value, bias, mask, is_causal):
    from jbackends.attention import dot_product_attention  # the SDPA dispatch (imported lazily)

    batch_shape = query.shape[:-3]

    def to4(x):
        if x is None:
            return None
        if x.ndim == 3:
            return x[None]
        return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:]) if x.ndim > 4 else x

    def mask4(x):
        if x is None or x.ndim <= 4:
            return x
        return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])

    if mask is not None:
        mask = mask.astype(jnp.bool_)
    out = dot_product_attention(
        to4(query), to4(key), to4(value), bias=mask4(bias), mask=mask4(mask), is_causal=is_causal
    )
    return out.reshape(batch_shape + out.shape[-3:])


def attention_fn(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Any = _dtypes.promote_dtype,
    is_causal: bool = False,
) -> Any:
    """Drop-in `attention_fn` for flax: the fused SDPA fast path when `jb.mha` allows it, else plain.

    Same signature and shapes as `flax.nnx.dot_product_attention` (`[batch..., length, heads, depth]`),
    so it plugs into `nnx.MultiHeadAttention(attention_fn=jb.nn.attention_fn)`.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> q = jnp.ones((2, 5, 4, 8))
      >>> with jb.with_backends(mha_fastpath=False):
      ...     jb.nn.attention_fn(q, q, q).shape
      (2, 5, 4, 8)
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"query, key, value must have the same rank >= 3 ([batch..., length, heads, depth]), "
            f"got shapes {query.shape}, {key.shape}, {value.shape}"
        )
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value lengths must match, got {key.shape[-3]} and {value.shape[-3]}")
    flags = _flag_state.trace_flags()
    reasons = _fast_path_blockers(flags, dropout_rate, deterministic, module, precision)
    if not reasons:
        try:
            import jbackends.attention as _attention  # noqa: F401
        except ImportError as e:  # the SDPA module is optional while the package is being assembled
            reasons = {"fastpath": f"jbackends.attention is not importable ({e})"}
    shapes = (query.shape, key.shape, value.shape)
    dtypes = (query.dtype, key.dtype, value.dtype)
    if reasons:
        _verbose.report_dispatch("mha", "plain", reasons, shapes, dtypes)
        return _verbose.call(
            "mha",
            _plain,
            query,
            key,
            value,
            bias,
            mask,
            broadcast_dropout,
            dropout_rng,
            dropout_rate,
            deterministic,
            dtype,
            precision,
            module,
            promote_dtype,
            is_causal,
        )
    _verbose.report_dispatch(
        "mha", "fastpath:sdpa", {"plain": "fast path allowed and applicable"}, shapes, dtypes
    )
    return _verbose.call("mha", _fused, query, key, value, bias, mask, is_causal)


class MultiHeadAttention(nnx.MultiHeadAttention):
    """`nnx.MultiHeadAttention` whose default `attention_fn` is `jb.nn.attention_fn` (torch's mha fast path).

    Same constructor as `flax.nnx.MultiHeadAttention`; an explicit `attention_fn=` still wins.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> from flax import nnx
      >>> mha = jb.nn.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
      >>> mha(jnp.ones((1, 3, 8))).shape
      (1, 3, 8)
    """

    def __init__(self, *args: Any, attention_fn: Any = attention_fn, **kwargs: Any):
        super().__init__(*args, attention_fn=attention_fn, **kwargs)
