"""The runnable examples in the docstrings of the backend modules."""

import doctest
import importlib

import pytest

import jbackends as jb

MODULES = [
    "jbackends.cpu",
    "jbackends.mps",
    "jbackends.nnpack",
    "jbackends.openmp",
    "jbackends.cusparselt",
    "jbackends.kleidiai",
    "jbackends.xnnpack",
    "jbackends.miopen",
    "jbackends.mkl",
    "jbackends.mkldnn",
    "jbackends.fft",
    "jbackends.linalg",
    "jbackends.conv",
    "jbackends.nn",
    "jbackends.mha",
    "jbackends.opt_einsum",
    "jbackends.cuda",
    "jbackends.cudnn",
    "jbackends._src.einsum",
    "jbackends._src.fft",
    "jbackends._src.linalg",
    "jbackends._src.conv",
    "jbackends._src.verbose",
    "jbackends._src.nn_attention",
    "jbackends.xeon.run_cpu",
    "pallas_kernels.attention.mosaic_flash",
]


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    module = importlib.import_module(name)
    try:
        result = doctest.testmod(module, extraglobs={"jb": jb}, optionflags=doctest.ELLIPSIS)
    finally:
        jb.cuda.cufft_plan_cache.clear()
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
