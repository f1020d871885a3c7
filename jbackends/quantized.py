"""`torch.backends.quantized` for JAX, plus the int4 weight matmuls it selects.

torch's dynamic-quantization int4 ops with the same numerics (bit-exact for
float32 input), truly packed weights (0.5 byte per weight, a pytree), any
leading batch dims, any layout:

* `quantize_4bit(weight, groupsize)` -> ``(uint8 [N, K/2], float32 scales)``.
* `dyn_quant_pack_4bit_weight(weights, scales_zeros, bias, groupsize,
  in_features, out_features)` -> `PackedInt4Weight`
  (``torch.ops.aten._dyn_quant_pack_4bit_weight``).
* `dyn_quant_matmul_4bit(input, packed, groupsize, in_features,
  out_features)` (``torch.ops.aten._dyn_quant_matmul_4bit``): int8 dynamic
  activation quantization, int4 weights (W4A8 semantics).
* `int4_matmul(x, packed, *, compute_dtype=None)`: weight-only (W4A16 /
  W4A32), no activation quantization, more accurate.
* `engine` (flag ``quantized_engine``): "auto" (Pallas on GPU, the C++/XLA
  kernels on CPU), "pallas" (the Pallas kernels only; interpreted on CPU, for
  testing; a call they cannot run raises NotImplementedError rather than
  fall back), "xla" (XLA-compiled paths only: the C++ FFI kernel on CPU when
  built, else pure XLA). The platform part is decided **per lowering
  platform** (`jax.lax.platform_dependent`), so ``jax.export(...,
  platforms=["cuda"])`` from a CPU host carries the Pallas (Triton) kernel.
* `explain(x, packed, op=..., platform=...)`: which implementation would run
  and why not the others (the registry: ``docs/architecture.md``).

Example:
  >>> import jax, jax.numpy as jnp, jbackends as jb
  >>> w = jax.random.normal(jax.random.key(0), (64, 128))
  >>> q, s = jb.quantized.quantize_4bit(w, 32)
  >>> p = jb.quantized.dyn_quant_pack_4bit_weight(q, s, None, 32, 128, 64)
  >>> x = jnp.ones((2, 3, 128))
  >>> jb.quantized.dyn_quant_matmul_4bit(x, p, 32, 128, 64).shape
  (2, 3, 64)
  >>> jb.quantized.int4_matmul(x, p).shape
  (2, 3, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import sys as _sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jbackends._src import dispatch as _dispatch
from jbackends._src import int4_args as _args
from jbackends._src import int4_registry as _registry
from jbackends._src import mirror as _mirror
from jbackends._src.flag_state import current_flags as _current_flags
from jbackends._src.flag_state import trace_flags as _trace_flags
from jbackends._src import verbose as _verbose
from pallas_kernels import partition as _partition
from pallas_kernels.int4_matmul import base as _base
from pallas_kernels.int4_matmul.base import PackedInt4Weight as PackedInt4Weight

__all__ = [
    "PackedInt4Weight",
    "quantize_4bit",
    "dequantize_4bit",
    "dyn_quant_pack_4bit_weight",
    "dyn_quant_matmul_4bit",
    "int4_matmul",
    "supported_engines",
    "explain",
    "Explanation",
    "IMPLEMENTATIONS",
]

#: Implementations a call can be pinned to with ``implementation=``.
IMPLEMENTATIONS = _args.IMPLEMENTATIONS  # ("pallas", "pallas_interpret", "cpp", "xla", "reference")

#: Lowering platforms given their own branch; any other gets the default one.
_GPU = _dispatch.GPU_LOWERING


class _EngineList(list):
    """A list, as torch's ``torch.backends.quantized.supported_engines`` is; calling it returns a copy
    (this package's first API was a function)."""

    def __call__(self) -> list[str]:
        return list(self)


#: The values ``quantized_engine`` / ``jb.quantized.engine`` accept, a list like torch's.
supported_engines = _EngineList(["auto", "pallas", "xla"])


def quantize_4bit(weight: Any, groupsize: int) -> tuple[jax.Array, jax.Array]:
    """Symmetric int4 quantization of ``weight[N, K]`` in groups of ``groupsize`` along K.

    ``scale = max|w_group| / 7``, ``q = round_half_up(w / scale)`` stored as
    ``q + 8``, two per byte, the low nibble the even k.

    Args:
      weight: float ``[out_features, in_features]``.
      groupsize: a multiple of 32 dividing in_features, or in_features.

    Returns:
      ``(uint8 [N, K/2], float32 scales [N, K/groupsize])``.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> q, s = jb.quantized.quantize_4bit(jnp.ones((4, 64)), 64)
      >>> q.shape, s.shape, int(q[0, 0])
      ((4, 32), (4, 1), 255)
    """
    weight = jnp.asarray(weight)
    if weight.ndim == 2:
        _base.check_groupsize(groupsize, weight.shape[1])
    return _quantize_jit(weight, int(groupsize))


_quantize_jit = jax.jit(_base.quantize_4bit, static_argnums=1)


def dequantize_4bit(packed: PackedInt4Weight) -> jax.Array:
    """The float32 ``[N, K]`` weight a `PackedInt4Weight` stands for.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> q, s = jb.quantized.quantize_4bit(jnp.full((2, 32), 0.5), 32)
      >>> p = jb.quantized.dyn_quant_pack_4bit_weight(q, s, None, 32, 32, 2)
      >>> float(jb.quantized.dequantize_4bit(p)[0, 0])
      0.5
    """
    _base.check_packed(packed)
    return _base.dequantize(packed.weight, packed.scales, packed.groupsize)


def dyn_quant_pack_4bit_weight(
    weights: Any, scales_zeros: Any, bias: Any, groupsize: int, in_features: int, out_features: int
) -> PackedInt4Weight:
    """Packs int4 weights, scales and an optional bias (``torch.ops.aten._dyn_quant_pack_4bit_weight``).

    Unlike torch's x86 fallback (which stores every byte as a float32), the
    result is truly packed: the uint8 nibbles, float32 scales and bias.

    Args:
      weights: uint8 nibbles ``[out_features, in_features // 2]`` (or any
        shape with that many bytes in that order, e.g. torch's
        ``[N, K / groupsize, groupsize / 2]``), as from `quantize_4bit`.
      scales_zeros: scales ``[out_features, in_features // groupsize]``,
        float32 or bfloat16 (torch: float32 channel-wise, bfloat16
        group-wise); there are no zero points.
      bias: float ``[out_features]`` or None.
      groupsize: a multiple of 32 dividing in_features, or in_features.
      in_features: K.
      out_features: N.

    Returns:
      A `PackedInt4Weight` pytree.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> q, s = jb.quantized.quantize_4bit(jnp.ones((8, 64)), 32)
      >>> p = jb.quantized.dyn_quant_pack_4bit_weight(q, s, jnp.zeros(8), 32, 64, 8)
      >>> p.nbytes  # 8*32 nibble bytes + 8*2 scales * 4 + 8 bias * 4
      352
    """
    return _args.pack_checked(weights, scales_zeros, bias, groupsize, in_features, out_features)


# ------------------------------------------------------------------- dispatch
#
# The implementations and their order per lowering platform live in `_src/int4_registry.py`; the
# choice is the shared dispatcher's (`_src/dispatch.py`), filtered by the quantized_engine flag.

_LOWERING = ("cpu",) + _GPU + ("other",)


def _choose(engine: str, call: _base.Int4Call, platform: str) -> _dispatch.Choice:
    return _dispatch.choose(
        "int4",
        _registry.implementations(platform),
        call,
        platform,
        excluded=_registry.engine_filter(engine, platform),
    )


def _plan(op: str, x: jax.Array, packed: PackedInt4Weight, call: _base.Int4Call) -> tuple:
    """Chooses per lowering platform (cpu, cuda, rocm, other): ``(default, branches)``, the
    implementation that serves every platform without a branch of its own and ``((platform,
    implementation), ...)`` for the others (combined by :func:`_compiled_op`).

    Raises NotImplementedError when no implementation the ``quantized_engine`` flag allows can run the
    call on the default backend's platform (only possible under ``quantized_engine='pallas'``, which
    never falls back). Another platform with none gets no branch of its own: it lowers the default's.
    """
    flags = _trace_flags()
    here = _dispatch.default_platform()
    branches, chosen_all, rejected = {}, [], {}
    for platform in _LOWERING:
        choice = _choose(flags.quantized_engine, call, platform)
        rejected.update({f"{k}@{platform}": v for k, v in choice.reasons.items()})
        if choice.chosen is None:
            if platform == here or (platform == "other" and here not in _LOWERING):
                raise NotImplementedError(_nothing_runs(op, flags.quantized_engine, choice))
            continue
        chosen_all.append(f"{choice.chosen.name}@{platform}")
        branches[platform] = choice.chosen
    _verbose.report_dispatch(
        op,
        ",".join(chosen_all),
        rejected,
        (tuple(x.shape), tuple(packed.weight.shape)),
        (str(x.dtype), "uint4"),
    )
    default = branches.pop("other", None) or branches.pop(here)
    return default, tuple(sorted(branches.items()))


def _run(op: str, x: jax.Array, packed: PackedInt4Weight, implementation: str | None, options: dict):
    """Chooses (unless ``implementation`` pins one) and runs ``op`` through :func:`_compiled_op`."""
    if implementation is not None:
        default, branches = _registry.BY_NAME[implementation], ()
    else:
        kind = "dyn_quant" if op == "dyn_quant_matmul_4bit" else "weight_only"
        default, branches = _plan(op, x, packed, _base.Int4Call.of(kind, x, packed))
    return _compiled_op(x, packed, default, branches, tuple(sorted(options.items())))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _compiled_op(x, packed, default, branches, options):
    """``default`` / ``branches`` (one implementation per lowering platform) run with ``options``,
    each engine's gradient replaced by the straight-through one, rows and features kept sharded.

    One ``jax.jit`` (the choice is made outside it, so a ranker or the flags apply at every call and
    verbose logs every decision): under a trace a nested jit XLA inlines; called eagerly it compiles
    once per shape, dtype and choice, where eager JAX would rebuild the ``platform_dependent`` and the
    row split at every call and compile them again (~0.2-1 s per call at any size).
    """
    opts = dict(options)

    def run(impl):
        return lambda a, p: impl.run(a, p, **opts)

    def fwd(a, p):
        return _dispatch.by_platform({pl: run(impl) for pl, impl in branches}, run(default), a, p)

    return _straight_through_vjp(fwd, x, packed)


def _nothing_runs(op: str, engine: str, choice: _dispatch.Choice) -> str:
    why = "; ".join(f"{name}: {reason}" for name, reason in choice.reasons.items())
    return (
        f"{op}: no int4 implementation allowed by quantized_engine={engine!r} can run this call on "
        f"{choice.platform} ({why}); set quantized_engine='auto' to let another engine run it"
    )


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which int4 implementation would run a call when lowered for ``platform``, and why not the others.

    Attributes:
      op: ``"dyn_quant_matmul_4bit"`` or ``"int4_matmul"``.
      platform: the lowering platform explained.
      implementation: the name of the implementation that would run (``"pallas"``, ``"cpp"``, ``"xla"``,
        ``"pallas_interpret"``), or None where none the ``quantized_engine`` flag allows can (the call
        then raises NotImplementedError; ``reasons`` says why).
      technology: what it is built with ("" when none runs).
      reasons: implementation name -> why it does not run, for every other one on this platform.
    """

    op: str
    platform: str
    implementation: str | None
    technology: str
    reasons: Mapping[str, str]

    def __str__(self) -> str:
        runs = (
            "nothing can run it"
            if self.implementation is None
            else f"{self.implementation} ({self.technology})"
        )
        head = f"{self.op} on {self.platform}: {runs}"
        return "\n".join([head] + [f"  not {k}: {v}" for k, v in self.reasons.items()])


def explain(
    x: Any, packed: PackedInt4Weight, *, op: str = "int4_matmul", platform: str | None = None
) -> Explanation:
    """Says which implementation would run ``op`` on ``x`` and ``packed`` here (or when lowered for
    ``platform``), under the flags in force now, and why each other one would not. Nothing is computed;
    ``x`` may be a ``jax.ShapeDtypeStruct``.

    Args:
      x: the activations (array or ``jax.ShapeDtypeStruct``), ``[..., in_features]``.
      packed: from `dyn_quant_pack_4bit_weight`.
      op: ``"int4_matmul"`` (weight-only) or ``"dyn_quant_matmul_4bit"``.
      platform: ``"cpu"``, ``"cuda"``, ``"rocm"`` or another lowering platform; default: the default
        backend's.

    Example:
      >>> import jax, jax.numpy as jnp, jbackends as jb
      >>> q, s = jb.quantized.quantize_4bit(jnp.ones((64, 128)), 32)
      >>> p = jb.quantized.dyn_quant_pack_4bit_weight(q, s, None, 32, 128, 64)
      >>> jb.quantized.explain(jax.ShapeDtypeStruct((1, 128), jnp.bfloat16), p, platform="cuda").implementation
      'pallas'
    """
    call_op = _args.check_explain(x, packed, op, platform)
    plat = _dispatch.canonical_platform(platform) if platform else _dispatch.default_platform()
    choice = _choose(_current_flags().quantized_engine, _base.Int4Call.of(call_op, x, packed), plat)
    return Explanation(
        op=op,
        platform=plat,
        implementation=None if choice.chosen is None else choice.chosen.name,
        technology="" if choice.chosen is None else choice.chosen.technology,
        reasons=dict(choice.reasons),
    )


def dyn_quant_matmul_4bit(
    input: Any,
    packed: PackedInt4Weight,
    groupsize: int,
    in_features: int,
    out_features: int,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``torch.ops.aten._dyn_quant_matmul_4bit`` with torch's numerics, for any batch dims and layout.

    Each input row is quantized to int8 asymmetrically over K (KleidiAI
    qai8dx), multiplied by the int4 weight in int32 per group, the groups are
    summed in float32 in order times their scales, then ``* (1 / scale) +
    bias``. Bit-exact with torch for float32 input; bfloat16 input gives a
    bfloat16 output truncated like torch's (any groupsize here; torch's x86
    fallback takes bfloat16 channel-wise only).

    **NaN and inf** give torch's x86 answer on every engine, bit for bit:
    for float32 input torch finds a row's range with ``std::max`` /
    ``std::min``, which forget everything before a NaN, so the range comes
    from the elements after the row's last NaN (``[0, 0]`` when the NaN is
    last); for bfloat16 input torch's bfloat16 kernel keeps its running
    range over a NaN, so the range comes from its elements other than NaN
    (bfloat16 rule, any groupsize here); a NaN or infinite
    element, or one beyond the int32 range once scaled, quantizes to
    ``INT32_MIN + zero_point`` clamped (-128, or 127 when the zero point is
    negative); a row whose range holds an infinity has scale 0, so its
    output is the bias (a signed 0 without one; NaN where a group's integer
    sum times its scale overflows float32, with scales near the float32
    maximum, as in torch). The output says nothing about the NaN: check ``jnp.isfinite`` on
    the input if it may hold one.

    **Subnormal** scales and inputs (below ``finfo(float32).tiny``) count as 0
    on CPU: XLA:CPU flushes them, and the C++ kernels run on its threads;
    so do products and sums that fall below it (scales near 1e-37 can give
    a 1-ulp difference or a 0 where torch has a subnormal). torch keeps
    them, so bit-exactness holds where every value stays normal.

    **Gradients** (``jax.grad`` / ``jax.vjp``; torch has no derivative for
    this op and raises): the straight-through estimator on every engine, i.e.
    the activation quantization counts as the identity and the gradients are
    those of `int4_matmul` (``x @ dequantize(w).T + bias``) for ``input``, the
    packed scales and the bias (the nibbles get none). The exact derivative
    is 0 almost everywhere (rounding) apart from the row-range term, which is
    no useful training signal; STE is what quantization-aware training uses.
    Forward mode (``jax.jvp``) is not defined.

    Args:
      input: float32 or bfloat16 ``[..., in_features]``.
      packed: from `dyn_quant_pack_4bit_weight`.
      groupsize, in_features, out_features: must match ``packed`` (torch's
        signature; checked).
      implementation: pin one of `IMPLEMENTATIONS` instead of following the
        ``quantized_engine`` flag (tests, benchmarks).

    Returns:
      ``[..., out_features]`` in the input dtype.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> q, s = jb.quantized.quantize_4bit(jnp.eye(64), 64)
      >>> p = jb.quantized.dyn_quant_pack_4bit_weight(q, s, None, 64, 64, 64)
      >>> y = jb.quantized.dyn_quant_matmul_4bit(jnp.ones((1, 64)), p, 64, 64, 64)
      >>> round(float(y[0, 0]), 4)  # int8 activations: not exact
      1.0
    """
    _args.check_sizes(packed, groupsize, in_features, out_features)
    x = _base.check_input(input, packed)
    impl = _args.check_implementation(implementation)
    return _run("dyn_quant_matmul_4bit", x, packed, impl, dict(op="dyn_quant"))


def int4_matmul(
    x: Any, packed: PackedInt4Weight, *, compute_dtype: Any = None, implementation: str | None = None
) -> jax.Array:
    """Weight-only int4 matmul (W4A16 / W4A32): ``x @ dequantize(w).T + bias``.

    No int8 activation quantization: more accurate than `dyn_quant_matmul_4bit`.
    Float32 accumulation everywhere. (One float32 row on a CPU with
    AVX512-VNNI, or one bfloat16 row there on Intel, widened to float32,
    runs on integer dots, the row held to 24 bits relative to the
    largest ``|x|`` of each 128 inputs: float32's order of error, within
    ``2^-23 * sum over chunks of max|x| * sum |w|`` plus the sums' rounding;
    measured 3e-8 to 3e-7 of ``sum |x w|`` on Gaussian weights, up to 1.4e-6
    with heavy-tailed weights and 100x outlier channels, where XLA's float32
    dot measured up to 1e-6. Rows dominated by a few large values, or holding
    a NaN or inf, take the float32 kernel.) Differentiable in ``x`` and in the
    packed scales and bias (the backward pass is XLA on the dequantized
    weight), e.g. for LoRA-style training on a frozen int4 base.

    Limits: the dequantized weight ``scale * (q - 8)`` must be finite in
    float32 (``|scale| <= finfo(float32).max / 8``): past it the kernels that
    dequantize before multiplying (the vector C++ paths, XLA's) give inf or
    NaN where the exact product may be finite, depending on the ISA and M.
    Subnormal scales and inputs count as 0 on CPU (XLA:CPU flushes them, and
    the C++ kernels run on its threads).

    Args:
      x: ``[..., in_features]`` float32, bfloat16 or float16.
      packed: from `dyn_quant_pack_4bit_weight`.
      compute_dtype: operand dtype of the GPU MMA / large-M GEMM (default:
        x.dtype on GPU, float32 on CPU).
      implementation: pin one of `IMPLEMENTATIONS` (tests, benchmarks).

    Returns:
      ``[..., out_features]`` in x.dtype.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> q, s = jb.quantized.quantize_4bit(jnp.eye(64), 64)
      >>> p = jb.quantized.dyn_quant_pack_4bit_weight(q, s, None, 64, 64, 64)
      >>> float(jb.quantized.int4_matmul(jnp.ones((64,)), p)[3])
      1.0
    """
    _base.check_packed(packed)
    x = _base.check_input(x, packed, allowed=(jnp.float32, jnp.bfloat16, jnp.float16), name="x")
    compute_dtype = _args.check_compute_dtype(compute_dtype)
    impl = _args.check_implementation(implementation)
    return _run("int4_matmul", x, packed, impl, dict(op="weight_only", compute_dtype=compute_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight_through_vjp(fwd, x, packed):
    """``fwd(x, packed)`` with the gradients of ``x @ dequantize(w).T + bias``, whatever engine runs.

    Exact for `int4_matmul`; the straight-through estimator for `dyn_quant_matmul_4bit`.
    """
    return _split_rows_and_features(fwd, x, packed)


def _weight_only_fwd(fwd, x, packed):
    return _split_rows_and_features(fwd, x, packed), (x, packed)


def _split_rows_and_features(fwd, x, packed):
    """``fwd(x, packed)`` keeping x's rows (every leading dim) and the weight's output features as
    sharded as they arrive, with no collective (``docs/sharding.md``): each shard multiplies its rows
    by its slice of the packed weight. A sharded K is gathered (every engine needs whole rows)."""
    rows = tuple(f"r{i}" for i in range(x.ndim - 1))
    leaves = [packed.weight, packed.scales] + ([] if packed.bias is None else [packed.bias])
    factors = [rows + ("k",), ("n", "kh"), ("n", "kg")] + ([] if packed.bias is None else [("n",)])

    def local(a, w, s, *b):
        p = PackedInt4Weight(w, s, b[0] if b else None, packed.groupsize, packed.in_features, w.shape[0])
        return (fwd(a, p),)

    return _partition.sharded(
        local, in_factors=factors, out_factors=(rows + ("n",),), parallel=rows + ("n",), name="int4 matmul"
    )(x, *leaves)[0]


def _weight_only_bwd(fwd, res, g):
    """Gradients of ``x @ (q * s).T + b`` for x, scales and bias (XLA).

    On operands typed with Explicit sharding the contractions run with those axes made automatic
    (`jax.sharding.auto_axes`): the rows' and features' splits propagate as on an Auto mesh, and each
    gradient comes out sharded like its primal (the scales' gradient sums over x's sharded rows, which
    Explicit mode refuses to leave implicit)."""
    x, p = res
    leaves = [p.weight, p.scales] + ([] if p.bias is None else [p.bias])

    def grads(x, g, w, s, *b):
        q = PackedInt4Weight(w, s, b[0] if b else None, p.groupsize, p.in_features, p.out_features)
        return tuple(d for d in _weight_only_grads(x, q, g) if d is not None)

    like = [x, p.scales] + ([] if p.bias is None else [p.bias])
    got = _partition.with_auto_axes(grads, (x, g, *leaves), like)
    # Inside shard_map, a weight the same on every device gets the sum of the devices' partial
    # gradients (as JAX's autodiff of the plain product does).
    dx, ds = _partition.vma_like(got[0], x), _partition.vma_like(got[1], p.scales)
    db = _partition.vma_like(got[2], p.bias) if p.bias is not None else None
    dw = np.zeros(p.weight.shape, jax.dtypes.float0)
    return dx, PackedInt4Weight(dw, ds, db, p.groupsize, p.in_features, p.out_features)


def _weight_only_grads(x, p, g):
    """(dx, dscales, dbias or None) of ``x @ (q * s).T + b`` for the cotangent ``g``."""
    # Contractions over the leading dims as they are (no flattening), so sharded rows stay sharded.
    gf, xf = g.astype(jnp.float32), x.astype(jnp.float32)
    lead = tuple(range(x.ndim - 1))
    hi = jax.lax.Precision.HIGHEST
    w = _base.dequantize(p.weight, p.scales, p.groupsize)
    dx = jnp.einsum("...n,nk->...k", gf, w, precision=hi).astype(x.dtype)
    q = _base.unpack_nibbles(p.weight).astype(jnp.float32)
    gw = jnp.einsum("...n,...k->nk", gf, xf, precision=hi) * q  # d/d(scale * q) times q
    ds = gw.reshape(p.out_features, p.num_groups, p.groupsize).sum(-1)
    db = None if p.bias is None else gf.sum(lead)
    return dx, ds, db


_straight_through_vjp.defvjp(_weight_only_fwd, _weight_only_bwd)


_mirror.install(_sys.modules[__name__])
