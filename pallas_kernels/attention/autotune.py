"""Autotuning of the Pallas Triton kernels: time candidate configs on the GPU, cache the fastest.

Every kernel's config class follows one tuning protocol (:mod:`triton_tuning`):
``Config.heuristics(args, device)`` gives a good default without measuring (the kernels use it when no
config is passed) and ``Config.search_space(args)`` the candidates :func:`autotune` times. The cache
key is a *shape class*: the device kind (e.g. ``"NVIDIA H100 80GB HBM3"``), the kernel, dtype, padded
head dims, power-of-two buckets of the query / key lengths, the GQA group size and which features
change the inner loop (causal, window, bias, mask, dropout, softcap). Candidates that fail to compile
(e.g. too much shared memory) are skipped. :func:`autotune_int4` does the same for the Pallas Triton
int4 kernels (whose ``triton_config.Config`` follows the same protocol); :func:`timings` /
:func:`fastest` time both, each candidate in one jitted loop of dependent calls
(:func:`pallas_kernels.timing.loop_time`), not by a clock around one call. ``benchmarks/tune_gpu.py``
compares the heuristics with the search spaces on a GPU.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import autotune, base, triton_flash
  >>> x = jnp.ones((1, 20, 1, 16))
  >>> args = base.make_args(x, x, x)
  >>> cands = [triton_flash.Config(16, 16), triton_flash.Config(32, 16)]
  >>> cfg = autotune.autotune(args, "flash", candidates=cands, interpret=True, repeats=1)
  >>> cfg in cands
  True
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.attention import (
    base,
    triton_common as common,
    triton_decode,
    triton_flash,
    triton_flash_vjp,
    triton_tuning,
)
from pallas_kernels.int4_matmul import base as int4_base, triton as int4_triton, triton_config as int4_config
from pallas_kernels.timing import loop_time

__all__ = [
    "KERNELS",
    "CONFIGS",
    "shape_class",
    "candidates",
    "autotune",
    "autotune_int4",
    "fastest",
    "timings",
    "runner",
    "int4_runner",
    "clear_cache",
    "cache",
]

#: The config class of each kernel :func:`autotune` can time ("*_bwd": the fused backward's).
CONFIGS = {
    "flash": triton_tuning.Config,
    "flash_bwd": triton_tuning.BackwardConfig,
    "mem_efficient": triton_tuning.Config,
    "mem_efficient_bwd": triton_tuning.BackwardConfig,
    "decode": triton_tuning.DecodeConfig,
}
KERNELS = tuple(CONFIGS)

_cache: dict = {}
_lock = threading.Lock()


def cache() -> dict:
    """A copy of the autotune cache: ``{shape_class: config}``."""
    with _lock:
        return dict(_cache)


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _device_kind(interpret: bool) -> str:
    if interpret:
        return "interpret"
    return jax.devices()[0].device_kind


def shape_class(args: base.AttentionArgs, kernel: str, *, interpret: bool = False) -> tuple:
    """The cache key of ``args`` for ``kernel`` (see the module docstring)."""
    return (
        _device_kind(interpret),
        kernel,
        str(args.dtype),
        common.pad_dim(args.head_dim),
        common.pad_dim(args.v_head_dim),
        _bucket(args.q_len),
        _bucket(args.kv_len),
        args.groups,
        args.causal,
        args.window is not None,
        args.bias is not None,
        args.mask is not None,
        args.has_dropout,
        args.logits_soft_cap is not None,
    )


def candidates(kernel: str, head_dim: int, dtype=jnp.bfloat16) -> list:
    """The search space of ``kernel`` (``CONFIGS[kernel].search_space``) for a head dim / dtype."""
    if kernel not in CONFIGS:
        raise ValueError(f"`kernel` must be one of {KERNELS}; got {kernel!r}")
    x = jax.ShapeDtypeStruct((1, 1, 1, head_dim), dtype)
    return CONFIGS[kernel].search_space(base.make_args(x, x, x))


def runner(kernel: str, args: base.AttentionArgs, config, interpret: bool = False) -> Callable:
    """The jitted function :func:`autotune` times for ``kernel`` with ``config`` (``args -> outputs``;
    ``"*_bwd"``: the forward with its default config, then the backward with ``config``)."""
    if kernel in ("flash", "mem_efficient"):
        return jax.jit(lambda a: triton_flash.forward(a, config=config, interpret=interpret))
    if kernel in ("flash_bwd", "mem_efficient_bwd"):

        def f(a):
            out, lse = triton_flash.forward(a, interpret=interpret)
            return triton_flash_vjp.backward(
                a, out, lse, jnp.ones_like(out), config=config, interpret=interpret
            )

        return jax.jit(f)
    if kernel == "decode":
        return jax.jit(lambda a: triton_decode.forward(a, config=config, interpret=interpret))
    raise ValueError(f"`kernel` must be one of {KERNELS}; got {kernel!r}")


def autotune(
    args: base.AttentionArgs,
    kernel: str = "flash",
    *,
    candidates: Optional[Sequence[Any]] = None,
    interpret: bool = False,
    repeats: int = 5,
    use_cache: bool = True,
):
    """Times each candidate config of ``kernel`` on ``args`` and returns (and caches) the fastest.

    Args:
      args: a representative call (its arrays are used as the timing inputs).
      kernel: one of :data:`KERNELS`.
      candidates: configs to try (default ``CONFIGS[kernel].search_space(args)``).
      interpret: time the Pallas interpreter instead (CPU testing of this function only: the
        timings mean nothing).
      repeats: timed runs per candidate after one warm-up (compile) run; the median counts.
      use_cache: return a cached result for the same :func:`shape_class`.

    Returns:
      The fastest config (an instance of ``CONFIGS[kernel]``).

    Raises:
      RuntimeError: no GPU (and not ``interpret``), or every candidate failed.
    """
    if kernel not in KERNELS:
        raise ValueError(f"`kernel` must be one of {KERNELS}; got {kernel!r}")
    _check_timing(repeats, interpret)
    cands = list(candidates) if candidates is not None else None

    def measure():
        space = cands if cands is not None else CONFIGS[kernel].search_space(args)
        return fastest(
            lambda cfg: runner(kernel, args, cfg, interpret),
            space,
            (args,),
            repeats=repeats,
            iters=_iters(interpret),
            min_loop_s=0.0 if interpret else 0.002,
        )

    return _cached(shape_class(args, kernel, interpret=interpret), use_cache, measure)


def _cached(key, use_cache: bool, measure: Callable):
    """The cached config of ``key`` (when ``use_cache``), else ``measure()``, cached."""
    if use_cache:
        with _lock:
            if key in _cache:
                return _cache[key]
    best = measure()
    with _lock:
        _cache[key] = best
    return best


def _iters(interpret: bool) -> int:
    """Calls per timed loop: 40 on a GPU (a 2 ms loop of 50-microsecond kernels without recompiling);
    1 in interpret mode (CPU tests of the tuner, no timing value)."""
    return 1 if interpret else 40


def _check_timing(repeats, interpret) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be an int >= 1; got {repeats=}")
    if not interpret and jax.default_backend() != "gpu":
        raise RuntimeError(
            "autotune times the Triton kernels on a GPU; the default backend is "
            f"{jax.default_backend()!r} (pass interpret=True only to test autotune)"
        )


def autotune_int4(
    x,
    packed: int4_base.PackedInt4Weight,
    op: str = "weight_only",
    *,
    candidates: Optional[Sequence[Any]] = None,
    interpret: bool = False,
    repeats: int = 5,
    use_cache: bool = True,
):
    """Times the Pallas Triton int4 kernel of ``op`` (``"weight_only"``: W4A16, ``"dyn_quant"``: W4A8)
    on ``x`` and ``packed`` and returns (and caches) the fastest :class:`triton_config.Config`.

    ``candidates`` default to ``Config.search_space(call)``; the cache key is the device kind, ``op``,
    the dtype of ``x``, the power-of-two bucket of its rows and the weight's shape and group size.
    Same errors as :func:`autotune`.
    """
    call = int4_base.Int4Call.of(op, x, packed)
    _check_timing(repeats, interpret)
    key = (_device_kind(interpret), "int4_" + op, str(call.x_dtype), _bucket(call.rows))
    key += (packed.out_features, packed.in_features, packed.groupsize)
    cands = list(candidates) if candidates is not None else int4_config.Config.search_space(call)

    def measure():
        run = lambda cfg: int4_runner(op, cfg, interpret)  # noqa: E731
        return fastest(
            run,
            cands,
            (x, packed),
            repeats=repeats,
            iters=_iters(interpret),
            min_loop_s=0.0 if interpret else 0.002,
        )

    return _cached(key, use_cache, measure)


def timings(
    make_fn: Callable,
    configs: Sequence[Any],
    operands: tuple,
    *,
    repeats: int = 5,
    iters: int = 10,
    min_loop_s: float = 0.002,
) -> list:
    """``[(config, seconds per call or None, error or None)]`` for each config: ``make_fn(config)`` timed
    on ``operands`` in one jitted loop of at least ``iters`` dependent calls lasting at least
    ``min_loop_s`` (:func:`pallas_kernels.timing.loop_time`, the median of ``repeats`` loops after a
    warm-up), not by a clock around one call, whose launch and synchronisation costs would swamp a short
    kernel. A config that fails to compile or run gets its error instead of a time."""
    out = []
    for cfg in configs:
        try:
            t = loop_time(make_fn(cfg), operands, iters=iters, repeats=repeats, min_loop_s=min_loop_s)
        except Exception as e:  # noqa: BLE001 - a config that does not compile / fit is skipped
            out.append((cfg, None, f"{type(e).__name__}: {e}"[:300]))
            continue
        out.append((cfg, t, None))
    return out


def int4_runner(op: str, config, interpret: bool = False) -> Callable:
    """The jitted ``(x, packed) -> out`` :func:`autotune_int4` times: the Pallas Triton int4 kernel of
    ``op`` (``"weight_only"`` / ``"dyn_quant"``) with ``config``."""
    if op not in ("weight_only", "dyn_quant"):
        raise ValueError(f"`op` must be 'weight_only' or 'dyn_quant'; got {op!r}")
    fn = int4_triton.weight_only_matmul if op == "weight_only" else int4_triton.dyn_quant_matmul
    return jax.jit(lambda a, p: fn(a, p, config=config, interpret=interpret))


def fastest(make_fn: Callable, configs: Sequence[Any], operands: tuple, **timing):
    """The config whose ``make_fn(config)(*operands)`` runs fastest (:func:`timings`, which takes the
    ``timing`` keywords: ``repeats``, ``iters``, ``min_loop_s``); a config that fails to compile or run
    is skipped.

    Raises:
      RuntimeError: every config failed (their errors are listed).
    """
    timed = timings(make_fn, configs, operands, **timing)
    ok = [(t, i) for i, (_, t, _) in enumerate(timed) if t is not None]
    if not ok:
        raise RuntimeError(
            "autotune: every candidate failed:\n" + "\n".join(f"{c}: {e}" for c, _, e in timed)
        )
    return timed[min(ok)[1]][0]
