"""With ``JBACKENDS_REQUIRE_CPP=1`` (CI sets it) both C++ extensions must have been built and load:
without this check a compile error would only show as skipped tests."""

import os
import platform
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import ffi
from pallas_kernels.attention import base, cpp_flash
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


# ---- an extension this jaxlib cannot take: refused with a reason, never a broken CPU backend ---------

needs_flash = pytest.mark.skipif(not cpp_flash.available(), reason="the flash C++ extension is not built")


def _load_flash():
    return ffi.load_library(
        cpp_flash._MODULE,
        check="JbFlashAvailable",
        targets={cpp_flash.FORWARD_TARGET: "JbFlashFwdF32", cpp_flash.BACKWARD_TARGET: "JbFlashBwdF32"},
    )


@pytest.mark.skipif(
    not (cpp_flash.available() and cpp.available()), reason="the C++ extensions are not built"
)
def test_the_build_and_the_running_jaxlib_agree_on_the_ffi_api():
    """The version check reads the running jaxlib's header; the extensions built here against the same
    jaxlib report the same version (a header it failed to parse would switch the check off)."""
    running = ffi.framework_api_version()
    assert running is not None and running >= 1
    assert cpp_flash._library().JbFfiApiVersion() == running
    assert cpp._library().JbFfiApiVersion() == running


@needs_flash
def test_an_extension_built_for_a_newer_ffi_api_is_refused_before_registering(monkeypatch):
    """What a jaxlib downgrade after the build looks like: jaxlib 0.11 refuses handlers built against
    0.12's headers, and if its CPU backend has not started yet, that refusal fails the start of the
    backend. Nothing may be registered then; the loader warns, says why, and the fallbacks run."""
    built = cpp_flash._library().JbFfiApiVersion()
    monkeypatch.setattr(ffi, "framework_api_version", lambda: built - 1)
    monkeypatch.setattr(ffi, "_FAILURES", {})

    def register(*a, **k):
        raise AssertionError("registered a handler this jaxlib cannot take")

    monkeypatch.setattr(jax.ffi, "register_ffi_target", register)
    with pytest.warns(RuntimeWarning, match="built for XLA FFI API .* rebuild it"):
        assert _load_flash() is None
    why = ffi.load_failure(cpp_flash._MODULE)
    assert f"{built // 1000}.{built % 1000}" in why and "--force-reinstall --no-deps -e ." in why


@needs_flash
def test_a_build_without_the_version_stamp_is_refused(monkeypatch):
    """A library from before the stamp cannot be checked, so it is not registered."""
    monkeypatch.setattr(ffi, "_FAILURES", {})
    monkeypatch.setattr(ffi.ctypes, "CDLL", lambda path: types.SimpleNamespace(JbFlashAvailable=lambda: 1))
    with pytest.warns(RuntimeWarning, match="before the FFI API version stamp"):
        assert _load_flash() is None
    assert "rebuild" in ffi.load_failure(cpp_flash._MODULE)


@needs_flash
def test_a_handler_xla_refuses_gives_none_and_the_reason(monkeypatch):
    monkeypatch.setattr(ffi, "framework_api_version", lambda: None)  # no header: XLA itself refuses
    monkeypatch.setattr(ffi, "_FAILURES", {})

    def register(*a, **k):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: incompatible API version")

    monkeypatch.setattr(jax.ffi, "register_ffi_target", register)
    with pytest.warns(RuntimeWarning, match="XLA refused the handler JbFlashFwdF32"):
        assert _load_flash() is None
    assert "incompatible API version" in ffi.load_failure(cpp_flash._MODULE)


def test_explain_reasons_carry_a_refusal(monkeypatch):
    """With the extensions refused, the C++ kernels' reasons (what explain() shows) say why."""
    monkeypatch.setattr(ffi, "_FAILURES", {cpp_flash._MODULE: "refused: flash", cpp._MODULE: "refused: int4"})
    monkeypatch.setattr(cpp_flash, "_library", lambda: None)
    monkeypatch.setattr(cpp, "_library", lambda: None)
    monkeypatch.delenv(ffi.DISABLE_ENV, raising=False)
    q = jnp.zeros((1, 4, 1, 8))
    assert any("refused: flash" in r for r in cpp_flash.unsupported(base.make_args(q, q, q)))
    assert "refused: int4" in cpp.unavailable_reason()
    monkeypatch.setenv(ffi.DISABLE_ENV, "1")
    assert "JBACKENDS_NO_CPP" in cpp.unavailable_reason()
