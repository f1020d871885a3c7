"""SDPA argument conversion: torch layout / keywords and jax.nn layout / keywords -> canonical
``AttentionArgs``, with the checks that give bad input a clear error, and the lowering platforms."""

from __future__ import annotations

import math
import os
import sys
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jbackends._src import attention_dispatch as _dispatch
from jbackends._src.causal_bias import CausalBias
from jbackends._src.sdp_backends import RUNNABLE, SDPBackend
from pallas_kernels.attention import base as _base

__all__ = [
    "check_array",
    "check_is_causal",
    "torch_to_args",
    "jaxnn_to_args",
    "implementation_code",
    "lowering_platforms",
    "exporting",
    "shapes_of",
]


def check_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`{name}` must be an array; got {type(x).__name__}")


def check_is_causal(is_causal):
    # torch raises TypeError for a non-bool is_causal; bool('False') would silently be causal.
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"`is_causal` must be a bool; got {type(is_causal).__name__} {is_causal!r}")


def _probability(dropout_p) -> float:
    """``dropout_p`` as a Python float in [0, 1]: a number or a concrete 0-d array (a TypeError for a
    traced value or another type, a ValueError out of range)."""
    if isinstance(dropout_p, jax.core.Tracer):
        raise TypeError(
            "`dropout_p` must be a concrete number, not a traced value: pass a Python float (static under "
            "jit), as torch takes"
        )
    p = None
    if not isinstance(dropout_p, (str, bytes)) and np.ndim(dropout_p) == 0:
        try:
            p = float(dropout_p)
        except (TypeError, ValueError):
            pass
    if p is None:
        raise TypeError(
            f"`dropout_p` must be a float in [0, 1]; got {type(dropout_p).__name__} {dropout_p!r}"
        )
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"`dropout_p` must be a float in [0, 1]; got {dropout_p!r}")
    return p


def torch_to_args(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    dropout_rng=None,
):
    """torch SDPA arguments, layout ``(..., H, L, E)`` -> (AttentionArgs, the output's leading shape).

    Leading dims (batch and heads) broadcast as torch's math path broadcasts them (its matmuls): a
    key / value with batch 1 against a batched query, a rank-3 value against rank-4 query and key, a
    single kv head without ``enable_gqa``, and 2-D ``(L, E)`` inputs. One kv head is kept as one (run
    as grouped-query attention, not copied); other broadcasts are made explicit."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_array(name, x)
        if x.ndim < 2:
            raise ValueError(
                f"`{name}` must have shape (..., heads, seq_len, head_dim) (or (seq_len, head_dim)); "
                f"got {name}.shape={tuple(x.shape)}"
            )
    if not isinstance(enable_gqa, (bool, np.bool_)):  # torch: TypeError; bool("no") would enable it
        raise TypeError(f"`enable_gqa` must be a bool; got {type(enable_gqa).__name__} {enable_gqa!r}")
    try:
        out_lead = jnp.broadcast_shapes(*(tuple(x.shape[:-2]) for x in (query, key)), tuple(value.shape[:-2]))
    except ValueError:
        out_lead = None
    rank = max(3, query.ndim, key.ndim, value.ndim)
    query, key, value = (
        jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape)) if x.ndim < rank else x
        for x in (query, key, value)
    )
    try:
        batch_shape = jnp.broadcast_shapes(*(tuple(x.shape[:-3]) for x in (query, key, value)))
    except ValueError:
        raise ValueError(
            f"the batch dims of query {tuple(query.shape[:-3])}, key {tuple(key.shape[:-3])} and value "
            f"{tuple(value.shape[:-3])} do not broadcast together"
        ) from None
    Hq, Hk, Hv = query.shape[-3], key.shape[-3], value.shape[-3]
    if enable_gqa and Hk > 0 and Hv > 0 and (Hq % Hk or Hq % Hv):  # torch refuses, broadcastable or not
        raise ValueError(
            f"with enable_gqa=True, key's and value's heads must each divide query's; got query {Hq}, "
            f"key {Hk} and value {Hv} heads"
        )
    if out_lead is not None:  # torch's math path broadcasts the heads like any other leading dim
        heads = out_lead[-1] if out_lead else 1
        Hk_to = 1 if Hk == Hv == 1 else heads  # one kv head runs as GQA, uncopied
        query = _broadcast_to(query, batch_shape + (heads,) + tuple(query.shape[-2:]))
        key = _broadcast_to(key, batch_shape + (Hk_to,) + tuple(key.shape[-2:]))
        value = _broadcast_to(value, batch_shape + (Hk_to,) + tuple(value.shape[-2:]))
    elif enable_gqa and Hk > 0 and Hv > 0 and Hq % Hk == 0 and Hq % Hv == 0:
        # Grouped heads: query head n reads key head n // (Hq // Hk) and value head n // (Hq // Hv).
        # Key and value heads that differ (torch repeats each to Hq) are repeated to their least
        # common multiple, which keeps both groupings.
        Hkv = math.lcm(Hk, Hv)
        key = key if Hkv == Hk else jnp.repeat(key, Hkv // Hk, axis=-3)
        value = value if Hkv == Hv else jnp.repeat(value, Hkv // Hv, axis=-3)
        out_lead = batch_shape + (Hq,)
        query, key, value = (_broadcast_to(x, batch_shape + tuple(x.shape[-3:])) for x in (query, key, value))
    else:
        raise ValueError(
            f"query has {Hq} heads, key {Hk} and value {Hv}: they must be equal or broadcast (1), or, "
            "with enable_gqa=True, key's and value's must each divide query's"
        )
    dropout_p = _probability(dropout_p)
    Hq, L, E = query.shape[-3:]
    S = key.shape[-2]
    B = math.prod(batch_shape)  # symbolic dims (a shape-polymorphic export) multiply too

    def btnh(x):
        return jnp.swapaxes(x.reshape((B,) + tuple(x.shape[-3:])), 1, 2)

    check_is_causal(is_causal)
    mask = bias = None
    causal, diag_offset = bool(is_causal), 0
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            raise ValueError("pass either is_causal=True or a CausalBias attn_mask, not both")
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
            raise ValueError(
                f"CausalBias is ({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) but the call "
                f"has (L, S)=({L}, {S})"
            )
        causal, diag_offset = True, attn_mask.diag_offset
    elif attn_mask is not None:
        check_array("attn_mask", attn_mask)
        m = jnp.asarray(attn_mask)
        full = batch_shape + (Hq, L, S)
        if m.ndim > len(full):
            raise ValueError(f"`attn_mask` of shape {tuple(m.shape)} has more dims than {full}")
        m = m.reshape((1,) * (len(full) - m.ndim) + tuple(m.shape))
        for d, (a, b) in enumerate(zip(m.shape, full)):
            if a != 1 and a != b:
                raise ValueError(
                    f"`attn_mask` with shape {tuple(attn_mask.shape)} is not broadcastable to "
                    f"(..., heads, L, S)={full} (dimension {d}: {a} vs {b})"
                )
        lead = m.shape[: len(batch_shape)]
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
        btnh(query),
        btnh(key),
        btnh(value),
        bias=bias,
        mask=mask,
        scale=scale,
        is_causal=causal,
        diag_offset=diag_offset,
        # dropout_p = 1 drops every weight: torch's math path gives zeros, which the caller makes
        # of this call without dropout (`scaled_dot_product_attention`); no key is needed for it.
        dropout_rate=0.0 if float(dropout_p) == 1.0 else float(dropout_p),
        dropout_rng=None if float(dropout_p) == 1.0 else dropout_rng,
    )
    return args, tuple(out_lead)


def _broadcast_to(x, shape):
    return x if tuple(x.shape) == tuple(shape) else jnp.broadcast_to(x, shape)


def jaxnn_to_args(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    logits_soft_cap=None,
    dropout_rate=0.0,
    dropout_rng=None,
    segment_ids=None,
):
    """jax.nn arguments (BTNH or TNH) -> (AttentionArgs, unbatched)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_array(name, x)
    unbatched = query.ndim == 3
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(
                f"query is rank 3 [T, N, H]; key and value must be too: {key.shape=}, {value.shape=}"
            )
        query, key, value = query[None], key[None], value[None]
    T = query.shape[1] if query.ndim == 4 else None
    S = key.shape[1] if key.ndim == 4 else None

    def four(name, x):
        if x is None:
            return None
        if isinstance(x, CausalBias):
            return x
        check_array(name, x)
        x = jnp.asarray(x)
        if x.ndim > 4:
            raise ValueError(
                f"`{name}` must have rank <= 4 (broadcastable to [B, N, T, S]); got "
                f"{name}.shape={tuple(x.shape)}"
            )
        return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))

    check_is_causal(is_causal)
    bias, mask = four("bias", bias), four("mask", mask)
    diag_offset = 0
    if isinstance(mask, CausalBias):
        if is_causal:
            raise ValueError("pass either is_causal=True or a CausalBias mask, not both")
        if (mask.seq_len_q, mask.seq_len_kv) != (T, S):
            raise ValueError(
                f"CausalBias is ({mask.seq_len_q}, {mask.seq_len_kv}) but the call has (T, S)=({T}, {S})"
            )
        is_causal, diag_offset, mask = True, mask.diag_offset, None
    window = local_window_size
    if window is not None:
        if isinstance(window, (int, np.integer)):
            window = (int(window), int(window))
        elif not (isinstance(window, (tuple, list)) and len(window) == 2):
            raise ValueError(f"`local_window_size` must be an int or a (left, right) pair; got {window!r}")
    q_seg = kv_seg = None
    seg_names = {"q_segment_ids": "segment_ids", "kv_segment_ids": "segment_ids"}
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    "`segment_ids` must be one [B, T] array (self-attention) or a pair "
                    "(q_segment_ids [B, T], kv_segment_ids [B, S])"
                )
            q_seg, kv_seg = segment_ids
            seg_names = {"q_segment_ids": "segment_ids[0]", "kv_segment_ids": "segment_ids[1]"}
        else:
            if T is not None and S is not None and T != S:
                raise ValueError(
                    f"`segment_ids`: one array serves self-attention (T == S); with T={T} queries and "
                    f"S={S} keys pass a pair (q_segment_ids [B, T], kv_segment_ids [B, S])"
                )
            q_seg = kv_seg = segment_ids
        if unbatched:
            q_seg, kv_seg = jnp.asarray(q_seg)[None], jnp.asarray(kv_seg)[None]
    if unbatched:  # a scalar or shape (1,) length; any other shape is refused by make_args
        if query_seq_lengths is not None and np.size(query_seq_lengths) == 1:
            query_seq_lengths = jnp.reshape(jnp.asarray(query_seq_lengths), (1,))
        if key_value_seq_lengths is not None and np.size(key_value_seq_lengths) == 1:
            key_value_seq_lengths = jnp.reshape(jnp.asarray(key_value_seq_lengths), (1,))
    args = _base.make_args(
        query,
        key,
        value,
        bias=bias,
        mask=mask,
        scale=scale,
        is_causal=bool(is_causal),
        diag_offset=diag_offset,
        window=window,
        q_seq_lengths=query_seq_lengths,
        kv_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        names={"q_seq_lengths": "query_seq_lengths", "kv_seq_lengths": "key_value_seq_lengths", **seg_names},
    )
    return args, unbatched


_IMPLEMENTATION_NAMES = {
    "xla": SDPBackend.MATH,
    "math": SDPBackend.MATH,
    "reference": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "flash_attention": SDPBackend.FLASH_ATTENTION,
    "xla_flash": SDPBackend.FLASH_ATTENTION,
    "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "efficient_attention": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "cudnn_attention": SDPBackend.CUDNN_ATTENTION,
}


def implementation_code(implementation) -> Optional[int]:
    if implementation is None:
        return None
    if isinstance(implementation, SDPBackend):
        if implementation not in RUNNABLE:
            raise ValueError(
                f"`implementation` must be one of {[b.name for b in RUNNABLE]}; got {implementation!r}"
            )
        return int(implementation)
    if isinstance(implementation, str) and implementation.lower() in _IMPLEMENTATION_NAMES:
        return int(_IMPLEMENTATION_NAMES[implementation.lower()])
    raise ValueError(
        f"`implementation` must be None, an SDPBackend or one of "
        f"{sorted(_IMPLEMENTATION_NAMES)}; got {implementation!r}"
    )


def lowering_platforms(platforms, arrays) -> Tuple[tuple, tuple]:
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
        known = _dispatch.PLATFORM_NAMES
        try:
            platforms = tuple(platforms)
        except TypeError:
            raise TypeError(f"`platforms` must be a sequence of platform names, got {platforms!r}") from None
        bad = [p for p in platforms if not isinstance(p, str) or p.lower() not in known]
        if bad or not platforms:
            raise ValueError(
                f"`platforms` must name lowering platforms among {list(known)}, got {platforms!r}"
                + (f" ({', '.join(map(repr, bad))} unknown)" if bad else " (empty)")
            )
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
    if not exporting():
        return (primary,), ()
    return (primary,), tuple(p for p in ("cpu", "cuda") if p != primary)


def exporting() -> bool:
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


def shapes_of(*arrays) -> tuple:
    return tuple(tuple(x.shape) for x in arrays)


# ----------------------------------------------------------------------------------------------
# Public attention entry points.
# ----------------------------------------------------------------------------------------------
