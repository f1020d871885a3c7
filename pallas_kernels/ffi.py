"""Loads the optional C++ CPU kernels (``csrc/*.cc``, built by ``setup.py``) and registers their
XLA FFI handlers with ``jax.ffi``.

One loader for every extension: the shared library is looked up as a module next to the package
that wraps it, opened with ``ctypes``, checked, its handlers registered as CPU custom-call targets
and its plain C functions given their ctypes signatures. ``None`` (and the XLA fallbacks) whenever
any of that is not possible: ``JBACKENDS_NO_CPP`` set, the extension not built, a library that
does not load or lacks a symbol, a CPU the kernels cannot run on, or handlers this jaxlib refuses
(an extension built against a newer jaxlib's FFI headers: a ``RuntimeWarning`` says so once, and
:func:`load_failure` keeps the reason for ``explain()``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import warnings
from typing import Mapping, Optional, Sequence

import jax

__all__ = [
    "DISABLE_ENV",
    "disabled",
    "load_library",
    "load_failure",
    "register_at_import",
    "unavailable_reason",
]

#: Set (to anything non-empty) in the environment, the C++ kernels are neither built nor loaded.
DISABLE_ENV = "JBACKENDS_NO_CPP"


def disabled() -> bool:
    """Whether the C++ kernels are switched off (``JBACKENDS_NO_CPP`` is set)."""
    return bool(os.environ.get(DISABLE_ENV))


_FAILURES: dict = {}
_API_RE = re.compile(r"^\s*#\s*define\s+XLA_FFI_API_(MAJOR|MINOR)\s+(\d+)\b", re.MULTILINE)


@functools.cache
def framework_api_version() -> Optional[int]:
    """The XLA FFI API version of the running jaxlib (``major * 1000 + minor``), read from the C API
    header it ships (the header the extensions are built against); ``None`` where it is missing."""
    try:
        path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
        with open(path) as f:
            found = dict(_API_RE.findall(f.read()))
        return int(found["MAJOR"]) * 1000 + int(found["MINOR"])
    except (AttributeError, OSError, KeyError, ValueError):
        return None


def _version_text(v: int) -> str:
    return f"{v // 1000}.{v % 1000}"


def load_failure(module: str) -> Optional[str]:
    """Why the extension ``module`` was built and loaded but cannot be used (XLA refused one of its
    FFI handlers), or ``None``."""
    _warn_pending(module)
    return _FAILURES.get(module)


def unavailable_reason(module: str, what: str, not_built: str) -> str:
    """Why ``module`` (``what``: its name in words) gave no library: switched off, refused (the
    :func:`load_failure` reason), else ``not_built``."""
    _warn_pending(module)
    if disabled():
        return f"{what} is switched off ({DISABLE_ENV} is set)"
    if (failure := _FAILURES.get(module)) is not None:
        return f"{what} is built but cannot be used: {failure}"
    return f"{what} {not_built}"


def load_library(
    module: str,
    *,
    targets: Mapping[str, str],
    check: Optional[str] = None,
    restypes: Optional[Mapping[str, object]] = None,
    argtypes: Optional[Mapping[str, Sequence[object]]] = None,
) -> Optional[ctypes.CDLL]:
    """Opens the extension ``module`` (a dotted module name) and registers its FFI handlers.

    Args:
      module: the extension's module name, e.g. ``"pallas_kernels.int4_matmul._int4_cpu"``.
      targets: custom-call target name -> the exported handler symbol
        (``XLA_FFI_DEFINE_HANDLER_SYMBOL``), each registered for ``platform="cpu"``.
      check: an exported ``int f(void)`` that returns 0 when this CPU cannot run the kernels;
        then nothing is registered and the result is ``None``.
      restypes, argtypes: ctypes ``restype`` / ``argtypes`` of exported C functions.

    Returns:
      The library, or ``None`` when the kernels are disabled, not built, do not load or are refused
      by XLA (:func:`load_failure` says why; a ``RuntimeWarning`` too). Callers cache it
      (``functools.cache``): registering a target twice is not needed.
    """
    if disabled():
        return None
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        if check is not None and not getattr(lib, check)():
            return None
        lib_name = os.path.basename(spec.origin)
        if not hasattr(lib, "JbFfiApiVersion"):
            return _refuse(module, f"{lib_name} is a build from before the FFI API version stamp")
        built, running = lib.JbFfiApiVersion(), framework_api_version()
        if running is not None and (built // 1000 != running // 1000 or built > running):
            return _refuse(
                module,
                f"{lib_name} was built for XLA FFI API {_version_text(built)} and this jaxlib "
                f"({jax.lib.__version__}) runs {_version_text(running)}",
            )
        # XLA checks the version again on registration. It raises here only once the CPU backend has
        # started; before that it defers the check to the backend's start (which then fails), hence
        # the comparison above. An extension older than the oldest API a jaxlib takes is the one
        # case left to that deferred check: the headers do not say which API is the oldest.
        for target, symbol in targets.items():
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            try:
                jax.ffi.register_ffi_target(target, capsule, platform="cpu")
            except RuntimeError as e:  # jax.errors.JaxRuntimeError
                return _refuse(module, f"XLA refused the handler {symbol} of {lib_name} ({e})")
        for name, restype in (restypes or {}).items():
            getattr(lib, name).restype = restype
        for name, types in (argtypes or {}).items():
            getattr(lib, name).argtypes = list(types)
    except (OSError, AttributeError):
        return None
    return lib


_QUIET = [False]  # register_at_import: a refusal's warning waits for the kernels' first use
_PENDING: set = set()


def _refuse(module: str, why: str) -> None:
    _FAILURES[module] = (
        f"{why}; rebuild it against this jaxlib (pip install --force-reinstall --no-deps -e . in this "
        "environment: the build takes the installed jaxlib's FFI headers)"
    )
    if _QUIET[0]:
        _PENDING.add(module)
    else:
        warnings.warn(
            f"jbackends: {_FAILURES[module]}. The XLA fallbacks run instead.", RuntimeWarning, stacklevel=3
        )
    return None


def _warn_pending(module: str) -> None:
    if module in _PENDING:
        _PENDING.discard(module)
        warnings.warn(
            f"jbackends: {_FAILURES[module]}. The XLA fallbacks run instead.", RuntimeWarning, stacklevel=4
        )


def register_at_import(loader) -> None:
    """Calls ``loader()`` (a cached `load_library` wrapper) at a module's import, so that its FFI
    targets are registered (a deserialized export carrying them runs after ``import jbackends``)
    without a word at import: a refusal warns when the kernels are first asked for (their
    ``unavailable_reason`` / :func:`load_failure`), as it did when loading waited for that use."""
    _QUIET[0] = True
    try:
        loader()
    finally:
        _QUIET[0] = False


def xla_pool_setter(library, symbol: str):
    """``set_xla_pool(on=True)`` for the kernels of ``library()`` (a cached loader returning the
    CDLL or None): ``symbol`` is their exported ``void (int on)`` switch."""

    def set_xla_pool(on: bool = True) -> None:
        """Whether the kernels run their threads on XLA's intra-op thread pool (``True``, the
        default) or start threads of their own on every call (``False``: what they do where a
        runtime offers no pool). For tests and benchmarks; read when a kernel runs."""
        lib = library()
        if lib is not None:
            getattr(lib, symbol)(1 if on else 0)

    return set_xla_pool
