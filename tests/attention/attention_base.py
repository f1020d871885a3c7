"""The shared attention test base: every backend against the float32 reference, one grid.

Not collected itself (no ``Test`` prefix). Each backend's test module defines a short subclass that
sets ``impl`` (``AttentionArgs -> (out, lse)``) and the ``supports_*`` switches; combinations a backend
does not support are asserted to raise ``unsupported_error`` (the documented error).

The grid is shrunk (tiny, ragged shapes so several blocks are visited) but complete in features:
dtype {f32, bf16, f16} x causal {none, top-left, lower-right} x (T, S) with non-powers of two and
T != S both ways x head dim {32, 64, 80, 128} x GQA groups {1, 2, 4} x mask {none, bool, additive} x
dropout {0, 0.25} x window / softcap / lengths / segment ids x jit {on, off}; forward output, LSE and
``jax.vjp`` gradients w.r.t. q, k, v (and bias) with per-dtype tolerances.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import base

# dtype -> (forward atol == rtol, gradient tolerance relative to the largest reference gradient)
TOL = {
    jnp.dtype(jnp.float32): (2e-5, 5e-5),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
    jnp.dtype(jnp.float16): (3e-3, 3e-3),
}


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "float32"
    causal: str = "none"  # none | top_left | lower_right
    T: int = 37
    S: int = 37
    H: int = 32
    groups: int = 1
    mask: str = "none"  # none | bool | additive
    dropout: float = 0.0
    extra: Optional[str] = None  # window | softcap | lengths | segments
    jit: bool = True
    K: int = 2
    B: int = 2
    Hv: Optional[int] = None

    @property
    def id(self) -> str:
        parts = [
            self.dtype,
            self.causal,
            f"T{self.T}S{self.S}",
            f"H{self.H}",
            f"G{self.groups}",
            self.mask,
            f"p{self.dropout}",
            self.extra or "plain",
            "jit" if self.jit else "eager",
        ]
        return "-".join(parts)


# A covering design: every value of every axis appears, with the pairs that matter (masks x dtypes,
# causal alignments x T != S both ways, dropout x masks, extras x causal) also covered.
GRID = [
    Case("float32", "none", 37, 37, 32, 1, jit=True),
    Case("float32", "top_left", 37, 45, 64, 2, jit=False),
    Case("float32", "lower_right", 29, 45, 80, 4, jit=True, K=1),
    Case("bfloat16", "top_left", 64, 64, 128, 2, jit=True, K=1),
    Case("float16", "lower_right", 45, 29, 32, 1, jit=False),  # T > S: early rows fully masked
    Case("float32", "none", 37, 45, 32, 2, "bool", jit=True),
    Case("float32", "top_left", 37, 37, 64, 1, "additive", jit=True),
    Case("bfloat16", "none", 29, 45, 32, 4, "additive", jit=False, K=1),
    Case("float16", "top_left", 37, 45, 32, 2, "bool", jit=True),
    Case("float32", "none", 37, 45, 32, 2, dropout=0.25, jit=True),
    Case("float32", "top_left", 37, 37, 32, 1, "additive", dropout=0.25, jit=False),
    Case("bfloat16", "lower_right", 29, 45, 64, 2, dropout=0.25, jit=True),
    Case("float32", "none", 45, 45, 32, 2, extra="window", jit=True),
    Case("float32", "top_left", 37, 45, 32, 1, extra="window", jit=False),
    Case("float32", "none", 37, 45, 32, 2, extra="softcap", jit=True),
    Case("float32", "top_left", 37, 37, 32, 2, "additive", extra="softcap", jit=True),
    Case("float32", "none", 37, 45, 32, 2, extra="lengths", jit=True),
    Case("float32", "top_left", 37, 37, 32, 4, extra="segments", jit=True, K=1),
    Case("float16", "top_left", 37, 37, 80, 2, "bool", dropout=0.25, extra="lengths", jit=False),
    Case("bfloat16", "none", 48, 48, 32, 1, extra="segments", jit=True, Hv=16),
]


def rand(shape, seed=0, dtype=jnp.float32):
    """Standard normal values from numpy's generator, as a jax array of ``dtype`` (rounded from float32).

    Test inputs are made in numpy: each new shape of an eager ``jax.random.normal`` compiles (0.6-1 s
    on 2 cores, jax 0.10-0.12), and of an eager ``astype`` too (~0.1 s); summed over the suite, minutes.
    """
    return jnp.asarray(
        np.random.default_rng(seed).normal(size=shape).astype(np.float32).astype(jnp.dtype(dtype))
    )


def normal(seed, shape, dtype=jnp.float32):
    """:func:`rand` in ``jax.random.normal``'s argument order (a seed for the key)."""
    return rand(shape, seed, dtype)


def uniform(seed, shape):
    """Uniform float32 values in [0, 1) from numpy's generator (see :func:`rand`)."""
    return jnp.asarray(np.random.default_rng(seed).random(shape, dtype=np.float32))


def seeds(seed: int, n: int) -> list:
    """``n`` distinct seeds derived from ``seed``, for :func:`rand` / :func:`uniform` (the numpy
    counterpart of ``jax.random.split(jax.random.key(seed), n)``)."""
    return [int(x) for x in np.random.SeedSequence(seed).generate_state(n)]


def make_case(case: Case, seed: int = 0) -> base.AttentionArgs:
    """Random inputs for ``case`` (normal q/k/v in the case dtype) as canonical AttentionArgs."""
    dtype = jnp.dtype(case.dtype)
    rng = np.random.default_rng(seed)
    B, T, S, K, H = case.B, case.T, case.S, case.K, case.H
    N = K * case.groups
    Hv = case.Hv or H
    q = jnp.asarray(rng.normal(size=(B, T, N, H)).astype(np.float32).astype(dtype))
    k = jnp.asarray(rng.normal(size=(B, S, K, H)).astype(np.float32).astype(dtype))
    v = jnp.asarray(rng.normal(size=(B, S, K, Hv)).astype(np.float32).astype(dtype))
    kw = {}
    if case.causal == "top_left":
        kw.update(is_causal=True, diag_offset=0)
    elif case.causal == "lower_right":
        kw.update(is_causal=True, diag_offset=S - T)
    if case.mask == "bool":
        kw["mask"] = jnp.asarray(rng.random((B, 1, T, S)) > 0.3)
    elif case.mask == "additive":
        kw["bias"] = jnp.asarray(rng.normal(size=(1, N, T, S)).astype(np.float32).astype(dtype))
    if case.dropout:
        kw.update(dropout_rate=case.dropout, dropout_rng=jax.random.key(seed + 7))
    if case.extra == "window":
        kw["window"] = (6, 3)
    elif case.extra == "softcap":
        kw["logits_soft_cap"] = 2.5
    elif case.extra == "lengths":
        kw["q_seq_lengths"] = jnp.asarray([T, max(T - 11, 0)], jnp.int32)[:B]
        kw["kv_seq_lengths"] = jnp.asarray([max(S - 7, 1), S], jnp.int32)[:B]
    elif case.extra == "segments":
        qs = np.sort(rng.integers(0, 3, size=(B, T)), axis=1)
        kw["q_segment_ids"] = jnp.asarray(qs, jnp.int32)
        kw["kv_segment_ids"] = jnp.asarray(
            qs if S == T else np.sort(rng.integers(0, 3, (B, S)), 1), jnp.int32
        )
    return base.make_args(q, k, v, **kw)


def upcast(args: base.AttentionArgs) -> base.AttentionArgs:
    """The same call on float32 inputs (the reference's view)."""
    f = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    return args.replace(q=f(args.q), k=f(args.k), v=f(args.v), bias=f(args.bias))


def weighted_loss(impl, args, q, k, v, bias):
    """A scalar with non-trivial cotangents for out and the finite LSE entries."""
    out, lse = impl(args.replace(q=q, k=k, v=v, bias=bias))
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    wl = jnp.sin(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape) * 0.5
    return (out.astype(jnp.float32) * w).sum() + (jnp.where(jnp.isfinite(lse), lse, 0.0) * wl).sum()


def assert_close(actual, expected, tol, what):
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    np.testing.assert_allclose(a, e, atol=tol, rtol=tol, err_msg=what)


def vjp_of(f, primals, cotangent, *, jit: bool = True):
    """``jax.vjp(f, *primals)``'s output and its pullback of ``cotangent``, by default under one jit
    (eager, each op of a backward pass compiles on its own: seconds a call)."""

    def run(primals, cotangent):
        out, pullback = jax.vjp(f, *primals)
        return out, pullback(cotangent)

    return (jax.jit(run) if jit else run)(primals, cotangent)


def grads_of(impl, args, *, jit: bool):
    has_bias = args.bias is not None
    argnums = (0, 1, 2, 3) if has_bias else (0, 1, 2)

    def loss(q, k, v, bias):
        return weighted_loss(impl, args, q, k, v, bias)

    g = jax.grad(loss, argnums=argnums)
    if jit:
        g = jax.jit(g)
    return g(args.q, args.k, args.v, args.bias)


def outputs_and_grads(impl, args, *, jit: bool, grads: bool = True):
    """``((out, lse), grads)`` of :func:`weighted_loss` from one (optionally jitted) function."""
    has_bias = args.bias is not None

    def f(a):
        out_lse, vjp = jax.vjp(
            lambda q, k, v, bias: impl(a.replace(q=q, k=k, v=v, bias=bias)), a.q, a.k, a.v, a.bias
        )
        if not grads:
            return out_lse, ()
        out, lse = out_lse
        w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape).astype(out.dtype)
        wl = jnp.sin(jnp.arange(lse.size, dtype=jnp.float32)).reshape(lse.shape) * 0.5
        g = vjp((w, jnp.where(jnp.isfinite(lse), wl, 0.0)))
        return out_lse, g if has_bias else g[:3]

    return (jax.jit(f) if jit else f)(args)


class AttentionTestBase:
    """Subclass with ``impl`` set; flip the ``supports_*`` switches the backend lacks."""

    impl: Callable = None
    supports_bias = True
    supports_mask = True
    supports_dropout = True
    supports_softcap = True
    supports_window = True
    supports_lengths = True
    supports_segments = True
    supports_bias_grad = True
    supports_lse_grad = True
    dtypes = ("float32", "bfloat16", "float16")
    unsupported_error = (NotImplementedError, ValueError)
    #: dtype -> (forward tolerance, gradient tolerance); ``tol_scale`` multiplies both
    tolerances = TOL
    tol_scale = 1.0
    #: Which grid cases to run (all by default). A backend that shares its engine with another
    #: may run only the cases that exercise what it adds.
    grid_filter: Callable = staticmethod(lambda case: True)

    # -- helpers ----------------------------------------------------------------------------------
    def run(self, args):
        return type(self).impl(args)

    def supports(self, args: base.AttentionArgs) -> bool:
        return not (
            (args.bias is not None and not self.supports_bias)
            or (args.mask is not None and not self.supports_mask)
            or (args.has_dropout and not self.supports_dropout)
            or (args.logits_soft_cap is not None and not self.supports_softcap)
            or (args.window is not None and not self.supports_window)
            or (args.q_seq_lengths is not None and not self.supports_lengths)
            or (args.q_segment_ids is not None and not self.supports_segments)
        )

    def check(self, args, *, jit=True, grads=True):
        if not self.supports(args):
            with pytest.raises(self.unsupported_error):
                (jax.jit(self.run) if jit else self.run)(args)
            return
        atol, gtol = (t * self.tol_scale for t in self.tolerances[jnp.dtype(args.dtype)])
        # A backend whose LSE carries no gradient (cuDNN) is compared with a reference whose LSE
        # carries none either.
        no_lse_grad = lambda f: lambda a: (lambda o: (o[0], jax.lax.stop_gradient(o[1])))(f(a))  # noqa: E731
        run = self.run if self.supports_lse_grad else no_lse_grad(self.run)
        ref = lambda a: base.reference(upcast(a))  # noqa: E731
        ref = ref if self.supports_lse_grad else no_lse_grad(ref)
        # Eager cases run the forward eagerly; their gradients are then checked under jit (op-by-op
        # gradients would compile dozens of tiny executables), so every grid case checks its gradients.
        (out, lse), got = outputs_and_grads(run, args, jit=jit, grads=grads and jit)
        if grads and not jit:
            _, got = outputs_and_grads(run, args, jit=True, grads=True)
        (ref_out, ref_lse), want = outputs_and_grads(ref, args, jit=True, grads=grads)
        assert out.dtype == args.dtype and out.shape == ref_out.shape
        assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
        assert_close(out, ref_out, atol, "out")
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="lse -inf rows")
        finite = np.isfinite(np.asarray(ref_lse))
        assert_close(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], max(atol, 1e-5), "lse")
        if not grads:
            return
        names = ("dq", "dk", "dv", "dbias")
        for name, g, r in zip(names, got, want):
            if name == "dbias" and not self.supports_bias_grad:
                continue
            assert g.shape == r.shape and g.dtype == r.dtype, name
            scale = float(jnp.max(jnp.abs(r.astype(jnp.float32)))) or 1.0
            assert_close(g / scale, r / scale, gtol, name)

    # -- the grid ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
    def test_grid(self, case):
        if not type(self).grid_filter(case):
            pytest.skip("covered by the backend that shares this engine")
        if case.dtype not in self.dtypes:
            pytest.skip(f"{case.dtype} not supported by this backend")
        self.check(make_case(case), jit=case.jit)

    # -- properties every backend shares ----------------------------------------------------------
    def test_fully_masked_rows_give_zero_output_and_grads(self):
        case = Case("float32", "none", 19, 23, 32, 2, extra="lengths")
        args = make_case(case)
        args = args.replace(
            q_seq_lengths=jnp.asarray([19, 0], jnp.int32), kv_seq_lengths=jnp.asarray([0, 23], jnp.int32)
        )
        if not self.supports(args):
            pytest.skip("lengths unsupported")
        out, lse = jax.jit(self.run)(args)
        assert float(jnp.abs(out).max()) == 0.0  # every row of both batches is fully masked
        assert bool(jnp.all(jnp.isneginf(lse)))
        g = grads_of(self.run, args, jit=True)
        for x in g[:3]:
            assert float(jnp.abs(x.astype(jnp.float32)).max()) == 0.0
            assert bool(jnp.all(jnp.isfinite(x)))

    def test_deterministic(self):
        args = make_case(
            Case("float32", "top_left", 33, 33, 32, 2, dropout=0.25 if self.supports_dropout else 0.0)
        )
        a = jax.jit(self.run)(args)[0]
        b = jax.jit(self.run)(args)[0]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_vjp_wrt_outputs_and_lse(self):
        args = make_case(Case("float32", "lower_right", 21, 34, 32, 2))
        (out, lse), vjp = jax.vjp(
            lambda q, k, v: self.run(args.replace(q=q, k=k, v=v)), args.q, args.k, args.v
        )
        (_, _), vjp_ref = jax.vjp(
            lambda q, k, v: base.reference(args.replace(q=q, k=k, v=v)), args.q, args.k, args.v
        )
        rng = np.random.default_rng(3)
        ct = (
            jnp.asarray(rng.normal(size=out.shape), jnp.float32),
            jnp.asarray(rng.normal(size=lse.shape), jnp.float32)
            if self.supports_lse_grad
            else jnp.zeros(lse.shape, jnp.float32),
        )
        # The class's float32 gradient tolerance: on a GPU a float32 dot may run on TF32 tensor cores.
        gtol = self.tolerances[jnp.dtype(jnp.float32)][1] * self.tol_scale
        for g, r, name in zip(vjp(ct), vjp_ref(ct), "qkv"):
            scale = float(jnp.max(jnp.abs(r)))
            assert_close(g / scale, r / scale, gtol, f"d{name}")


class DecodeTestBase(AttentionTestBase):
    """For a kernel that serves queries of at most 16 rows (decode): the subclass parametrizes
    ``test_grid`` with grid cases shortened to such queries (fully masked rows and the LSE vjp are
    among them). The shared property tests below use longer queries, which decode refuses at choice
    time (tested in test_pallas_unsupported.py)."""

    supports_bias = False
    supports_mask = False

    def test_fully_masked_rows_give_zero_output_and_grads(self):
        pytest.skip("queries > 16 rows: not a decode shape")

    def test_deterministic(self):
        pytest.skip("queries > 16 rows: not a decode shape")

    def test_vjp_wrt_outputs_and_lse(self):
        pytest.skip("queries > 16 rows: not a decode shape")
