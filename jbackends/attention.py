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

import dataclasses
import enum
import inspect
import logging
import math
import os
import sys
import warnings
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jbackends._src import attention_dispatch as _dispatch
from jbackends._src import sdp_backends as _sdp
from jbackends._src import sdpa_registry as _sdpa_registry
from jbackends._src.sdp_backends import SDPBackend
from jbackends._src.attention_dispatch import NoAvailableBackendError
from jbackends._src.flag_scope import with_backends
from jbackends._src.flag_state import current_flags, trace_flags
from pallas_kernels.attention import base as _base

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
  code = _sdp.lookup(b)
  if code is None:
    raise ValueError(f"`backends` must hold SDPBackend members {[m.name for m in _RUNNABLE]}; "
                     f"got {b!r}")
  return code


def sdpa_kernel(backends: Union[SDPBackend, Sequence[SDPBackend]], set_priority: bool = False):
  """Restricts SDPA to ``backends`` for a scope (``torch.nn.attention.sdpa_kernel``).

  A ``jb.with_backends`` scope, so it is a context manager *and* a decorator, is per thread / asyncio
  task, nests, and is honoured by ``jax.jit`` (a function traced inside it uses these backends; a
  change retraces). ``set_priority=True`` also makes the listed order the priority order.
  ``SDPBackend.OVERRIDEABLE`` is accepted and ignored (there is no overrideable backend in JAX).

  Args:
    backends: one ``SDPBackend`` or a list of them.
    set_priority: use the list order as the priority order (the others follow, still disabled).

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
      cudnn=SDPBackend.CUDNN_ATTENTION in chosen)
  if set_priority and chosen:
    kw["sdpa_priority"] = tuple(int(b) for b in chosen)
  return with_backends(**kw)


def sdp_kernel(enable_flash: bool = True, enable_math: bool = True, enable_mem_efficient: bool = True,
               enable_cudnn: bool = True):
  """Deprecated (like ``torch.backends.cuda.sdp_kernel``): use :func:`sdpa_kernel`.

  Example:
    >>> import warnings
    >>> from jbackends.attention import sdp_kernel
    >>> with warnings.catch_warnings(record=True):
    ...     with sdp_kernel(enable_math=False):
    ...         pass
  """
  warnings.warn("jb.cuda.sdp_kernel() is deprecated; use jb.attention.sdpa_kernel(backends) "
                "(torch.nn.attention.sdpa_kernel) instead.", FutureWarning, stacklevel=2)
  return with_backends(flash=bool(enable_flash), math=bool(enable_math),
                       mem_efficient=bool(enable_mem_efficient), cudnn=bool(enable_cudnn))


# ----------------------------------------------------------------------------------------------
# Causal bias objects (torch.nn.attention.bias).
# ----------------------------------------------------------------------------------------------

class CausalVariant(enum.IntEnum):
  """Which diagonal a causal mask is aligned to (``torch.nn.attention.bias.CausalVariant``)."""
  UPPER_LEFT = 1
  LOWER_RIGHT = 2


@dataclasses.dataclass(frozen=True)
class CausalBias:
  """A causal mask of shape ``(seq_len_q, seq_len_kv)`` that is never materialised by the kernels.

  Pass it as ``attn_mask`` to :func:`scaled_dot_product_attention` (or ``mask`` to
  :func:`dot_product_attention`). ``UPPER_LEFT`` is torch's ``is_causal=True``; ``LOWER_RIGHT``
  aligns the last query with the last key (decoding with a KV cache).
  """
  variant: CausalVariant
  seq_len_q: int
  seq_len_kv: int

  def __post_init__(self):
    for name in ("seq_len_q", "seq_len_kv"):
      val = getattr(self, name)
      if not isinstance(val, (int, np.integer)) or val < 0:
        raise ValueError(f"CausalBias.{name} must be an int >= 0; got {val!r}")

  @property
  def diag_offset(self) -> int:
    return self.seq_len_kv - self.seq_len_q if self.variant == CausalVariant.LOWER_RIGHT else 0

  def materialize(self, device=None):
    """The boolean ``(seq_len_q, seq_len_kv)`` mask (True = attend)."""
    i = jnp.arange(self.seq_len_q)[:, None]
    j = jnp.arange(self.seq_len_kv)[None, :]
    m = j <= i + self.diag_offset
    return m if device is None else jax.device_put(m, device)


def _sizes(size) -> Tuple[int, int]:
  if len(size) == 1 and isinstance(size[0], (tuple, list)):
    size = tuple(size[0])
  if len(size) != 2:
    raise ValueError(f"expected (seq_len_q, seq_len_kv); got {size!r}")
  return int(size[0]), int(size[1])


def causal_upper_left(*size) -> CausalBias:
  """Causal mask aligned to the top-left corner (torch's ``is_causal=True``).

  Example:
    >>> from jbackends.attention import causal_upper_left
    >>> causal_upper_left(2, 3).materialize().astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
  """
  return CausalBias(CausalVariant.UPPER_LEFT, *_sizes(size))


def causal_lower_right(*size) -> CausalBias:
  """Causal mask aligned to the bottom-right corner (the last query sees every key).

  Example:
    >>> from jbackends.attention import causal_lower_right
    >>> causal_lower_right(2, 3).materialize().astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
  """
  return CausalBias(CausalVariant.LOWER_RIGHT, *_sizes(size))


# ----------------------------------------------------------------------------------------------
# Argument conversion (torch layout and jax.nn layout -> canonical AttentionArgs).
# ----------------------------------------------------------------------------------------------

def _check_array(name, x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"`{name}` must be an array; got {type(x).__name__}")


def _check_is_causal(is_causal):
  # torch raises TypeError for a non-bool is_causal; bool('False') would silently be causal.
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"`is_causal` must be a bool; got {type(is_causal).__name__} {is_causal!r}")


def _torch_to_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, dropout_rng=None):
  """torch SDPA arguments, layout ``(..., H, L, E)`` -> (AttentionArgs, batch_shape)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    _check_array(name, x)
    if x.ndim < 3:
      raise ValueError(f"`{name}` must have shape (..., heads, seq_len, head_dim) with rank >= 3; "
                       f"got {name}.shape={tuple(x.shape)}")
  if not (query.ndim == key.ndim == value.ndim):
    raise ValueError(f"query, key and value must have the same rank; got {query.shape=}, "
                     f"{key.shape=}, {value.shape=}")
  batch_shape = tuple(query.shape[:-3])
  for name, x in (("key", key), ("value", value)):
    if tuple(x.shape[:-3]) != batch_shape:
      raise ValueError(f"`{name}` batch dims {tuple(x.shape[:-3])} differ from query's {batch_shape}")
  Hq, L, E = query.shape[-3:]
  Hk, S = key.shape[-3], key.shape[-2]
  if Hq != Hk and not enable_gqa:
    raise ValueError(f"query has {Hq} heads and key/value {Hk}: pass enable_gqa=True for "
                     "grouped-query attention")
  if not isinstance(dropout_p, (int, float, np.floating)) or not 0.0 <= float(dropout_p) < 1.0:
    raise ValueError(f"`dropout_p` must be a float in [0, 1); got {dropout_p!r}")
  B = int(np.prod(batch_shape)) if batch_shape else 1

  def btnh(x):
    return jnp.swapaxes(x.reshape((B,) + tuple(x.shape[-3:])), 1, 2)

  _check_is_causal(is_causal)
  mask = bias = None
  causal, diag_offset = bool(is_causal), 0
  if isinstance(attn_mask, CausalBias):
    if is_causal:
      raise ValueError("pass either is_causal=True or a CausalBias attn_mask, not both")
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
      raise ValueError(f"CausalBias is ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) but the call "
                       f"has (L, S)=({L}, {S})")
    causal, diag_offset = True, attn_mask.diag_offset
  elif attn_mask is not None:
    _check_array("attn_mask", attn_mask)
    m = jnp.asarray(attn_mask)
    full = batch_shape + (Hq, L, S)
    if m.ndim > len(full):
      raise ValueError(f"`attn_mask` of shape {tuple(m.shape)} has more dims than {full}")
    m = m.reshape((1,) * (len(full) - m.ndim) + tuple(m.shape))
    for d, (a, b) in enumerate(zip(m.shape, full)):
      if a != 1 and a != b:
        raise ValueError(f"`attn_mask` with shape {tuple(attn_mask.shape)} is not broadcastable to "
                         f"(..., heads, L, S)={full} (dimension {d}: {a} vs {b})")
    lead = m.shape[:len(batch_shape)]
    if any(a != 1 for a in lead):
      m = jnp.broadcast_to(m, batch_shape + tuple(m.shape[-3:])).reshape((B,) + tuple(m.shape[-3:]))
    else:
      m = m.reshape((1,) + tuple(m.shape[-3:]))
    if m.dtype == jnp.bool_:
      mask = m
    elif jnp.issubdtype(m.dtype, jnp.floating):
      bias = m
    else:
      raise TypeError(f"`attn_mask` must be bool (True = attend) or floating (added); got {m.dtype}")
  args = _base.make_args(
      btnh(query), btnh(key), btnh(value), bias=bias, mask=mask, scale=scale, is_causal=causal,
      diag_offset=diag_offset, dropout_rate=float(dropout_p), dropout_rng=dropout_rng)
  return args, batch_shape


def _jaxnn_to_args(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                   logits_soft_cap=None, dropout_rate=0.0, dropout_rng=None, segment_ids=None):
  """jax.nn arguments (BTNH or TNH) -> (AttentionArgs, unbatched)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    _check_array(name, x)
  unbatched = query.ndim == 3
  if unbatched:
    if key.ndim != 3 or value.ndim != 3:
      raise ValueError(f"query is rank 3 [T, N, H]; key and value must be too: {key.shape=}, "
                       f"{value.shape=}")
    query, key, value = query[None], key[None], value[None]
  T = query.shape[1] if query.ndim == 4 else None
  S = key.shape[1] if key.ndim == 4 else None

  def four(name, x):
    if x is None:
      return None
    if isinstance(x, CausalBias):
      return x
    _check_array(name, x)
    x = jnp.asarray(x)
    if x.ndim > 4:
      raise ValueError(f"`{name}` must have rank <= 4 (broadcastable to [B, N, T, S]); got "
                       f"{name}.shape={tuple(x.shape)}")
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))

  _check_is_causal(is_causal)
  bias, mask = four("bias", bias), four("mask", mask)
  diag_offset = 0
  if isinstance(mask, CausalBias):
    if is_causal:
      raise ValueError("pass either is_causal=True or a CausalBias mask, not both")
    if (mask.seq_len_q, mask.seq_len_kv) != (T, S):
      raise ValueError(f"CausalBias is ({mask.seq_len_q}, {mask.seq_len_kv}) but the call has "
                       f"(T, S)=({T}, {S})")
    is_causal, diag_offset, mask = True, mask.diag_offset, None
  window = local_window_size
  if window is not None:
    if isinstance(window, (int, np.integer)):
      window = (int(window), int(window))
    elif not (isinstance(window, (tuple, list)) and len(window) == 2):
      raise ValueError(f"`local_window_size` must be an int or a (left, right) pair; got {window!r}")
  q_seg = kv_seg = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError("`segment_ids` must be one [B, T] array (self-attention) or a pair "
                         "(q_segment_ids [B, T], kv_segment_ids [B, S])")
      q_seg, kv_seg = segment_ids
    else:
      q_seg = kv_seg = segment_ids
    if unbatched:
      q_seg, kv_seg = jnp.asarray(q_seg)[None], jnp.asarray(kv_seg)[None]
  if unbatched:
    if query_seq_lengths is not None:
      query_seq_lengths = jnp.reshape(jnp.asarray(query_seq_lengths), (1,))
    if key_value_seq_lengths is not None:
      key_value_seq_lengths = jnp.reshape(jnp.asarray(key_value_seq_lengths), (1,))
  args = _base.make_args(
      query, key, value, bias=bias, mask=mask, scale=scale, is_causal=bool(is_causal),
      diag_offset=diag_offset, window=window, q_seq_lengths=query_seq_lengths,
      kv_seq_lengths=key_value_seq_lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
      logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  return args, unbatched


_IMPLEMENTATION_NAMES = {
    "xla": SDPBackend.MATH, "math": SDPBackend.MATH, "reference": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION, "flash_attention": SDPBackend.FLASH_ATTENTION,
    "xla_flash": SDPBackend.FLASH_ATTENTION,
    "mem_efficient": SDPBackend.EFFICIENT_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "efficient_attention": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION, "cudnn_attention": SDPBackend.CUDNN_ATTENTION,
}


def _implementation(implementation) -> Optional[int]:
  if implementation is None:
    return None
  if isinstance(implementation, SDPBackend):
    if implementation not in _RUNNABLE:
      raise ValueError(f"`implementation` must be one of {[b.name for b in _RUNNABLE]}; "
                       f"got {implementation!r}")
    return int(implementation)
  if isinstance(implementation, str) and implementation.lower() in _IMPLEMENTATION_NAMES:
    return int(_IMPLEMENTATION_NAMES[implementation.lower()])
  raise ValueError(f"`implementation` must be None, an SDPBackend or one of "
                   f"{sorted(_IMPLEMENTATION_NAMES)}; got {implementation!r}")


def _platforms(platforms, arrays) -> Tuple[tuple, tuple]:
  """``(required, optional)`` lowering platforms to choose for.

  Explicit ``platforms`` are all required. Otherwise the platform of the inputs (or the default
  backend) is required and, under ``jax.export`` only, the other of cpu/cuda is chosen for too when
  it can be, so a function exported for the other platform (``jax.export(...,
  platforms=["cuda"])``) carries that platform's kernel. A plain call traces one branch. JAX reuses
  a jitted function's trace: exporting a ``jax.jit`` object that a call already traced gives the
  other platform the XLA path (correct, not the Pallas kernel); export a fresh ``jax.jit(f)`` or
  pass ``platforms=`` for the kernel.
  """
  if platforms is not None:
    if isinstance(platforms, str):
      platforms = (platforms,)
    return tuple(_dispatch.canonical_platform(p) for p in platforms), ()
  primary = None
  for x in arrays:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      try:
        devs = x.devices()
      except Exception:  # noqa: BLE001
        continue
      if devs:
        primary = _dispatch.canonical_platform(next(iter(devs)).platform)
        break
  primary = primary or _dispatch.default_platform()
  if not _exporting():
    return (primary,), ()
  return (primary,), tuple(p for p in ("cpu", "cuda") if p != primary)


def _exporting() -> bool:
  """Whether this trace runs under ``jax.export`` (whose lowering platforms are not known yet).

  A plain ``jit`` call lowers for the platform it runs on, so tracing another platform's branch
  only costs time (3-4x the trace + lower time on CPU). ``jax.export.export(...)(...)`` traces from
  inside ``jax/_src/export/_export.py``; that frame on the stack is the signal (a walk of a few
  dozen frames, once per trace).
  """
  f = sys._getframe(1)
  marker = os.path.join("jax", "_src", "export", "")
  while f is not None:
    if marker in f.f_code.co_filename:
      return True
    f = f.f_back
  return False


def _shapes(*arrays) -> tuple:
  return tuple(tuple(x.shape) for x in arrays)


# ----------------------------------------------------------------------------------------------
# Public attention entry points.
# ----------------------------------------------------------------------------------------------

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, dropout_rng=None, platforms=None):
  """``torch.nn.functional.scaled_dot_product_attention`` for JAX (layout ``(..., H, L, E)``).

  Args:
    query: ``(..., Hq, L, E)``.
    key: ``(..., H, S, E)``.
    value: ``(..., H, S, Ev)``.
    attn_mask: None; a bool array (True = attend) or a float array (added to the logits),
      broadcastable to ``(..., Hq, L, S)``; or a :class:`CausalBias`.
    dropout_p: dropout probability on the attention weights, in ``[0, 1)``.
    is_causal: top-left causal mask (torch's convention; see :func:`causal_lower_right`); a bool
      (anything else is a ``TypeError``, as in torch).
    scale: logits scale, default ``1 / sqrt(E)``; any finite float (0 and negative ones too).
    enable_gqa: allow ``Hq`` to be a multiple of ``H`` (grouped-query attention).
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
  args, batch_shape = _torch_to_args(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                     enable_gqa, dropout_rng)
  out, _, _ = _dispatch.run(args, flags, *_platforms(platforms, (query,)),
                            shapes=_shapes(query, key, value))
  out = jnp.swapaxes(out, 1, 2)
  return out.reshape(batch_shape + tuple(out.shape[1:]))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: Optional[float] = None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None, implementation=None,
                          logits_soft_cap: Optional[float] = None, dropout_rate: float = 0.0,
                          dropout_rng=None, segment_ids=None, return_residual: bool = False,
                          platforms=None, fully_masked_rows: str = "jax",
                          residual_gradient: bool = False, residual_dtype=None):
  """Drop-in for ``jax.nn.dot_product_attention`` (layout BTNH) with a backend choice.

  Args:
    query: ``[B, T, N, H]`` (or ``[T, N, H]``).
    key: ``[B, S, K, H]`` with ``N % K == 0`` (GQA / MQA).
    value: ``[B, S, K, Hv]``.
    bias: additive float bias broadcastable to ``[B, N, T, S]``.
    mask: bool mask broadcastable to ``[B, N, T, S]`` (True = attend), or a :class:`CausalBias`.
    scale: logits scale, default ``1 / sqrt(H)``.
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
  grad, Hessian-vector products by reverse over reverse) on every backend but cuDNN (jax's cuDNN
  backward is a custom call with no derivative: a second derivative there raises
  ``NotImplementedError`` naming the way out). The flash and memory-efficient
  backends (C++, blockwise XLA, Pallas) are ``custom_vjp`` functions whose backward recomputes per
  block; their backward is itself differentiable, with the math formulation as its derivative, so
  the second-order pass materialises the ``[B, N, T, S]`` weights like MATH does. Forward mode
  (``jax.jvp``, ``jacfwd``, forward-over-reverse HVPs) raises JAX's custom_vjp error on those
  backends; use ``implementation="math"`` (or ``sdpa_kernel(SDPBackend.MATH)``) there. cuDNN's LSE
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
  only = _implementation(implementation)
  _check_fully_masked_rows(fully_masked_rows)
  args, unbatched = _jaxnn_to_args(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng, segment_ids=segment_ids)
  out, lse, _ = _dispatch.run(args, flags, *_platforms(platforms, (query,)), only=only,
                              shapes=_shapes(query, key, value))
  out, lse = _fully_masked_rows(args, out, lse, fully_masked_rows)
  if unbatched:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  lse = jnp.swapaxes(lse, -1, -2)
  if not residual_gradient:
    lse = jax.lax.stop_gradient(lse)
  return out, lse.astype(query.dtype if residual_dtype is None else residual_dtype)


#: jax.nn's masking value (``_get_large_negative``: capped at the float32 range): the LSE residual of
#: a fully masked row is this number (log S vanishes next to it) in the query's dtype.
_JAXNN_LARGE_NEGATIVE = float(np.asarray(-0.7 * np.finfo(np.float32).max, np.float32))


def _check_fully_masked_rows(mode) -> str:
  if mode not in ("jax", "zero"):
    raise ValueError(f"`fully_masked_rows` must be 'jax' (jax.nn's answer: the mean of V) or 'zero'; "
                     f"got {mode!r}")
  return mode


def _fully_masked_rows(args, out, lse, mode):
  """jax.nn's answer for rows without a key (the kernels give output 0 and LSE -inf there).

  The rows are found from the kernels' LSE (``-inf`` iff no key is left), so this costs
  ``O(B * N * T)`` on top of the kernel and needs nothing from the kernels themselves. The
  substituted mean of V carries jax.nn's gradient (1 / S per key) through ``jnp.where``; the
  kernels' zero output there carries none.
  """
  if _check_fully_masked_rows(mode) == "zero" or args.kv_len == 0:
    return out, lse
  masked = args.mask is not None or args.has_index_masks
  if not masked and args.bias is None:
    return out, lse  # every row has a finite logit
  empty = lse == -jnp.inf  # [B, N, T]
  rows = jnp.swapaxes(empty, 1, 2)[..., None]  # [B, T, N, 1]
  if not masked:  # only a -inf bias removed the keys: jax.nn's softmax of all -inf is NaN
    return jnp.where(rows, jnp.asarray(jnp.nan, out.dtype), out), lse
  if args.q_seq_lengths is not None:  # jax.nn zeroes the rows beyond the query length
    valid = jnp.arange(args.q_len, dtype=jnp.int32)[None, :] < args.q_seq_lengths[:, None]
    rows = rows & valid[:, :, None, None]
  vmean = jnp.mean(args.v.astype(jnp.promote_types(args.v.dtype, jnp.float32)), axis=1)
  vmean = jnp.repeat(vmean, args.groups, axis=1)  # [B, N, Hv]: query head n reads kv head n // G
  out = jnp.where(rows, vmean[:, None].astype(out.dtype), out)
  return out, jnp.where(empty, jnp.asarray(_JAXNN_LARGE_NEGATIVE, lse.dtype), lse)


# ----------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------

_EXPLAIN_PLATFORMS = ("cpu", "cuda", "gpu", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which backend a call would use on ``platform`` and, for every other backend, why not.

  Attributes:
    platform: the lowering platform explained (``"cpu"``, ``"cuda"``, ...).
    chosen: the ``SDPBackend`` that would run, or None (the call would raise).
    order: the backends in the priority order that was tried.
    reasons: ``SDPBackend -> reason`` for every backend not chosen.
    implementation: the name of the implementation that would run (``"cpp_flash"``,
      ``"triton_flash"``, ``"xla_mem_efficient"``, ...; ``docs/architecture.md`` lists them).
    kernel: what that implementation is (technology, one line), then why each other implementation
      of the chosen backend on this platform was not used (e.g. ``"not cpp_flash: ... soft cap"``);
      None when nothing can run.
    sharding: for inputs that carry a ``NamedSharding`` (arrays or ``ShapeDtypeStruct``s): what
      stays split and how (``docs/sharding.md``), e.g. ``"sequence split over sp: a ring of 8
      steps"``; None for unsharded inputs.
  """
  platform: str
  chosen: Optional[SDPBackend]
  order: Tuple[SDPBackend, ...]
  reasons: Mapping[SDPBackend, str]
  implementation: Optional[str]
  kernel: Optional[str] = None
  sharding: Optional[str] = None

  def __str__(self) -> str:
    head = (f"SDPA on {self.platform}: {self.chosen.name} ({self.implementation})"
            if self.chosen is not None else f"SDPA on {self.platform}: no enabled backend can run")
    if self.kernel:
      head += f"\n  runs: {self.kernel}"
    if self.sharding:
      head += f"\n  sharding: {self.sharding}"
    return "\n".join([head] + [f"  {b.name}: {self.reasons[b]}" for b in self.order
                               if b in self.reasons])


def explain(query, key, value, *, api: str = "dot_product_attention", platform: Optional[str] = None,
            compute_capability: Optional[float] = None, cudnn_version: Optional[int] = None,
            **kwargs) -> Explanation:
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
    >>> e = explain(q, q, q, bias=jax.ShapeDtypeStruct((1, 8, 4096, 4096), jnp.float32))
    >>> e.chosen, e.reasons[SDPBackend.FLASH_ATTENTION][:31]
    (<SDPBackend.EFFICIENT_ATTENTION: 2>, 'FLASH takes no additive bias / ')
  """
  flags = current_flags()
  if api not in ("dot_product_attention", "sdpa"):
    raise ValueError(f"`api` must be 'dot_product_attention' or 'sdpa'; got {api!r}")
  if platform is not None and (not isinstance(platform, str)
                               or platform.lower() not in _EXPLAIN_PLATFORMS):
    raise ValueError(f"`platform` must be one of {list(_EXPLAIN_PLATFORMS)} (or None: the default "
                     f"backend's); got {platform!r}")
  api_fn = dot_product_attention if api == "dot_product_attention" else scaled_dot_product_attention
  valid = [n for n in inspect.signature(api_fn).parameters if n not in ("query", "key", "value")]
  unknown = sorted(set(kwargs) - set(valid))
  if unknown:
    raise TypeError(f"explain(api={api!r}) got unexpected keyword argument(s) {unknown}; the "
                    f"keywords of {api_fn.__name__} are {valid}")
  plat = _dispatch.canonical_platform(platform) if platform else _dispatch.default_platform()
  implementation = kwargs.pop("implementation", None)
  only = _implementation(implementation)
  device_info = {}
  if compute_capability is not None:
    device_info["compute_capability"] = float(compute_capability)
  if cudnn_version is not None:
    device_info["cudnn_version"] = int(cudnn_version)
  for name in ("return_residual", "platforms", "fully_masked_rows", "residual_gradient",
               "residual_dtype"):
    kwargs.pop(name, None)
  result = {}

  def probe(q, k, v, kw):
    if api == "sdpa":
      args, _ = _torch_to_args(q, k, v, **kw)
    else:
      args, _ = _jaxnn_to_args(q, k, v, **kw)
    result["d"] = _dispatch.decide(args, flags, plat, only=only, device_info=device_info or None)
    result["args"] = args
    return 0

  arrays, static = {}, {}
  for name, val in kwargs.items():
    if isinstance(val, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or (
        isinstance(val, (tuple, list)) and val and all(
            isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in val)):
      arrays[name] = val
    else:
      static[name] = val
  jax.eval_shape(lambda q, k, v, arr: probe(q, k, v, {**static, **arr}), query, key, value, arrays)
  d = result["d"]
  impl = d.implementation
  kernel = None
  if impl is not None:
    kernel = f"{impl.name}: {impl.technology}" + (f", {impl.description}" if impl.description else "")
    if impl.name == "cpp_flash":
      from pallas_kernels.attention import cpu_flash  # noqa: PLC0415 - optional extension
      kernel += f" (up to {cpu_flash.threads()} threads)"
    kernel += "".join(f"\n    not {n}: {r}" for n, r in d.implementation_reasons.items())
  return Explanation(platform=plat, chosen=None if d.chosen is None else SDPBackend(d.chosen),
                     order=tuple(SDPBackend(b) for b in d.order),
                     reasons={SDPBackend(b): r for b, r in d.reasons.items()},
                     implementation=None if impl is None else impl.name,
                     kernel=kernel, sharding=_sharding_plan(query, key, api, result["args"], d.chosen))


def _sharding_plan(query, key, api, args, chosen) -> Optional[str]:
  """The ``sharding`` line of :func:`explain` (None when the inputs carry no NamedSharding)."""
  specs = []
  for x in (query, key):
    s = getattr(x, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or getattr(x, "ndim", len(x.shape)) != 4:
      return None
    spec = tuple(s.spec) + (None,) * (4 - len(tuple(s.spec)))
    specs.append(spec if api == "dot_product_attention" else (spec[0], spec[2], spec[1], spec[3]))
  if not any(e is not None for spec in specs for e in spec):
    return None
  if chosen is None:
    return None
  if SDPBackend(chosen) in (SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
    return "partitioned by XLA / JAX's own rules (plain XLA ops or JAX's cuDNN call)"
  from pallas_kernels.attention import sharded  # noqa: PLC0415
  return sharded.plan(args, specs[0], specs[1], dict(query.sharding.mesh.shape))


# ----------------------------------------------------------------------------------------------
# torch.backends.cuda-style capability queries.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class SDPAParams:
  """The arguments of one SDPA call, for the ``can_use_*`` queries (``torch.backends.cuda.SDPAParams``)."""
  query: Any
  key: Any
  value: Any
  attn_mask: Any = None
  dropout: float = 0.0
  is_causal: bool = False
  enable_gqa: bool = False


def _can_use(backend: SDPBackend, params: SDPAParams, debug: bool) -> bool:
  if not isinstance(params, SDPAParams):
    raise TypeError(f"`params` must be an SDPAParams; got {type(params).__name__}")
  plat = _dispatch.default_platform()
  reasons = []
  q, k, v = params.query, params.key, params.value
  dropout_rng = jax.ShapeDtypeStruct((2,), jnp.uint32) if params.dropout else None

  def probe(q, k, v, m):
    args, _ = _torch_to_args(q, k, v, m, params.dropout, params.is_causal, None,
                             params.enable_gqa, dropout_rng)
    choice = _dispatch.backend_choice(args, int(backend), plat)  # flags not consulted, as in torch
    reasons.extend(_dispatch.backend_reasons(choice, int(backend)))
    return 0

  try:
    jax.eval_shape(probe, q, k, v, params.attn_mask)
  except (ValueError, TypeError) as e:
    reasons.append(f"invalid arguments: {e}")
  if debug:
    for r in reasons:
      warnings.warn(f"{backend.name} cannot be used: {r}", UserWarning, stacklevel=3)
  return not reasons


def can_use_flash_attention(params: SDPAParams, debug: bool = False) -> bool:
  """Whether FLASH_ATTENTION can run ``params`` here (the XLA implementation counts on CPU).

  ``debug=True`` warns once per failed constraint. Flags are not consulted (as in torch).

  Example:
    >>> import jax.numpy as jnp
    >>> from jbackends.attention import SDPAParams, can_use_flash_attention
    >>> x = jnp.ones((1, 2, 8, 16))
    >>> can_use_flash_attention(SDPAParams(x, x, x, None, 0.0, True, False))
    True
  """
  return _can_use(SDPBackend.FLASH_ATTENTION, params, debug)


def can_use_efficient_attention(params: SDPAParams, debug: bool = False) -> bool:
  """Whether EFFICIENT_ATTENTION can run ``params`` here (see :func:`can_use_flash_attention`)."""
  return _can_use(SDPBackend.EFFICIENT_ATTENTION, params, debug)


def can_use_cudnn_attention(params: SDPAParams, debug: bool = False) -> bool:
  """Whether CUDNN_ATTENTION can run ``params`` here (False on CPU, with the reason under debug)."""
  return _can_use(SDPBackend.CUDNN_ATTENTION, params, debug)


def is_flash_attention_available() -> bool:
  """Whether a FLASH_ATTENTION implementation exists for the default platform (always, via XLA)."""
  return bool(_sdpa_registry.implementations(_dispatch.FLASH, _dispatch.default_platform()))
