"""Builds the optional C++ CPU kernels (XLA FFI) next to the Python packages.

Metadata lives in pyproject.toml. The extensions are optional: without a C++
compiler, or without jaxlib's FFI headers at build time, the install still
succeeds and the int4 matmul and flash attention fall back to their pure-XLA
implementations. With JBACKENDS_REQUIRE_CPP=1 (CI sets it) a failed build is an
error instead: a compile error must not pass as "no compiler here".
"""

import importlib.util
import os
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir():
    """The XLA FFI headers to build against: those of the jaxlib already installed in the environment
    being installed into, where there is one, else those of the importable jaxlib (the build
    requirement). pip runs this in the target environment's interpreter, with the build requirements
    on an isolated overlay whose jaxlib is the newest: built against it, the kernels would be refused
    by an older installed jaxlib (an FFI API it does not know)."""
    paths = sysconfig.get_paths()
    bases = [os.path.join(paths[key], "jaxlib") for key in ("platlib", "purelib")]
    spec = importlib.util.find_spec("jaxlib")
    if spec is not None and spec.submodule_search_locations:
        bases += list(spec.submodule_search_locations)
    for base in bases:
        inc = os.path.join(base, "include")
        if os.path.exists(os.path.join(inc, "xla", "ffi", "api", "ffi.h")):
            print(f"building the C++ kernels against the FFI headers in {inc}", file=sys.stderr)
            return inc
    return None


def _required():
    return os.environ.get("JBACKENDS_REQUIRE_CPP", "") not in ("", "0")


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing (no compiler, no headers), unless required."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any build failure is non-fatal
            if _required():
                raise
            print(f"warning: skipping the optional C++ kernels: {e}", file=sys.stderr)

    def build_extension(self, ext):
        if _required():
            ext.optional = False
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            if _required():
                raise
            print(f"warning: could not build {ext.name}: {e}", file=sys.stderr)


# Headers the kernels include: a change rebuilds them, and the sdist carries them.
_COMMON = ["csrc/common.h"]
_FLASH = _COMMON + ["csrc/flash_attention_body.h"]


def _extensions():
    if os.environ.get("JBACKENDS_NO_CPP"):
        print("JBACKENDS_NO_CPP is set: building without the C++ kernels", file=sys.stderr)
        return []
    inc = _ffi_include_dir()
    if inc is None:
        if _required():
            raise RuntimeError("JBACKENDS_REQUIRE_CPP is set but jaxlib's FFI headers were not found")
        print("warning: jaxlib FFI headers not found; building without the C++ kernels", file=sys.stderr)
        return []
    return [
        Extension(
            "pallas_kernels.int4_matmul._int4_cpu",
            sources=["csrc/int4_matmul.cc"],
            depends=_COMMON,
            include_dirs=[inc],
            language="c++",
            # -ffp-contract=off: the dyn-quant kernel is bit-exact with torch's
            # reference only without FMA contraction.
            extra_compile_args=[
                "-O3",
                "-std=c++17",
                "-ffp-contract=off",
                "-Wno-attributes",
                "-Wno-return-type",
            ],
            extra_link_args=["-lpthread"],
            optional=True,
        ),
        Extension(
            "pallas_kernels.attention._flash_cpu",
            sources=["csrc/flash_attention.cc"],
            depends=_FLASH,
            include_dirs=[inc],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type"],
            extra_link_args=["-lpthread"],
            optional=True,
        ),
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
