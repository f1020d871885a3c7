"""The Pallas attention kernels lower for CUDA from this CPU-only machine (``jax.export``).

For each kernel and two configs, forward and backward are exported for ``platforms=["cuda"]``
(only the custom-call safety check for the Triton target is disabled), the module must carry the
Triton custom call (one per kernel launch, with the kernel's name and launch parameters), and each
generated Triton module must pass the MLIR verifier. Exports for ``["cpu", "cuda"]`` must carry
both paths and run on CPU. The dispatch tests go through the public API.

Every export lowers inside :func:`pallas_kernels.gpu.cuda_target` (an abstract H100), which JAX >= 0.11
needs to lower a Pallas GPU kernel on a machine with no GPU.
"""

import functools
from contextlib import nullcontext
import warnings
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jbackends as jb
from jbackends._src import attention_dispatch as D
from pallas_kernels import gpu
from pallas_kernels.attention import base, triton_decode, triton_flash, triton_flash_vjp, triton_mem_efficient

TRITON = "__gpu$xla.gpu.triton"
CHECKS = [export.DisabledSafetyCheck.custom_call(TRITON)]


def _export(f, platforms, disabled_checks=CHECKS):
    """``export.export(f, ...)`` lowered for an abstract H100 (the arguments are built outside)."""

    def run(*args):
        with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
            return export.export(f, platforms=list(platforms), disabled_checks=disabled_checks)(*args)

    return run


def _zeros(B, T, S, N, K, H, dtype=jnp.bfloat16, **kw):
    q = jnp.zeros((B, T, N, H), dtype)
    k = jnp.zeros((B, S, K, H), dtype)
    return base.make_args(q, k, k, **kw)


def _export_fwd_bwd(impl, args, platforms=("cuda",)):
    """Exports value-and-grad (w.r.t. q, k, v and bias) of ``impl``; returns (module text, #verified)."""
    argnums = (0, 1, 2, 3) if args.bias is not None else (0, 1, 2)

    def f(q, k, v, bias):
        def loss(q, k, v, bias):
            out, lse = impl(args.replace(q=q, k=k, v=v, bias=bias))
            return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

        return jax.value_and_grad(loss, argnums)(q, k, v, bias)

    from jax._src.pallas.triton import lowering  # noqa: PLC0415

    verified = []
    orig = lowering.lower_jaxpr_to_triton_module

    def verify(*a, **kw):
        result = orig(*a, **kw)
        verified.append(result.module.operation.verify())
        return result

    with mock.patch.object(lowering, "lower_jaxpr_to_triton_module", verify):
        exp = _export(jax.jit(f), platforms)(args.q, args.k, args.v, args.bias)
    assert verified and all(verified)
    return exp, exp.mlir_module(), len(verified)


FEATURES = dict(
    is_causal=True,
    diag_offset=3,
    window=(40, 0),
    logits_soft_cap=20.0,
    q_seq_lengths=jnp.array([50, 7], jnp.int32),
    kv_seq_lengths=jnp.array([53, 9], jnp.int32),
    dropout_rate=0.1,
    dropout_rng=jax.random.key(0),
)


@pytest.mark.parametrize(
    "kernel,cfg,bwd",
    [
        ("flash", triton_flash.Config(128, 64, 4, 3), triton_flash_vjp.Config(64, 64, 4, 2)),
        ("flash", triton_flash.Config(64, 32, 8, 2), triton_flash_vjp.Config(32, 128, 8, 1)),
        ("mem_efficient", triton_flash.Config(128, 128, 8, 2), triton_flash_vjp.Config(64, 32, 4, 2)),
        ("mem_efficient", triton_flash.Config(32, 64, 4, 1), triton_flash_vjp.Config(32, 32, 4, 1)),
        ("decode", triton_decode.Config(64, 4, 4, 2), triton_flash_vjp.Config(64, 64, 4, 2)),
        ("decode", triton_decode.Config(32, 0, 8, 3), triton_flash_vjp.Config(32, 64, 8, 2)),
    ],
)
def test_forward_and_backward_lower_to_triton_for_cuda(kernel, cfg, bwd):
    module = {"flash": triton_flash, "mem_efficient": triton_mem_efficient, "decode": triton_decode}[kernel]
    T = 5 if kernel == "decode" else 50
    kw = dict(FEATURES)
    if kernel == "mem_efficient":
        kw.update(bias=jnp.zeros((1, 8, T, 53), jnp.bfloat16), mask=jnp.ones((2, 1, 1, 53), bool))
    if kernel == "decode":
        kw.update(q_seq_lengths=jnp.array([5, 2], jnp.int32), diag_offset=48)
    args = _zeros(2, T, 53, 8, 2, 80, **kw)
    impl = functools.partial(module.attention, config=cfg, bwd_config=bwd)
    _, text, n = _export_fwd_bwd(impl, args)
    assert n == 2 and text.count(TRITON) == 2  # one forward, one fused backward launch
    fwd_name = {"flash": "jb_flash_fwd", "mem_efficient": "jb_mem_efficient_fwd", "decode": "jb_decode_fwd"}[
        kernel
    ]
    assert f'name = "{fwd_name}"' in text and 'name = "jb_flash_bwd"' in text
    assert f"num_warps = {cfg.num_warps} : i32" in text
    assert f"num_warps = {bwd.num_warps} : i32" in text


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_other_dtypes_and_head_dims_lower(dtype):
    args = _zeros(
        1,
        33,
        33,
        2,
        1,
        256 if dtype == jnp.float16 else 24,
        dtype=dtype,
        q_segment_ids=jnp.zeros((1, 33), jnp.int32),
    )
    impl = functools.partial(
        triton_flash.attention, config=triton_flash.Config(64, 32), allow_tf32=dtype == jnp.float32
    )
    _, text, n = _export_fwd_bwd(impl, args)
    assert n == 2 and text.count(TRITON) == 2


def test_short_queries_route_to_decode_by_default():
    args = _zeros(1, 3, 300, 4, 1, 64)
    with jb.sdpa_kernel(jb.SDPBackend.FLASH_ATTENTION):
        d = D.decide(args, jb.current_flags(), "cuda")
    assert d.implementation.name == "triton_decode"
    _, text, _ = _export_fwd_bwd(d.implementation.run, args)
    assert 'name = "jb_decode_fwd"' in text and 'name = "jb_flash_bwd"' in text


def test_cpu_and_cuda_export_carries_both_paths_and_runs_on_cpu():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 37, 4, 32)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 41, 2, 32)), jnp.float32)
    args = base.make_args(q, k, k, is_causal=True, diag_offset=4)

    def impl(a):
        return jax.lax.platform_dependent(a, cuda=triton_flash.attention, default=base.reference)

    exp, text, _ = _export_fwd_bwd(impl, args, platforms=("cpu", "cuda"))
    assert text.count(TRITON) == 2
    (val, grads) = exp.call(args.q, args.k, args.v, args.bias)
    ref_out, ref_lse = base.reference(args)
    np.testing.assert_allclose(float(val), float(ref_out.sum() + ref_lse.sum()), rtol=1e-5)


def test_lowering_for_cpu_alone_raises_clearly():
    args = _zeros(1, 20, 20, 1, 1, 16)
    with pytest.raises(ValueError, match="CUDA only.*interpret=True"):
        jax.jit(lambda a: triton_flash.attention(a, config=triton_flash.Config(16, 16))).lower(args)


def test_vmap_of_kernel_lowers():
    args = _zeros(1, 20, 20, 2, 1, 32)
    batched = jnp.zeros((3, 1, 20, 2, 32), jnp.bfloat16)
    f = jax.vmap(lambda q: triton_flash.attention(args.replace(q=q), config=triton_flash.Config(16, 16))[0])
    text = _export(jax.jit(f), ["cuda"])(batched).mlir_module()
    assert text.count(TRITON) == 1


# ---------------------------------------------------------------------------------------------
# Through the public API and the dispatch.
# ---------------------------------------------------------------------------------------------


def _export_public(export_platforms, backend, cuda_kernel="triton", **call_kw):
    """The public call exported for an abstract H100; ``cuda_kernel`` is ``flash_cuda_kernel`` ('triton'
    here: under 'auto' an sm90 target gets the Mosaic GPU kernel, see the test below)."""
    q = jnp.zeros((1, 40, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 40, 2, 64), jnp.bfloat16)

    def f(q, k, v):
        with jb.sdpa_kernel([backend]), jb.with_backends(flash_cuda_kernel=cuda_kernel):
            return jb.dot_product_attention(q, k, v, is_causal=True, **call_kw)

    # A CPU branch carries the C++ flash kernel (a custom call of this package) where it is built.
    checks = CHECKS + [export.DisabledSafetyCheck.custom_call(t) for t in _CPU_TARGETS]
    return _export(jax.jit(f), export_platforms, checks)(q, k, k).mlir_module()


_CPU_TARGETS = ("jb_flash_attention_fwd_f32", "jb_flash_attention_fwd_bf16", "jb_flash_attention_bwd_f32")


def test_public_api_cpu_export_is_portable_with_the_xla_kernel_flag():
    """flash_cpu_kernel='xla' keeps this package's custom calls out of a CPU export (no opt-in)."""
    q = jnp.zeros((1, 40, 4, 64), jnp.float32)

    def f(q):
        return jb.dot_product_attention(q, q, q, is_causal=True)

    with jb.with_backends(flash_cpu_kernel="xla"):
        text = _export(jax.jit(f), ["cpu", "cuda"])(q).mlir_module()
    assert not any(t in text for t in _CPU_TARGETS)


def test_public_api_export_for_an_sm90_target_carries_the_mosaic_gpu_kernel():
    """flash_cuda_kernel='auto': an H100 target gets the Mosaic GPU kernel (ahead of Triton's there), an
    A100 target the Triton kernel."""
    text = _export_public(["cuda"], jb.SDPBackend.FLASH_ATTENTION, cuda_kernel="auto")
    assert "custom_call @mosaic_gpu" in text and TRITON not in text
    q = jnp.zeros((1, 40, 4, 64), jnp.bfloat16)

    def f(q):
        with jb.sdpa_kernel([jb.SDPBackend.FLASH_ATTENTION]):
            return jb.dot_product_attention(q, q, q, is_causal=True)

    with gpu.cuda_target("NVIDIA A100-SXM4-80GB"):
        text = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=CHECKS)(q).mlir_module()
    assert text.count(TRITON) == 1 and "custom_call @mosaic_gpu" not in text


@pytest.mark.parametrize("platforms", [["cuda"], ["cpu", "cuda"]])
def test_public_api_export_with_explicit_platforms_carries_triton(platforms):
    text = _export_public(platforms, jb.SDPBackend.FLASH_ATTENTION, platforms=platforms)
    assert text.count(TRITON) == 1
    assert re.search(r'name = "jb_flash_fwd"', text)


@pytest.mark.parametrize("platforms", [["cuda"], ["cpu", "cuda"]])
def test_public_api_export_chooses_per_lowering_platform(platforms):
    """The issue's contract: no ``platforms=`` argument, the lowering platforms decide."""
    text = _export_public(platforms, jb.SDPBackend.FLASH_ATTENTION)
    assert text.count(TRITON) == 1
    assert re.search(r'name = "jb_flash_fwd"', text)


def test_explain_on_cuda_picks_the_pallas_kernels_with_reasons():
    q = jnp.zeros((1, 40, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 40, 2, 64), jnp.bfloat16)
    e = jb.explain(q, k, k, is_causal=True, platform="cuda")
    assert e.chosen == jb.SDPBackend.FLASH_ATTENTION
    assert e.implementation == "triton_flash"
    bias = jnp.zeros((1, 4, 40, 40), jnp.bfloat16)
    e = jb.explain(q, k, k, bias=bias, platform="cuda")
    assert e.chosen == jb.SDPBackend.EFFICIENT_ATTENTION
    assert "bias" in str(e)
    assert e.implementation == "triton_mem_efficient"


# ---------------------------------------------------------------------------------------------
# JAX >= 0.11 deprecates the Pallas Triton backend and warns at every Triton lowering: the warning
# is for kernel authors (us), and never reaches a user of our kernels.
# ---------------------------------------------------------------------------------------------

_DEPRECATED = "Pallas Triton backend is deprecated"


def _triton_deprecation_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if _DEPRECATED in str(w.message)]


def _plain_triton_kernel(params):
    from jax.experimental import pallas as pl  # noqa: PLC0415

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((16, 16), jnp.float32)
    f = lambda x: pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),  # noqa: E731
        compiler_params=params,
    )(x)
    return lambda: _export(jax.jit(f), ["cuda"])(x)


def test_jax_triton_deprecation_is_kept_from_users():
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
    from pallas_kernels import triton_backend  # noqa: PLC0415

    # Premise: on a JAX that deprecates the backend, a kernel with JAX's own params warns ...
    jax_version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    plain = _triton_deprecation_warnings(_plain_triton_kernel(plgpu.CompilerParams(num_warps=4)))
    assert bool(plain) == (jax_version >= (0, 11)), plain
    # ... and the same kernel with ours, and every kernel of this package, does not.
    assert not _triton_deprecation_warnings(_plain_triton_kernel(triton_backend.CompilerParams(num_warps=4)))
    for kernel, T in (("flash", 50), ("mem_efficient", 50), ("decode", 5)):
        module = {"flash": triton_flash, "mem_efficient": triton_mem_efficient, "decode": triton_decode}[
            kernel
        ]
        args = _zeros(1, T, 40, 2, 1, 32, is_causal=True, diag_offset=35 if kernel == "decode" else 0)
        assert not _triton_deprecation_warnings(lambda: _export_fwd_bwd(module.attention, args)), kernel


def _dot_precisions(closed):
    """The precisions of the dot_generals of a jaxpr: (inside kernel bodies (pallas_call jaxprs), around
    them)."""
    from jax.extend import core as jex_core

    found = ([], [])

    def walk(jaxpr, inside):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                found[0 if inside else 1].append(e.params["precision"])
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    sub = sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub
                    if isinstance(sub, jex_core.Jaxpr):
                        walk(sub, inside or e.primitive.name == "pallas_call")

    walk(closed.jaxpr, False)
    return found


@pytest.mark.parametrize("impl,T", [("flash", 64), ("mem_efficient", 64), ("flash", 1)])
def test_float32_kernels_use_ieee_dots_unless_tf32_is_allowed(impl, T):
    """The Triton kernels' float32 dots, forward and backward (and decode's): HIGHEST precision under
    ``allow_tf32=False`` (torch's default; what the docstrings promise), TF32 (HIGH) only when allowed.
    Pallas Triton lowers a dot without a precision (DEFAULT) to TF32 for float32: the kernels passed
    none, so float32 attention ran in TF32 on Ampere and newer GPUs whatever the flag said."""
    k = jnp.ones((1, 64, 2, 32), jnp.float32)
    q = k[:, :T]

    def loss(q, k, v):
        return jb.dot_product_attention(q, k, v, implementation=impl, platforms=("cuda",)).sum()

    # the default flags (no scope: jb's precision bridge to JAX is not in force, as for most users), and
    # a scope allowing TF32
    # (the float32 dots around the kernels, the backward's D = rowsum(dO * O) and decode's combine of
    # its splits, are HIGHEST either way)
    highest = (jax.lax.Precision.HIGHEST,) * 2
    for scope, want in ((None, highest), ({"allow_tf32": True}, (jax.lax.Precision.HIGH,) * 2)):
        with gpu.cuda_target("NVIDIA H100 80GB HBM3"), jb.with_backends(**scope) if scope else nullcontext():
            kernels, around = _dot_precisions(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k))
        assert kernels and set(kernels) == {want}, (scope, set(kernels))
        assert set(around) <= {highest}, (scope, set(around))
