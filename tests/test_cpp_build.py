"""With ``JBACKENDS_REQUIRE_CPP=1`` (CI sets it) both C++ extensions must have been built and load:
without this check a compile error would only show as skipped tests."""

import os
import platform

import pytest

from pallas_kernels.attention import cpp_flash
from pallas_kernels.int4_matmul import cpp

REQUIRED = os.environ.get("JBACKENDS_REQUIRE_CPP", "") not in ("", "0")


@pytest.mark.skipif(not REQUIRED, reason="JBACKENDS_REQUIRE_CPP is not set (the kernels are optional)")
def test_cpp_kernels_were_built_and_load():
    assert cpp.available(), "the int4 C++ extension did not build or load"
    assert cpp.isa() in ("avx512vnni", "avx512bw", "avx2", "scalar"), cpp.isa()
    if platform.machine().lower() in ("x86_64", "amd64"):
        # the flash kernels load only on CPUs with AVX2 + FMA (every CPU CI runs on)
        assert cpp_flash.available(), "the flash C++ extension did not build or load"
        assert cpp_flash.isa() in cpp_flash.ISAS, cpp_flash.isa()
