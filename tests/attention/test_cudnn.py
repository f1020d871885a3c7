"""The cuDNN bridge's reasons, as dispatch sees them from a CPU-only machine. The bridge itself runs on
the shared grid in the GPU lane (`test_gpu_lane.py`, a grid that reaches cuDNN's envelope)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbackends as jb
from pallas_kernels.attention import base, cudnn
from tests.attention.attention_base import Case, make_case, normal, seeds


def test_never_runs_on_cpu_and_says_why():
    args = make_case(Case("float32", "none", 16, 16, 32, 1, dropout=0.25, extra="softcap"))
    reasons = cudnn.unsupported(args, "cpu")
    assert any("only on NVIDIA GPUs" in r for r in reasons)
    assert any("float16/bfloat16" in r for r in reasons)
    assert any("dropout" in r for r in reasons)
    assert any("soft cap" in r for r in reasons)
    x = jnp.ones((1, 16, 2, 68), jnp.bfloat16)
    assert any("multiple of 8" in r for r in cudnn.unsupported(base.make_args(x, x, x), "cuda"))
    y = jnp.ones((1, 16, 2, 192), jnp.bfloat16)
    assert cudnn.unsupported(base.make_args(y, y, y), "cuda", compute_capability=9.0) == []
    assert any(
        "<= 128" in r for r in cudnn.unsupported(base.make_args(y, y, y), "cuda", compute_capability=8.0)
    )


@pytest.mark.parametrize(
    "T, S, causal, window, bias_shape, kv_lengths",
    [
        (37, 37, False, None, None, None),
        (37, 37, True, None, None, None),
        (37, 37, False, (5, 0), None, None),
        (1, 63, False, None, None, None),
        (1, 64, False, None, (1, 4, 1, 64), None),
        (36, 37, False, None, (2, 4, 36, 37), None),
        (37, 37, True, None, (1, 4, 37, 37), None),
        (37, 37, False, None, (2, 1, 1, 37), None),
        (38, 37, False, None, (2, 4, 38, 37), [20, 30]),
    ],
)
def test_odd_lengths_train_on_padded_inputs(T, S, causal, window, bias_shape, kv_lengths):
    """JAX's cuDNN training path refuses odd T or S, so the bridge differentiates a call padded to even
    lengths (the extra key masked by causality or by the key lengths): its outputs and gradients are the
    unpadded call's, checked with jax.nn's XLA path standing in for cuDNN."""
    ks = seeds(T + 100 * S, 5)
    q = normal(ks[0], (2, T, 4, 16))
    k, v = (normal(x, (2, S, 2, 16)) for x in ks[1:3])
    bias = None if bias_shape is None else normal(ks[3], bias_shape)
    kv_len = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)
    args = base.make_args(q, k, v, bias=bias, is_causal=causal, kv_seq_lengths=kv_len)
    if window is not None:
        args = args.replace(window=window)
    call = cudnn._jax_nn_call(args, implementation="xla")  # the bridge's call, XLA in cuDNN's place
    padded = cudnn._even_lengths(call, args)
    assert padded is not call
    ct = normal(ks[4], (2, T, 4, 16))

    def grads(f):
        (out, lse), vjp = jax.vjp(lambda q, k, v, b: f(q, k, v, b, None, kv_len), q, k, v, bias)
        return (out, lse) + tuple(g for g in vjp((ct, jnp.ones_like(lse))) if g is not None)

    with jax.default_matmul_precision("highest"):
        want, got = jax.jit(lambda: (grads(call), grads(padded)))()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5, err_msg=name)
    x = jnp.ones((1, 64, 2, 16))
    assert cudnn._even_lengths(call, base.make_args(x, x, x)) is call  # even lengths: unchanged
    if kv_lengths is not None and not causal and window is None and S % 2:
        # Traced lengths are not range-checked: one past S must not reach the padded key.
        over = jnp.asarray([S + 3, S], jnp.int32)
        got = jax.jit(lambda: padded(q, k, v, bias, None, over))()
        want = jax.jit(lambda: call(q, k, v, bias, None, over))()
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5, rtol=2e-5)


def test_bias_broadcast_over_queries_or_keys_is_refused_with_its_reason():
    """jax's cuDNN path checks that the bias spans T and S (its layout check), forward included."""
    x = jnp.ones((2, 16, 2, 64), jnp.bfloat16)
    for shape in [(2, 2, 1, 16), (1, 1, 16, 1), (2, 1, 1, 16)]:
        args = base.make_args(x, x, x, bias=jnp.zeros(shape, jnp.bfloat16))
        assert any("over every query and key" in r for r in cudnn.unsupported(args, "cuda")), shape
    full = base.make_args(x, x, x, bias=jnp.zeros((1, 1, 16, 16), jnp.bfloat16))
    assert cudnn.unsupported(full, "cuda", compute_capability=9.0) == []


def test_a_forced_cudnn_that_cannot_lower_names_the_right_reason():
    """The reason a lowering cannot hold cuDNN comes after the flags' and the call's own reasons."""
    from pallas_kernels import gpu

    error = jb.attention.NoAvailableBackendError
    x = jnp.ones((1, 64, 2, 64), jnp.bfloat16)

    def trace(x, **kw):
        return jax.jit(lambda x: jb.dot_product_attention(x, x, x, platforms=("cuda",), **kw)).trace(x)

    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        with pytest.raises(error, match="float16/bfloat16") as e:
            trace(x.astype(jnp.float32), implementation="cudnn")
        assert "cannot lower" not in str(e.value)
        only_cudnn = jb.attention.sdpa_kernel([jb.SDPBackend.CUDNN_ATTENTION])
        with only_cudnn, jb.with_backends(cudnn_enabled=False), pytest.raises(error) as e:
            trace(x)
        assert "in priority order:\n  (none)" in str(e.value) and "cannot lower" not in str(e.value)
        if cudnn.runtime_unavailable() is not None:  # this machine: no cuDNN runtime
            with pytest.raises(error, match="cannot lower cuDNN attention on this machine"):
                trace(x, implementation="cudnn")


@pytest.fixture
def cudnn_runtime_described(monkeypatch):
    """JAX's cuDNN attention checks the local cuDNN at trace time; describe a cuDNN 9.10 on an sm90
    device (as an H100 host would) so that its custom calls lower here, for CUDA."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_compute_capability", lambda c: tuple(map(int, c.split("."))) <= (9, 0))
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: c == "9.0")


@pytest.mark.parametrize(
    "T, S, causal, bias",
    [
        (1025, 1025, False, False),
        (65, 65, True, True),
        (1, 4097, False, False),
        (1, 64, False, True),
        (64, 63, False, True),
        (64, 64, False, True),
    ],
)
def test_odd_length_gradients_lower_to_cudnns_backward(cudnn_runtime_described, T, S, causal, bias):
    """Lowered for CUDA, the gradient of an odd-length call is cuDNN's backward (JAX's own cuDNN
    training path raises "Unsupported sequence length" there)."""
    from jax import export

    from pallas_kernels import gpu

    q = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, S, 2, 64), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1, 4, T, S), jnp.bfloat16) if bias else None

    def loss(q, k, v, b):
        out, _ = cudnn.attention(base.make_args(q, k, v, bias=b, is_causal=causal))
        return jnp.sum(out.astype(jnp.float32))

    names = ["__cudnn$fmha" + a + "Softmax" + c for a in ("", "ScaleBias") for c in ("", "Backward")]
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in names]
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        exp = export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"], disabled_checks=checks)
        text = exp(q, k, k, b).mlir_module()
    if T % 2 or S % 2:
        with gpu.cuda_target("NVIDIA H100 80GB HBM3"), pytest.raises(NotImplementedError, match="sequence"):
            jax.jit(
                jax.grad(
                    lambda q, k, v: jnp.sum(
                        jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
                    ).astype(jnp.float32)
                )
            ).trace(q, k, k)  # JAX alone (the reason for the padding)
    assert re.search(r"custom_call @__cudnn\$fmha(ScaleBias)?SoftmaxBackward", text), text[:2000]
    assert len(re.findall(r"custom_call @__cudnn\$fmha(?:ScaleBias)?Softmax\(", text)) == 1  # one forward


def _cuda_export(f, platforms, *args):
    from jax import export

    from pallas_kernels import gpu

    names = ["__gpu$xla.gpu.triton"]
    names += ["__cudnn$fmha" + a + "Softmax" + c for a in ("", "ScaleBias") for c in ("", "Backward")]
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in names]
    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        text = export.export(jax.jit(f), platforms=platforms, disabled_checks=checks)(*args).mlir_module()
    return set(re.findall(r"custom_call @([\w$.]+)", text))


_Q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)


def _gpu_kernel(calls) -> bool:
    return any("mosaic_gpu" in c or "triton" in c for c in calls)


@pytest.mark.skipif(cudnn.runtime_unavailable() is None, reason="this machine has a cuDNN runtime")
def test_cuda_export_without_a_cudnn_runtime_carries_the_next_kernel():
    """explain() describes a GPU machine (cuDNN first), but JAX cannot trace its cuDNN attention here: the
    CUDA export carries the next backend's GPU kernel, not the XLA path (it once dropped the branch)."""
    from pallas_kernels import gpu

    with gpu.cuda_target("NVIDIA H100 80GB HBM3"):
        assert jb.explain(_Q, _Q, _Q, platform="cuda", is_causal=True).chosen == jb.SDPBackend.CUDNN_ATTENTION

    def loss(q, k, v):
        return jnp.sum(jb.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))

    for f in (lambda q, k, v: jb.dot_product_attention(q, k, v, is_causal=True), jax.grad(loss, (0, 1, 2))):
        calls = _cuda_export(f, ["cuda"], _Q, _Q, _Q)
        assert _gpu_kernel(calls) and not any("cudnn" in c for c in calls), calls


def test_call_for_cpu_and_cuda_keeps_cudnn_out_and_lowers_for_both(cudnn_runtime_described):
    """JAX's cuDNN primitives lower for CUDA only: a call given platforms=("cpu", "cuda") runs the next
    backend on CUDA, and its export for both platforms lowers (with cuDNN it raised)."""

    def f(q, k, v):
        return jb.dot_product_attention(q, k, v, is_causal=True, platforms=("cpu", "cuda"))

    with jb.with_backends(flash_cpu_kernel="xla"):  # a portable CPU branch
        calls = _cuda_export(f, ["cpu", "cuda"], _Q, _Q, _Q)
        assert _gpu_kernel(calls) and not any("cudnn" in c for c in calls), calls

        # A CUDA-only call keeps cuDNN (the runtime described here).
        def g(q, k, v):
            return jb.dot_product_attention(q, k, v, is_causal=True, platforms=("cuda",))

        assert "__cudnn$fmhaSoftmax" in _cuda_export(g, ["cuda"], _Q, _Q, _Q)
