"""The cuDNN bridge's reasons, as dispatch sees them from a CPU-only machine. The bridge itself runs on
the shared grid in the GPU lane (`test_gpu_lane.py`, a grid that reaches cuDNN's envelope)."""

import jax.numpy as jnp

from pallas_kernels.attention import base, cudnn
from tests.attention.attention_base import Case, make_case


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
