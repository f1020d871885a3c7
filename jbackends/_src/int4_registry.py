"""The int4 matmul implementations: per lowering platform, an ordered list of `Implementation`s.

Both int4 operations (``dyn_quant``: int8 activations, W4A8; ``weight_only``: W4A16 / W4A32) share the
list; each engine's ``unsupported(call, platform)`` takes an `Int4Call` that names the operation.
``run(x, packed, *, op, compute_dtype)`` computes. The ``quantized_engine`` flag filters the list
(:func:`engine_filter`).

=============  =========================================================
platform       implementations, in the order tried
=============  =========================================================
cuda / rocm    pallas (Pallas Triton), xla
cpu            pallas_interpret, cpp (C++ through jax.ffi), xla
other          pallas_interpret, xla
=============  =========================================================
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from jbackends._src.dispatch import GPU_LOWERING, PLATFORM_NAMES, Implementation, lazy

__all__ = [
    "PALLAS",
    "PALLAS_INTERPRET",
    "CPP",
    "XLA",
    "REFERENCE",
    "BY_NAME",
    "implementations",
    "engine_filter",
    "PLATFORM_NAMES",
]

_PKG = "pallas_kernels.int4_matmul"


def _pallas_run(interpret: bool):
    def run(x, packed, *, op, compute_dtype=None):
        if op == "dyn_quant":
            return lazy(f"{_PKG}.triton:dyn_quant_matmul")(x, packed, interpret=interpret)
        return lazy(f"{_PKG}.triton:weight_only_matmul")(
            x, packed, compute_dtype=compute_dtype, interpret=interpret
        )

    return run


def _cpp_run(x, packed, *, op, compute_dtype=None):
    del compute_dtype
    # bfloat16 x goes in as it is: the kernels widen it and round / truncate the result themselves
    xk = x if x.dtype == jnp.bfloat16 else x.astype(jnp.float32)
    if op == "dyn_quant":
        return lazy(f"{_PKG}.cpp:dyn_quant_matmul")(xk, packed)
    return lazy(f"{_PKG}.cpp:weight_only_matmul")(xk, packed).astype(x.dtype)


def _xla_run(x, packed, *, op, compute_dtype=None):
    if op == "dyn_quant":
        return lazy(f"{_PKG}.xla:dyn_quant_matmul")(x, packed)
    return lazy(f"{_PKG}.xla:weight_only_matmul")(x, packed, compute_dtype=compute_dtype)


def _reference_run(x, packed, *, op, compute_dtype=None):
    del compute_dtype
    fn = "dyn_quant_matmul" if op == "dyn_quant" else "weight_only_matmul"
    return lazy(f"{_PKG}.base:{fn}")(x, packed)


def _triton_missing() -> list:
    from pallas_kernels import triton_backend  # noqa: PLC0415 - loads Pallas: only when asked

    return triton_backend.missing()


def _pallas_reasons(call, platform, device):
    del device
    return _triton_missing() or lazy(f"{_PKG}.triton:unsupported")(call, platform)


def _interpret_reasons(call, platform, device):
    del platform, device
    return _triton_missing() or lazy(f"{_PKG}.triton:unsupported")(call, None)


def _reasons(path: str):
    fn = lazy(f"{_PKG}.{path}")
    return lambda call, platform, device: fn(call, platform)


PALLAS = Implementation(
    "pallas",
    "Pallas Triton",
    GPU_LOWERING,
    _pallas_reasons,
    _pallas_run(False),
    description="fused dequantize + MMA kernels",
)
PALLAS_INTERPRET = Implementation(
    "pallas_interpret",
    "Pallas Triton (interpreted)",
    None,
    _interpret_reasons,
    _pallas_run(True),
    description="the GPU kernels in the Pallas interpreter (tests; only with quantized_engine='pallas')",
)
CPP = Implementation(
    "cpp",
    "C++ (jax.ffi)",
    ("cpu",),
    _reasons("cpp:unsupported"),
    _cpp_run,
    description=(
        "AVX2 / AVX-512 (VNNI) kernels; row paths for decode, blocked 16-rows-per-vector paths from "
        "9 (dyn-quant) / 16 (weight-only) rows; weight-only up to a measured crossover (cpp.weight_only_max_rows); "
        "bfloat16 weight-only activations by AVX512-BF16 dots where the CPU has them (no row limit)"
    ),
)
XLA = Implementation(
    "xla",
    "XLA",
    None,
    _reasons("xla:unsupported"),
    _xla_run,
    description="int4 unpack + grouped dots in XLA",
    symbolic_shapes=True,  # shape-polymorphic exports (a symbolic batch)
)
REFERENCE = Implementation(
    "reference",
    "XLA",
    None,
    lambda call, platform, device: [],
    _reference_run,
    description="the float64-faithful reference (pinned only)",
)

_LISTS = {"gpu": (PALLAS, XLA), "cpu": (PALLAS_INTERPRET, CPP, XLA), "other": (PALLAS_INTERPRET, XLA)}

#: implementation name -> implementation (what ``implementation=`` pins).
BY_NAME: dict[str, Implementation] = {i.name: i for i in (PALLAS, PALLAS_INTERPRET, CPP, XLA, REFERENCE)}


def implementations(platform: str) -> tuple[Implementation, ...]:
    """The implementations tried when lowering for ``platform``, in order."""
    if platform in GPU_LOWERING:
        return _LISTS["gpu"]
    return _LISTS["cpu" if platform == "cpu" else "other"]


def engine_filter(engine: str, platform: str) -> Mapping[str, str]:
    """What the ``quantized_engine`` flag excludes (name -> reason): 'auto' interprets no GPU kernel;
    'pallas' forces the Pallas kernels (interpreted off GPU): neither the C++ kernel nor XLA runs then,
    and a call the Pallas kernels cannot run is an error, never a fallback; 'xla' never uses them (the
    C++ kernel still runs on CPU)."""
    if engine == "xla":
        return {PALLAS.name: "quantized_engine='xla'", PALLAS_INTERPRET.name: "quantized_engine='xla'"}
    if engine == "pallas":
        forced = "quantized_engine='pallas' (only the Pallas kernels may run)"
        excluded = {CPP.name: forced, XLA.name: forced}
        if platform not in GPU_LOWERING:
            excluded[PALLAS.name] = f"no GPU when lowering for {platform}: interpreted"
        return excluded
    return {PALLAS_INTERPRET.name: "the GPU kernels are interpreted only with quantized_engine='pallas'"}
