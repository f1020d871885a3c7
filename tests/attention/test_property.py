"""Property test: random calls through both public APIs, every enabled CPU backend
against the math reference (float32 upcast, highest precision), forward and gradients.

Hypothesis draws shapes (batch, T, S, heads, GQA groups, head dims), dtypes, masks (bool, float,
broadcast over batch / heads / queries), causal (top-left, lower-right, with T != S), windows,
lengths, segment ids, soft cap and dropout; the backend and the API are drawn too. The reference is
:func:`base.reference` with jax.nn's rule for rows without a key (the jax.nn API) or torch's zeros
(the torch API), written out here independently of ``jbackends.attention``.

The call *structures* (shapes, dtypes, which masks, causal variant, window, soft cap, dropout rate,
backend, API) come from a fixed covering list, so each compiles once. The default run (profiles ``ci``,
derandomized, the default under ``CI``, and ``dev``) runs every structure once, each with the API and
fast backend of ``ROTATION``, hypothesis drawing the data (inputs, mask bits and density, lengths,
segment ids, dropout keys); ``HYPOTHESIS_PROFILE=extended`` draws 300 calls from the whole list.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jbackends as jb
from jbackends import attention as A
from pallas_kernels.attention import base, cpp_flash

# Each example compiles several backends' forward and backward (about 3 s on 2 cores): "ci" and "dev"
# keep the default run short, "extended" (HYPOTHESIS_PROFILE=extended) searches wider.
settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "extended", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")

LARGE_NEG = float(np.asarray(-0.7 * np.finfo(np.float32).max, np.float32))
BACKENDS = {
    "math": dict(math=True, flash=False, mem_efficient=False, cudnn=False),
    "flash": dict(math=False, flash=True, mem_efficient=False, cudnn=False),
    "flash_xla": dict(math=False, flash=True, mem_efficient=False, cudnn=False, flash_cpu_kernel="xla"),
    "efficient": dict(math=False, flash=False, mem_efficient=True, cudnn=False),
}
TOL = {"float32": (3e-5, 1e-4), "bfloat16": (2e-2, 3e-2)}


def _scenarios():
    """A fixed covering list of call structures (static: each compiles once per backend and API).

    Every value of every axis appears, crossed with every backend and both APIs; hypothesis then
    draws which scenario runs and all the data (inputs, mask bits, lengths, segment ids, dropout key).
    """
    structures = [
        # dtype, B, T, S, K, G, H, Hv, causal, mask, mask_shape, window, lengths, segments, cap, p
        ("float32", 2, 5, 7, 1, 2, 8, 8, "none", "bool", "full", None, False, False, None, 0.0),
        ("float32", 1, 12, 7, 2, 1, 4, 3, "lower_right", "none", "full", None, True, False, None, 0.0),
        ("bfloat16", 2, 12, 12, 2, 2, 8, 8, "top_left", "float", "b1", None, False, False, None, 0.0),
        ("float32", 2, 5, 12, 1, 1, 8, 3, "none", "float", "q1", (2, 1), False, False, 4.0, 0.0),
        ("float32", 2, 12, 12, 2, 1, 4, 4, "top_left", "none", "full", (0, 3), False, True, None, 0.25),
        ("float32", 1, 1, 7, 1, 2, 8, 8, "lower_right", "none", "full", None, False, False, 4.0, 0.0),
        ("bfloat16", 2, 5, 7, 2, 2, 4, 3, "none", "bool", "1n", None, True, False, None, 0.25),
        ("float32", 2, 12, 1, 1, 1, 8, 8, "none", "none", "full", None, True, True, None, 0.0),
    ]
    keys = (
        "dtype",
        "B",
        "T",
        "S",
        "K",
        "G",
        "H",
        "Hv",
        "causal",
        "mask",
        "mask_shape",
        "window",
        "lengths",
        "segments",
        "softcap",
        "dropout",
    )
    out = []
    for i, s in enumerate(structures):
        for api in ("jax", "torch"):
            c = dict(zip(keys, s), api=api, structure=i)
            if api == "torch":  # torch's API has no window / lengths / segments / soft cap
                c.update(window=None, lengths=False, segments=False, softcap=None)
            if c["causal"] == "lower_right":
                c["mask"] = "none"  # one mask argument: the CausalBias
            out.append(c)
    return [dict(c, backend=b) for c in out for b in BACKENDS]


SCENARIOS = _scenarios()

# The default run (profiles "ci" and "dev"): every structure once, each with the API and the fast backend
# that let its features be value-checked (the torch API has no window / lengths / segments / soft cap;
# FLASH takes a mask only through the C++ kernel, which has no soft cap or dropout): every structure,
# both APIs and every fast backend run, and hypothesis draws the data. (A sample of 12 of the 64
# scenarios, as before, left segments, windows and most masks out of every CI run; MATH is the
# reference's own code under the API layer, and runs in the "extended" profile's sample.)
ROTATION = [
    ("torch", "flash"),
    ("jax", "flash_xla"),
    ("torch", "efficient"),
    ("jax", "efficient"),
    ("jax", "flash"),
    ("jax", "flash_xla"),
    ("jax", "efficient"),
    ("jax", "flash"),
]
DEFAULT_SCENARIOS = [
    next(c for c in SCENARIOS if c["api"] == api and c["backend"] == b and c["structure"] == i)
    for i, (api, b) in enumerate(ROTATION)
]


@st.composite
def calls(draw, scenarios=SCENARIOS):
    c = dict(draw(st.sampled_from(scenarios)))
    c["seed"] = draw(st.integers(0, 2**16)) + c["structure"]  # a single example draws 0: vary by structure
    # bool mask: P(attend); the first value is hypothesis's simplest draw, the one a single example gets
    c["density"] = draw(st.sampled_from([0.7, 0.3, 1.0, 0.0]))
    return c


def _inputs(c):
    rng = np.random.default_rng(c["seed"])
    B, T, S, K, G, H, Hv = (c[n] for n in ("B", "T", "S", "K", "G", "H", "Hv"))
    N = K * G
    dt = jnp.dtype(c["dtype"])
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32).astype(dt)
    k = jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.float32).astype(dt)
    v = jnp.asarray(rng.normal(size=(B, S, K, Hv)), jnp.float32).astype(dt)
    shape = {"full": (B, N, T, S), "b1": (1, N, T, S), "1n": (B, 1, T, S), "q1": (B, N, 1, S)}[
        c["mask_shape"]
    ]
    mask = bias = None
    if c["mask"] == "bool":
        mask = jnp.asarray(rng.random(shape) < c["density"])
    elif c["mask"] == "float":
        bias = jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dt)
    ql = kl = seg = None
    if c["lengths"]:
        ql = jnp.asarray(rng.integers(0, T + 1, B), jnp.int32)
        kl = jnp.asarray(rng.integers(0, S + 1, B), jnp.int32)
    if c["segments"]:
        seg = (
            jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), 1), jnp.int32),
            jnp.asarray(np.sort(rng.integers(0, 3, (B, S)), 1), jnp.int32),
        )
    key = jax.random.key(c["seed"]) if c["dropout"] else None
    return q, k, v, mask, bias, ql, kl, seg, key


def _reference(c, q, k, v, mask, bias, ql, kl, seg, key):
    """(out [B, T, N, Hv] float32, lse [B, T, N] float32 or None): the API's contract, in jnp."""
    f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    T, S = c["T"], c["S"]
    args = base.AttentionArgs(
        q=f32(q),
        k=f32(k),
        v=f32(v),
        bias=f32(bias),
        mask=mask,
        scale=1.0 / np.sqrt(c["H"]),
        causal=c["causal"] != "none",
        diag_offset=S - T if c["causal"] == "lower_right" else 0,
        window=c["window"],
        q_seq_lengths=ql,
        kv_seq_lengths=kl,
        q_segment_ids=None if seg is None else seg[0],
        kv_segment_ids=None if seg is None else seg[1],
        logits_soft_cap=c["softcap"],
        dropout_rate=c["dropout"],
        dropout_rng=key,
    )
    out, lse = base.reference(args)
    if c["api"] == "torch":
        return out, None
    # jax.nn: a row without a key attends uniformly to all S keys (mean of V, not dropped out), its
    # LSE is jax.nn's large negative; rows beyond the query length stay 0. Bias-only rows: NaN.
    empty = jnp.swapaxes(jnp.isneginf(lse), 1, 2)  # [B, T, N]
    masked = mask is not None or args.has_index_masks
    if masked:
        rows = empty
        if ql is not None:
            rows = rows & (jnp.arange(T)[None, :, None] < ql[:, None, None])
        vm = jnp.repeat(jnp.mean(f32(v), axis=1), c["G"], axis=1)  # [B, N, Hv]
        out = jnp.where(rows[..., None], vm[:, None], out)
        lse = jnp.where(jnp.isneginf(lse), LARGE_NEG, lse)
    elif bias is not None:
        out = jnp.where(empty[..., None], jnp.nan, out)
    return out, jnp.swapaxes(lse, 1, 2)


def _ours(c, q, k, v, mask, bias, ql, kl, seg, key):
    if c["api"] == "torch":
        tl = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
        attn = bias if bias is not None else mask
        if c["causal"] == "lower_right":
            attn = A.causal_lower_right(c["T"], c["S"])
        out = A.scaled_dot_product_attention(
            tl(q),
            tl(k),
            tl(v),
            attn_mask=attn,
            dropout_p=c["dropout"],
            is_causal=c["causal"] == "top_left",
            enable_gqa=c["G"] > 1,
            dropout_rng=key,
        )
        return tl(out), None
    if c["causal"] == "lower_right":
        if mask is not None:
            raise AssertionError("unreachable: a CausalBias is the jax.nn API's mask")
    return A.dot_product_attention(
        q,
        k,
        v,
        bias,
        A.causal_lower_right(c["T"], c["S"]) if c["causal"] == "lower_right" else mask,
        is_causal=c["causal"] == "top_left",
        query_seq_lengths=ql,
        key_value_seq_lengths=kl,
        local_window_size=c["window"],
        logits_soft_cap=c["softcap"],
        dropout_rate=c["dropout"],
        dropout_rng=key,
        segment_ids=seg,
        return_residual=True,
        residual_dtype=jnp.float32,
    )


def _static(c):
    return tuple(sorted((k, v) for k, v in c.items() if k not in ("seed", "density", "structure")))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fwd_and_grads(static, which, q, k, v, mask, bias, ql, kl, seg, key, ct):
    c = dict(static)
    fn = _ours if which == "ours" else _reference

    def loss(q, k, v, bias):
        out, lse = fn(c, q, k, v, mask, bias, ql, kl, seg, key)
        o = out.astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.isnan(o), 0.0, o) * ct), (out, lse)

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grads, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
    return out, lse, grads


def _gradient_floors(c, q, k, ct, out):
    """Per gradient, the scale below which differences are rounding noise: 0.1, or for half-precision
    inputs the error a FlashAttention-style backward carries by design. It forms
    ``D_i = rowsum(dO_i * O_i)`` from the output rounded to the input dtype (as FlashAttention and
    torch do): an error of up to ``eps * sum_h |dO_ih O_ih|`` in every ``dS_ij`` (times
    ``1 / (1 - dropout)``), which reaches ``dq`` times ``|k|`` and the softmax scale, ``dk`` times
    ``|q|``, the softmax scale and a column sum of ``P`` (at most ``T * G``), and the bias gradient as
    is (``dv`` has no ``D`` term). A gradient that is 0 in exact arithmetic (every row sees one key)
    shows that much noise: seen with bfloat16, dropout 0.25, a bool mask and lengths, where ``dq``
    was 6e-3 instead of 1e-9."""
    if c["dtype"] == "float32":
        return dict.fromkeys("qkvb", 0.1)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    d_err = 2.0**-8 * float(np.max(np.sum(np.abs(f32(ct) * f32(out)), -1))) / (1.0 - (c["dropout"] or 0.0))
    sm = 1.0 / np.sqrt(c["H"])
    noise = dict(
        q=d_err * float(np.abs(f32(k)).max()) * sm,
        k=d_err * float(np.abs(f32(q)).max()) * sm * c["T"] * c["G"],
        v=0.0,
        b=d_err,
    )
    gtol = TOL[c["dtype"]][1]
    return {name: max(0.1, n / gtol) for name, n in noise.items()}


def _cases():
    """(id, strategy) per test case: one per default scenario, or the whole list's sample (extended)."""
    if PROFILE == "extended":
        return [pytest.param(calls(), id="sampled")]
    return [
        pytest.param(calls([c]), id=f"s{c['structure']}-{c['api']}-{c['backend']}") for c in DEFAULT_SCENARIOS
    ]


@pytest.mark.parametrize("strategy", _cases())
@settings(
    settings.get_profile(PROFILE)
    if PROFILE == "extended"
    else settings(max_examples=1, deadline=None, derandomize=PROFILE == "ci")
)
@given(data=st.data())
def test_every_backend_matches_the_reference_through_both_apis(strategy, data):
    _check(data.draw(strategy))


def _check(c):
    q, k, v, mask, bias, ql, kl, seg, key = _inputs(c)
    inputs = (q, k, v, mask, bias, ql, kl, seg, key)
    ct = jnp.asarray(
        np.random.default_rng(c["seed"] + 1).normal(size=(c["B"], c["T"], c["K"] * c["G"], c["Hv"])),
        jnp.float32,
    )
    # FLASH takes a mask / bias only through the C++ CPU kernel (which has no dropout).
    cpp_takes = c["backend"] == "flash" and cpp_flash.available() and not c["dropout"]
    takes = not (
        c["backend"].startswith("flash") and (mask is not None or bias is not None) and not cpp_takes
    )
    with jb.with_backends(**BACKENDS[c["backend"]]):
        if not takes:
            with pytest.raises(A.NoAvailableBackendError):
                _ours(c, *inputs)
            return
        got_out, got_lse, got_g = _fwd_and_grads(_static(c), "ours", *inputs, ct)
    want_out, want_lse, want_g = _fwd_and_grads(_static(c), "reference", *inputs, ct)
    atol, gtol = TOL[c["dtype"]]
    out, want = np.asarray(got_out, np.float32), np.asarray(want_out, np.float32)
    assert out.shape == want.shape and got_out.dtype == q.dtype
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    np.testing.assert_allclose(out, want, atol=atol, rtol=atol, err_msg=str(c))
    if want_lse is not None:
        np.testing.assert_allclose(
            np.asarray(got_lse),
            np.asarray(want_lse),
            atol=max(atol, 1e-4),
            rtol=max(atol, 1e-5),
            err_msg=str(c),
        )
    floors = _gradient_floors(c, q, k, ct, got_out)
    for name, a, b in zip("qkvb", got_g, want_g):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # Relative to the largest gradient, with a floor: a gradient that is 0 in exact arithmetic
        # (e.g. every row sees one key) is float noise in both.
        scale = max(float(np.abs(b).max()), floors[name])
        np.testing.assert_allclose(a / scale, b / scale, atol=gtol, err_msg=f"d{name} {c}")
