"""`jb.linalg.eig` / `eigvals`: the nonsymmetric eigensolver chosen by `jb.cuda.preferred_linalg_library`.

torch's preferred_linalg_library picks cuSOLVER or MAGMA for GPU linear algebra. In JAX/XLA the only
GPU op with that choice is the nonsymmetric eigendecomposition (`lax.linalg.eig`'s `implementation`):

    preferred_linalg_library   GPU implementation                    CPU
    "default"                  None: JAX decides (cuSOLVER geev when  LAPACK (the only one)
                               available, else LAPACK on host, or
                               MAGMA per `jax_use_magma`)
    "cusolver"                 EigImplementation.CUSOLVER             LAPACK
    "magma"                    EigImplementation.MAGMA (needs MAGMA   LAPACK
                               installed, see JAX_GPU_MAGMA_PATH)

Every other JAX linear-algebra op (cholesky, qr, svd, eigh, lu, solve, ...) always uses cuSOLVER /
cuBLAS on GPU and LAPACK on CPU; the preference does not change them (documented, not pretended).
The flag is read at trace time (`trace_flags()`) and is part of the jit key.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jbackends._src import flag_state as _flag_state
from jbackends._src import verbose as _verbose
from jbackends._src.arrays import check_arraylike

_Impl = lax.linalg.EigImplementation
_GPU_IMPL = {"default": None, "cusolver": _Impl.CUSOLVER, "magma": _Impl.MAGMA}


def eig_implementation(preference: str, platform: str) -> tuple[Any, dict[str, str]]:
    """(`lax.linalg.eig` implementation, reasons) for a library preference on a platform."""
    if preference not in _GPU_IMPL:
        raise ValueError(f"preference must be one of {list(_GPU_IMPL)}, got {preference!r}")
    if platform in ("gpu", "cuda", "rocm"):
        return _GPU_IMPL[preference], {}
    if preference == "default":
        return None, {}
    return None, {preference: f"{platform} has only the LAPACK eigensolver"}


class EigResult(NamedTuple):
    """`eig`'s result, named like `jnp.linalg.eig`'s (and a plain ``(w, v)`` tuple)."""

    eigenvalues: Any
    eigenvectors: Any


def _eig(a: Any, *, vectors: bool, platform: str | None = None) -> Any:
    check_arraylike("jb.linalg.eig" if vectors else "jb.linalg.eigvals", "a", a)
    a = jnp.asarray(a) if not isinstance(a, jax.core.Tracer) else a
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"a must be a batch of square matrices [..., n, n], got shape {a.shape}")
    if not jnp.issubdtype(a.dtype, jnp.inexact):  # integers and bools, promoted as jnp.linalg.eig does
        a = a.astype(jax.dtypes.canonicalize_dtype(jnp.float64))
    pref = _flag_state.trace_flags().preferred_linalg_library
    impl, reasons = eig_implementation(pref, platform or jax.default_backend())

    def run(implementation):
        return lambda a: tuple(
            lax.linalg.eig(
                a,
                compute_left_eigenvectors=False,
                compute_right_eigenvectors=vectors,
                implementation=implementation,
            )
        )

    if platform is not None or _GPU_IMPL[pref] is None:
        fn = run(impl)
    else:  # per lowering platform: an array on the CPU of a GPU machine (or a CPU export) gets LAPACK
        gpu = run(_GPU_IMPL[pref])
        fn = lambda a: lax.platform_dependent(a, cuda=gpu, rocm=gpu, default=run(None))  # noqa: E731
    _verbose.report_dispatch(
        "linalg.eig", impl.value if impl is not None else "default", reasons, (a.shape,), (a.dtype,)
    )
    return _verbose.call("linalg.eig", fn, a)


def eig(a: Any) -> tuple[Any, Any]:
    """Eigenvalues and right eigenvectors of square matrices, like `jnp.linalg.eig`.

    The GPU solver follows `jb.cuda.preferred_linalg_library()` ("cusolver", "magma", "default").

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> w, v = jb.linalg.eig(jnp.array([[2.0, 0.0], [0.0, 3.0]]))
      >>> sorted(w.real.tolist())
      [2.0, 3.0]
    """
    w, v = _eig(a, vectors=True)
    return EigResult(w, v)


def eigvals(a: Any) -> Any:
    """Eigenvalues of square matrices, like `jnp.linalg.eigvals` (solver as in `eig`).

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> sorted(jb.linalg.eigvals(jnp.array([[2.0, 0.0], [0.0, 3.0]])).real.tolist())
      [2.0, 3.0]
    """
    (w,) = _eig(a, vectors=False)
    return w
