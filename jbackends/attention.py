"""Scaled dot product attention with a trace-safe backend choice (``torch.nn.attention`` for JAX).

* :class:`SDPBackend` (torch's members and values) and :func:`sdpa_kernel` (a ``with_backends``
  scope: context manager and decorator, honoured under ``jax.jit``).
* :func:`scaled_dot_product_attention`: torch semantics and layout ``(..., H, L, E)``.
* :func:`dot_product_attention`: a drop-in for ``jax.nn.dot_product_attention`` (layout BTNH) plus
  soft cap, dropout, segment ids and a natural-log LSE residual.
* :func:`explain`: which backend would run a call and why each other one would not (a value).
* :func:`causal_lower_right` / :func:`causal_upper_left` bias objects like ``torch.nn.attention.bias``.
* :class:`SDPAParams`, ``can_use_*`` and :func:`is_flash_attention_available` like ``torch.backends.cuda``.

Backends and platforms. FLASH_ATTENTION is a Pallas (Triton) kernel on CUDA GPUs and a blockwise
FlashAttention-2 in XLA elsewhere (O(L) memory on CPU); EFFICIENT_ATTENTION is the same tiling with an
additive-bias / boolean-mask tile read per block (and the bias gradient); CUDNN_ATTENTION bridges to
``jax.nn.dot_product_attention(implementation="cudnn")`` (CUDA only); MATH is the float32 reference and
runs everything. The default priority is FLASH, EFFICIENT, CUDNN, MATH on every platform: flash first
for its O(L) memory and speed (on CPU it beats the materialised path from ~1k tokens and the block sizes
shrink to the sequence for short ones), efficient next because it is the only fast path that takes a
bias or arbitrary mask, cuDNN next (GPU only), math last as the universal fallback.

The flags in force when a call is *traced* decide its backend (``jax.jit`` retraces when they change);
a ``vjp_fn`` keeps the backend of its forward. A call that no enabled backend can serve raises one
:class:`NoAvailableBackendError` naming every enabled backend and its reason: never a silent fallback
to a disabled backend.

Fully masked query rows (every key masked): :func:`scaled_dot_product_attention` gives output 0 and
zero gradients on every backend, as torch does since 2.5 (its math path's ``_safe_softmax`` and its
fused kernels; torch < 2.5's math path gave NaN). :func:`dot_product_attention` gives jax.nn's answer
by default (the mean of V over the keys, with its gradients, and jax.nn's LSE residual), or 0 with
``fully_masked_rows="zero"``.

Dropout is stateless: with ``dropout_rng`` the keep decision is a hash of (key, batch, head, query
index, key index), so every backend drops the same entries for the same key. ``dropout_p > 0`` without
``dropout_rng`` is an error.

Example:
  >>> import jax, jax.numpy as jnp, jbackends as jb
  >>> from jbackends.attention import SDPBackend, sdpa_kernel, scaled_dot_product_attention
  >>> q = k = v = jnp.ones((2, 4, 16, 32))             # (batch, heads, L, E), torch layout
  >>> with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
  ...     out = jax.jit(lambda q, k, v: scaled_dot_product_attention(q, k, v, is_causal=True))(q, k, v)
  >>> out.shape
  (2, 4, 16, 32)
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jbackends._src import attention_dispatch as _dispatch
from jbackends._src import fully_masked as _fully_masked
from jbackends._src import sdp_backends as _sdp
from jbackends._src.sdp_backends import SDPBackend
from jbackends._src.attention_dispatch import NoAvailableBackendError
from jbackends._src.flag_scope import with_backends
from jbackends._src.flag_state import current_flags, trace_flags
from jbackends._src.attention_args import (
    implementation_code,
    jaxnn_to_args,
    lowering_platforms,
    shapes_of,
    torch_to_args,
)
from jbackends._src.attention_explain import (
    Explanation,
    SDPAParams,
    can_use_cudnn_attention,
    can_use_efficient_attention,
    can_use_flash_attention,
    explain_call,
    is_flash_attention_available,
)
from jbackends._src.causal_bias import CausalBias, CausalVariant, causal_lower_right, causal_upper_left

__all__ = [
    "SDPBackend",
    "sdpa_kernel",
    "sdp_kernel",
    "scaled_dot_product_attention",
    "dot_product_attention",
    "explain",
    "Explanation",
    "CausalBias",
    "CausalVariant",
    "causal_lower_right",
    "causal_upper_left",
    "SDPAParams",
    "can_use_flash_attention",
    "can_use_efficient_attention",
    "can_use_cudnn_attention",
    "is_flash_attention_available",
    "NoAvailableBackendError",
]

_logger = logging.getLogger("jbackends")


_RUNNABLE = _sdp.RUNNABLE


# ----------------------------------------------------------------------------------------------
# Scopes.
# ----------------------------------------------------------------------------------------------


def _as_backend(b: Any) -> SDPBackend:
    # Any SDPBackend member (OVERRIDEABLE / ERROR included: sdpa_kernel ignores or refuses those itself).
    if isinstance(b, SDPBackend):
        return b
    if isinstance(b, str) and b.upper() in SDPBackend.__members__:
        return SDPBackend[b.upper()]
    if (
        isinstance(b, (int, np.integer))
        and not isinstance(b, bool)
        and int(b) in SDPBackend._value2member_map_
    ):
        return SDPBackend(int(b))
    code = _sdp.lookup(b)
    if code is None:
        raise ValueError(f"`backends` must hold SDPBackend members {[m.name for m in _RUNNABLE]}; got {b!r}")
    return code


def sdpa_kernel(backends: Union[SDPBackend, Sequence[SDPBackend]], set_priority: bool = False):
    """Restricts SDPA to ``backends`` for a scope (``torch.nn.attention.sdpa_kernel``).

    A ``jb.with_backends`` scope, so it is a context manager *and* a decorator, is per thread / asyncio
    task, nests, and is honoured by ``jax.jit`` (a function traced inside it uses these backends; a
    change retraces). ``set_priority=True`` also makes the listed order the priority order (and turns
    off ``sdpa_prefer_faster``: no measured order overrides the user's).
    ``SDPBackend.OVERRIDEABLE`` is accepted and ignored (there is no overrideable backend in JAX).

    Args:
      backends: one ``SDPBackend`` or a list of them.
      set_priority: use the list order as the priority order (the others follow, still disabled, in
        their order of the priority in force when ``sdpa_kernel`` is called, as torch appends its
        previous order; torch reads it on entering, which differs for a scope object made ahead).

    Raises:
      ValueError: an unknown backend, ``SDPBackend.ERROR``, or an empty list.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jbackends.attention import SDPBackend, sdpa_kernel, explain
      >>> x = jnp.ones((1, 8, 2, 16))
      >>> with sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True):
      ...     explain(x, x, x).chosen
      <SDPBackend.MATH: 0>
    """
    if isinstance(backends, (list, tuple)):
        items = [_as_backend(b) for b in backends]
    else:
        items = [_as_backend(backends)]
    if not items:
        raise ValueError("`backends` must name at least one SDPBackend")
    if SDPBackend.ERROR in items:
        raise ValueError("SDPBackend.ERROR is not a backend that can be enabled")
    chosen = [b for b in items if b in _RUNNABLE]
    kw: dict[str, Any] = dict(
        flash=SDPBackend.FLASH_ATTENTION in chosen,
        mem_efficient=SDPBackend.EFFICIENT_ATTENTION in chosen,
        math=SDPBackend.MATH in chosen,
        cudnn=SDPBackend.CUDNN_ATTENTION in chosen,
    )
    if set_priority and chosen:
        listed = tuple(dict.fromkeys(int(b) for b in chosen))  # a repeat: its first place
        # the others keep their order of the priority in force (torch appends its previous order)
        kw["sdpa_priority"] = listed + tuple(c for c in current_flags().sdpa_priority if c not in listed)
        kw["sdpa_prefer_faster"] = False  # the user's order, not a measured one
    return with_backends(**kw)


def sdp_kernel(
    enable_flash: bool = True,
    enable_math: bool = True,
    enable_mem_efficient: bool = True,
    enable_cudnn: bool = True,
):
    """Deprecated (like ``torch.backends.cuda.sdp_kernel``): use :func:`sdpa_kernel`.

    Example:
      >>> import warnings
      >>> from jbackends.attention import sdp_kernel
      >>> with warnings.catch_warnings(record=True):
      ...     with sdp_kernel(enable_math=False):
      ...         pass
    """
    warnings.warn(
        "jb.cuda.sdp_kernel() is deprecated; use jb.attention.sdpa_kernel(backends) "
        "(torch.nn.attention.sdpa_kernel) instead.",
        FutureWarning,
        stacklevel=2,
    )
    return with_backends(
        flash=bool(enable_flash),
        math=bool(enable_math),
        mem_efficient=bool(enable_mem_efficient),
        cudnn=bool(enable_cudnn),
    )


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    dropout_rng=None,
    platforms=None,
):
    """``torch.nn.functional.scaled_dot_product_attention`` for JAX (layout ``(..., H, L, E)``).

    Args:
      query: ``(..., Hq, L, E)`` (or ``(L, E)``).
      key: ``(..., H, S, E)``.
      value: ``(..., H, S, Ev)``. The leading dims of the three broadcast as in torch's math path
        (a key / value batch of 1, a value of lower rank, one kv head without ``enable_gqa``).
      attn_mask: None; a bool array (True = attend) or a float array (added to the logits),
        broadcastable to ``(..., Hq, L, S)``; or a :class:`CausalBias`.
      dropout_p: dropout probability on the attention weights, in ``[0, 1]`` (1: zeros, as torch):
        a number or a concrete 0-d array, not a traced value (static under ``jit``, as in torch).
      is_causal: top-left causal mask (torch's convention; see :func:`causal_lower_right`); a bool
        (anything else is a ``TypeError``, as in torch). With an ``attn_mask`` too, a key counts
        where both allow it (torch's default CPU path does the same; its math path refuses the pair).
      scale: logits scale, default ``1 / sqrt(E)``; any finite float (0 and negative ones too), or a
        traced float scalar (folded into ``query``: differentiable).
      enable_gqa: allow ``Hq`` to be a multiple of ``H`` (grouped-query attention); key's and
        value's heads must then each divide ``Hq`` (a ``ValueError`` otherwise, as in torch).
      dropout_rng: a jax PRNG key (``jax.random.key`` or a legacy ``jax.random.PRNGKey``);
        required when ``dropout_p > 0``.
      platforms: lowering platforms to choose for (default: the inputs' / the default backend's;
        under ``jax.export`` the other of cpu / cuda too).

    Returns:
      ``(..., Hq, L, Ev)`` in the query's dtype. A query row whose every key is masked gives 0 (and
      zero gradients) on every backend, torch's answer since 2.5 (torch < 2.5's math path gave NaN).
      Empty dimensions give torch's result (``S = 0``: zeros; head dim 0: uniform weights).

    Raises:
      NoAvailableBackendError: no enabled backend can run the call (every reason listed).
      ValueError / TypeError: bad arguments (the message names the argument).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jbackends.attention import scaled_dot_product_attention
      >>> q = jax.random.normal(jax.random.key(0), (2, 8, 64, 32))
      >>> kv = q[:, :2]
      >>> scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True).shape
      (2, 8, 64, 32)
    """
    flags = trace_flags()
    args, lead = torch_to_args(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_rng
    )
    out, _, _ = _dispatch.run(
        args, flags, *lowering_platforms(platforms, (query,)), shapes=shapes_of(query, key, value)
    )
    out = jnp.swapaxes(out, 1, 2)
    out = out.reshape(lead + tuple(out.shape[-2:]))
    if float(dropout_p) == 1.0:  # every weight dropped: torch's zeros (NaN stays NaN, as there)
        out = out * jnp.zeros((), out.dtype)
    return out


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    logits_soft_cap: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    segment_ids=None,
    return_residual: bool = False,
    platforms=None,
    fully_masked_rows: str = "jax",
    residual_gradient: bool = False,
    residual_dtype=None,
):
    """Drop-in for ``jax.nn.dot_product_attention`` (layout BTNH) with a backend choice.

    Args:
      query: ``[B, T, N, H]`` (or ``[T, N, H]``).
      key: ``[B, S, K, H]`` with ``N % K == 0`` (GQA / MQA).
      value: ``[B, S, K, Hv]``.
      bias: additive float bias broadcastable to ``[B, N, T, S]``.
      mask: bool mask broadcastable to ``[B, N, T, S]`` (True = attend), or a :class:`CausalBias`.
      scale: logits scale, default ``1 / sqrt(H)``; a traced float scalar (a learned temperature)
        is folded into ``query`` (differentiable), as jax.nn takes it.
      is_causal: top-left causal mask.
      query_seq_lengths: int ``[B]``: query rows at index ``>= length`` are masked (output 0).
      key_value_seq_lengths: int ``[B]``: keys at index ``>= length`` are masked.
      local_window_size: ``(left, right)`` or an int (symmetric): key ``j`` allowed iff
        ``i - left <= j <= i + right``.
      implementation: ``None`` (the flags decide), jax.nn's ``"xla"`` (= math) / ``"cudnn"``, ours
        (``"math"``, ``"flash"``, ``"mem_efficient"``) or an ``SDPBackend``: that backend only.
      logits_soft_cap: ``cap * tanh(logits / cap)`` after scaling, before bias and masks.
      dropout_rate: dropout on the attention weights, in ``[0, 1)``; needs ``dropout_rng``.
      dropout_rng: a jax PRNG key (``jax.random.key`` or a legacy ``jax.random.PRNGKey``).
      segment_ids: packed sequences: one int ``[B, T]`` array (self-attention) or a pair
        ``(q_segment_ids [B, T], kv_segment_ids [B, S])``; attend iff equal.
      return_residual: also return the natural-log LSE of the logits, ``[B, T, N]`` in the query's
        dtype and without a gradient (``stop_gradient``), exactly as jax.nn returns it.
      platforms: lowering platforms to choose for (default: the inputs' / the default backend's;
        under ``jax.export`` the other of cpu / cuda too).
      fully_masked_rows: what a query row whose every key is masked gets. ``"jax"`` (default, the
        jax.nn answer): jax.nn masks with a large negative number instead of ``-inf``, so such a row
        attends uniformly to all ``S`` keys: the output is the mean of ``V`` over the keys (the
        gradient w.r.t. ``V`` is ``1 / S`` per key, zero w.r.t. q, k and bias) and the LSE residual
        is ``-0.7 * finfo(float32).max`` in the query's dtype (``-inf`` in float16). ``"zero"``: the
        output is 0 with zero gradients and the LSE is ``-inf`` (torch's answer, and what
        :func:`scaled_dot_product_attention` always gives). We think ``"zero"`` is the better
        answer for padding (a padded query reads nothing instead of an average of real tokens), but
        the default stays jax.nn's so this function is a drop-in. Rows beyond
        ``query_seq_lengths`` are 0 either way (jax.nn zeroes them too); with ``S == 0`` every row
        is 0 with LSE ``-inf`` (jax.nn's empty sum).
      residual_gradient: differentiate the LSE residual (its true gradient) instead of jax.nn's
        ``stop_gradient``. Only meaningful with ``return_residual=True``.
      residual_dtype: dtype of the LSE residual (default: the query's, like jax.nn); e.g.
        ``jnp.float32`` for the full-precision LSE of bfloat16 inputs (the kernels compute it in
        float32).

    Returns:
      ``[B, T, N, Hv]`` in the query's dtype (and the LSE when ``return_residual``).

    Semantics against jax.nn: the output, the residual (dtype, value, ``stop_gradient``) and the
    gradients are jax.nn's, fully masked rows included, on every backend and platform (the kernels
    return output 0 / LSE ``-inf`` for such rows and this function substitutes jax.nn's answer, with
    its gradients). Two corners of jax.nn that follow from its large negative number are kept too: a
    row with no mask at all whose every logit is ``-inf`` through ``bias`` gives NaN (jax.nn's
    softmax of all ``-inf``); a row whose unmasked keys all get a ``-inf`` bias is treated as
    fully masked (jax.nn averages V over the *masked* keys there: this function averages over all).
    ``logits_soft_cap``, ``dropout_rate`` and ``segment_ids`` are extensions (jax.nn has none);
    segment ids mask like a boolean mask, and a fully masked row's mean of V is not dropped out.

    Differentiation: reverse mode (``grad`` / ``vjp``) on every backend, and second order (grad of
    grad, Hessian-vector products by reverse over reverse) on every backend. The flash and
    memory-efficient backends (C++, blockwise XLA, Pallas) and the cuDNN bridge are ``custom_vjp``
    functions whose backward is a kernel (recomputing per block; cuDNN's own); that backward is itself
    differentiable, with the math formulation as its derivative, so
    the second-order pass materialises the ``[B, N, T, S]`` weights like MATH does. Forward mode
    (``jax.jvp``, ``jacfwd``, ``hessian``) runs MATH: the dispatcher sees it tracing the call (a forced
    fast backend raises ``NoAvailableBackendError``), except in a function staged inside the
    ``jax.jvp`` (``jax.jit``, ``lax.scan``, ``jax.checkpoint``: its jaxpr is reused outside it), where
    JAX's custom_vjp error stands; use
    ``implementation="math"`` (or jit the whole ``jax.jvp``) there. cuDNN's LSE
    residual carries no gradient (``residual_gradient=True`` gives zeros there).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jbackends.attention import dot_product_attention
      >>> x = jax.random.normal(jax.random.key(0), (2, 128, 4, 32))
      >>> out, lse = dot_product_attention(x, x, x, is_causal=True, local_window_size=(16, 0),
      ...                                  return_residual=True)
      >>> out.shape, lse.shape
      ((2, 128, 4, 32), (2, 128, 4))
    """
    flags = trace_flags()
    only = implementation_code(implementation)
    _fully_masked.check_fully_masked_rows(fully_masked_rows)
    args, unbatched = jaxnn_to_args(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        segment_ids=segment_ids,
    )
    out, lse, _ = _dispatch.run(
        args, flags, *lowering_platforms(platforms, (query,)), only=only, shapes=shapes_of(query, key, value)
    )
    out, lse = _fully_masked.fix_fully_masked_rows(args, out, lse, fully_masked_rows)
    if unbatched:
        out, lse = out[0], lse[0]
    if not return_residual:
        return out
    lse = jnp.swapaxes(lse, -1, -2)
    if not residual_gradient:
        lse = jax.lax.stop_gradient(lse)
    return out, lse.astype(query.dtype if residual_dtype is None else residual_dtype)


# ----------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------


def explain(
    query,
    key,
    value,
    *,
    api: str = "dot_product_attention",
    platform: Optional[str] = None,
    compute_capability: Optional[float] = None,
    cudnn_version: Optional[int] = None,
    **kwargs,
) -> Explanation:
    """Says which backend would run a call here (or on ``platform``) and why each other would not.

    Nothing is computed: inputs may be arrays or ``jax.ShapeDtypeStruct`` (so GPU calls can be
    explained on a CPU-only machine with ``platform="cuda", compute_capability=9.0``). Uses the flags
    in force now.

    Args:
      query, key, value: as for the API named by ``api``.
      api: ``"dot_product_attention"`` (BTNH, jax.nn keywords) or ``"sdpa"`` (torch layout/keywords).
      platform: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``; default: the default backend's.
      compute_capability: GPU compute capability to assume (cuDNN head-dim limits).
      cudnn_version: cuDNN version to assume (e.g. ``91000``).
      **kwargs: the keyword arguments of that API (``is_causal=True``, ``bias=...``, ...).

    Returns:
      An :class:`Explanation` (``str()`` of it is a readable report).

    Raises:
      ValueError: an unknown ``platform`` or ``api`` (the message lists the valid ones).
      TypeError: a keyword the API named by ``api`` does not take (the message lists its keywords).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jbackends.attention import explain, SDPBackend
      >>> q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
      >>> e = explain(q, q, q, bias=jax.ShapeDtypeStruct((1, 8, 4096, 4096), jnp.float32), platform="tpu")
      >>> e.chosen, e.reasons[SDPBackend.FLASH_ATTENTION][:31]
      (<SDPBackend.EFFICIENT_ATTENTION: 2>, 'FLASH takes no additive bias / ')
    """
    return explain_call(
        {"dot_product_attention": dot_product_attention, "sdpa": scaled_dot_product_attention},
        query,
        key,
        value,
        api=api,
        platform=platform,
        compute_capability=compute_capability,
        cudnn_version=cudnn_version,
        kwargs=kwargs,
    )
