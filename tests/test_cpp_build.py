"""With ``JBACKENDS_REQUIRE_CPP=1`` (CI sets it) both C++ extensions must have been built and load:
without this check a compile error would only show as skipped tests."""

import os
import platform
import types
import warnings

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
def test_a_refusal_at_import_warns_at_first_use_not_at_import(monkeypatch):
    """`import jbackends` registers the kernels: a stale build's refusal must not warn there (a
    ``-W error`` run would fail to import), but once, where the kernels are first asked for."""
    built = cpp_flash._library().JbFfiApiVersion()
    monkeypatch.setattr(ffi, "framework_api_version", lambda: built - 1)
    monkeypatch.setattr(ffi, "_FAILURES", {})
    monkeypatch.setattr(ffi, "_PENDING", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ffi.register_at_import(_load_flash)
    with pytest.warns(RuntimeWarning, match="built for XLA FFI API .* rebuild it"):
        why = ffi.unavailable_reason(cpp_flash._MODULE, "the flash kernel", "is not built")
    assert "rebuild" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert "rebuild" in ffi.load_failure(cpp_flash._MODULE)


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


# ---- a serialized CPU export carrying the kernels runs in a fresh process after `import jbackends` ----

_FRESH = r"""
import sys
import numpy as np
import jax
import jbackends  # registers the kernels' FFI targets; nothing else of ours is imported here

data = np.load(sys.argv[1])
for name in ("attention", "int4"):
    exp = jax.export.deserialize(bytearray(open(sys.argv[1] + "." + name, "rb").read()))
    # the arguments rebuilt from the export's own tree (the int4 one holds a PackedInt4Weight)
    args, kwargs = jax.tree.unflatten(exp.in_tree, [data[f"{name}_in{i}"] for i in range(len(exp.in_avals))])
    got = exp.call(*args, **kwargs)
    for i, g in enumerate(jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), data[f"{name}_out{i}"])
print("ok")
"""


@pytest.mark.skipif(not (cpp.available() and cpp_flash.available()), reason="the C++ kernels are not built")
def test_a_serialized_cpu_export_with_the_kernels_runs_in_a_fresh_process(tmp_path):
    """The kernels are registered when `jbackends` is imported (not when a call first needs them):
    an exported forward + gradient of the default CPU FLASH path and an int4 matmul, serialized,
    run in a new process that only imported jbackends, with the live call's exact numbers."""
    pytest.importorskip("flatbuffers")  # jax.export's serialization format
    import subprocess
    import sys

    import numpy as np

    import jbackends as jb

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 40, 4, 32)), jnp.float32) for _ in range(3))

    def attention(q, k, v):
        loss = lambda q, k, v: jb.dot_product_attention(q, k, v, is_causal=True).sum()
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((128, 48)), jnp.float32)
    Q = jb.quantized
    q4, s4 = Q.quantize_4bit(w.T, 32)
    packed = Q.dyn_quant_pack_4bit_weight(q4, s4, jnp.arange(48.0), 32, 128, 48)

    def int4(x, p):  # a packed weight as an export argument (registered for serialization)
        return Q.int4_matmul(x, p), Q.dyn_quant_matmul_4bit(x, p, 32, 128, 48)

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (*cpp_flash.TARGETS, *cpp.TARGETS)]
    data = {}
    for name, fn, args in (("attention", attention, (q, k, v)), ("int4", int4, (x, packed))):
        exp = jax.export.export(jax.jit(fn), platforms=["cpu"], disabled_checks=checks)(*args)
        text = exp.mlir_module()
        assert ("jb_flash_attention" if name == "attention" else "jb_int4") in text, "no kernel exported"
        (tmp_path / f"data.npz.{name}").write_bytes(exp.serialize())
        data.update({f"{name}_in{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(args))})
        data.update(
            {f"{name}_out{i}": np.asarray(o, np.float32) for i, o in enumerate(jax.tree.leaves(fn(*args)))}
        )
    np.savez(tmp_path / "data.npz", **data)
    res = subprocess.run(
        [sys.executable, "-c", _FRESH, str(tmp_path / "data.npz")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
