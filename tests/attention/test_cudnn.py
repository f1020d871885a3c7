"""The cuDNN bridge on the shared grid (needs a CUDA GPU; skipped on CPU), and its CPU-side reasons."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention import base, cudnn
from tests.attention.attention_base import AttentionTestBase, Case, make_case

_HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


@pytest.mark.skipif(not _HAS_GPU, reason="cuDNN attention needs a CUDA GPU")
class TestCudnn(AttentionTestBase):
    impl = staticmethod(cudnn.attention)
    dtypes = ("bfloat16", "float16")
    supports_lse_grad = False  # cuDNN's softmax statistic carries no gradient

    def supports(self, args):  # every constraint, as dispatch sees it
        return not cudnn.unsupported(args, "cuda")


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
