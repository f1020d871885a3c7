"""cuDNN attention: a bridge to ``jax.nn.dot_product_attention(implementation="cudnn")``.

The ``SDPBackend.CUDNN_ATTENTION`` implementation. It only runs on NVIDIA GPUs and is never chosen on
CPU; :func:`unsupported` states every constraint of jax's cuDNN path as a reason, so dispatch and
``explain`` can report why it was not taken, also for a GPU described from a CPU-only machine.

Constraints (jax 0.10, cuDNN 9):

* float16 / bfloat16 inputs; head dim a multiple of 8 and ``<= 128`` (``<= 256`` from sm90);
  equal q/k and v head dims.
* No dropout (jax's cuDNN API has no stateless-dropout key that matches the other backends), no
  logits soft cap, no segment ids, no arbitrary boolean mask (an additive ``bias`` is fine, over every
  query and key: jax's cuDNN path takes no bias broadcast over ``T`` or ``S``).
* Odd ``T`` or ``S``: jax's cuDNN forward takes them, its training path refuses them (with or
  without a bias), so a differentiated call runs on inputs padded to even lengths
  (:func:`_even_lengths`).
* Causal only with the top-left diagonal on square attention (``T == S``, ``diag_offset == 0``).
* Sliding windows: only left windows ``(left, 0)`` with ``diag_offset == 0``. jax's cuDNN path with
  ``local_window_size=(left, 0)`` and ``is_causal=False`` silently attends to the future (the bug fixed
  by jax PR 39576); this bridge therefore always passes such windows *with* ``is_causal=True``, which
  is the same mask and the path cuDNN gets right. Right windows are refused.
* The returned LSE is cuDNN's softmax statistic; it carries no gradient (``stop_gradient``).
* Its gradient is cuDNN's backward; the derivative of that backward (grad of grad, Hessian-vector
  products) is the reference's, as on every other fast backend (JAX's cuDNN backward has none).
* Rows without a key (beyond ``q_seq_lengths``, ``kv_seq_lengths == 0``) are set to output 0 and
  LSE ``-inf`` after the call, the contract of every backend, whatever cuDNN leaves there.

Example:
  >>> import jax.numpy as jnp
  >>> from pallas_kernels.attention import base, cudnn
  >>> x = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  >>> cudnn.unsupported(base.make_args(x, x, x), "cpu")
  ['cuDNN attention runs only on NVIDIA GPUs (platform=cpu)']
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels import gpu
from pallas_kernels.attention import base

__all__ = ["attention", "unsupported", "runtime_unavailable", "GPU_PLATFORMS"]

GPU_PLATFORMS = gpu.GPU_PLATFORMS


def _local_compute_capability() -> Optional[float]:
    """The compute capability of the GPU lowered for (``gpu.cuda_target``'s, else the local one)."""
    cc = gpu.compute_capability()
    return None if cc is None else cc / 10


def unsupported(
    args: base.AttentionArgs,
    platform: str,
    *,
    compute_capability: Optional[float] = None,
    cudnn_version: Optional[int] = None,
) -> list:
    """Reasons jax's cuDNN attention cannot run ``args`` on ``platform`` (empty if it can).

    Args:
      args: canonical arguments.
      platform: lowering platform (``"cpu"``, ``"cuda"``, ...).
      compute_capability: e.g. ``9.0``; default: the local GPU's when there is one (else sm80 limits).
      cudnn_version: e.g. ``91000``; ``None`` skips the version check unless running on a GPU here.
    """
    reasons = []
    if platform not in GPU_PLATFORMS:
        reasons.append(f"cuDNN attention runs only on NVIDIA GPUs (platform={platform})")
    dt = jnp.dtype(args.dtype)
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        reasons.append(f"cuDNN attention needs float16/bfloat16 inputs (got {dt.name})")
    cc = compute_capability
    if cc is None and platform in GPU_PLATFORMS:
        cc = _local_compute_capability()
    h_max = 256 if (cc or 0) >= 9.0 else 128
    if args.head_dim % 8 or args.head_dim > h_max:
        reasons.append(
            f"cuDNN attention needs a head dim that is a multiple of 8 and <= {h_max} (got {args.head_dim})"
        )
    if args.v_head_dim != args.head_dim:
        reasons.append(
            f"cuDNN attention needs equal q/k and v head dims (got {args.head_dim} and {args.v_head_dim})"
        )
    if args.has_dropout:
        reasons.append("cuDNN attention (through jax.nn) has no dropout matching the other backends")
    if args.logits_soft_cap is not None:
        reasons.append("cuDNN attention has no logits soft cap (logits_soft_cap)")
    if args.q_segment_ids is not None:
        reasons.append("cuDNN attention (through jax.nn) takes no segment ids")
    if args.mask is not None:
        reasons.append("cuDNN attention takes no arbitrary boolean mask (pass an additive bias)")
    if args.causal and (args.diag_offset != 0 or args.q_len != args.kv_len):
        reasons.append(
            "cuDNN causal attention needs T == S with the top-left diagonal "
            f"(got T={args.q_len}, S={args.kv_len}, diag_offset={args.diag_offset})"
        )
    if args.window is not None:
        left, right = args.window
        if right != 0 and not args.causal:
            reasons.append(f"cuDNN attention supports only left windows (left, 0); got window={args.window}")
        if args.diag_offset != 0 or args.q_len != args.kv_len:
            reasons.append("cuDNN sliding windows need T == S with the top-left diagonal")
    if args.bias is not None and tuple(args.bias.shape[2:]) != (args.q_len, args.kv_len):
        reasons.append(
            "cuDNN attention (through jax.nn) needs a bias over every query and key "
            f"([..., T, S] = [..., {args.q_len}, {args.kv_len}]); got bias.shape={tuple(args.bias.shape)}"
        )
    if cudnn_version is not None and cudnn_version < 8904:
        reasons.append(f"cuDNN attention needs cuDNN >= 8.9.4 (got {cudnn_version})")
    return reasons


def runtime_unavailable() -> Optional[str]:
    """Why JAX cannot trace its cuDNN attention on this machine (it reads the local cuDNN version at
    trace time: a CPU-only machine has none), or None when it can."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

    try:
        fa.check_cudnn_version()
    except Exception as e:  # noqa: BLE001 - RuntimeError("cuDNN is not detected.") and kin
        return f"JAX cannot lower cuDNN attention on this machine ({e})"
    return None


def attention(args: base.AttentionArgs, *, config=None, **opts):
    """Runs ``jax.nn.dot_product_attention(implementation="cudnn")`` on canonical ``args``."""
    del config, opts
    reasons = unsupported(args, "cuda")
    if reasons:
        raise NotImplementedError("; ".join(reasons))
    call = _jax_nn_call(args)
    out, lse = _with_reference_derivative(
        call,
        args,
        args.q,
        args.k,
        args.v,
        args.bias,
        args.q_seq_lengths,
        args.kv_seq_lengths,
        train_call=_even_lengths(call, args),
    )
    lse = jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(jnp.float32))
    # The backend contract (output 0, LSE -inf, no gradient for rows without a key: the jbackends
    # API builds jax.nn's / torch's answer on it), whatever cuDNN leaves in padded rows.
    empty = base.rows_without_keys(args)
    if empty is not None:
        out = jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], jnp.zeros((), out.dtype), out)
        lse = jnp.where(empty, -jnp.inf, lse)
    return out, lse


def _jax_nn_call(args: base.AttentionArgs, implementation: str = "cudnn"):
    """``call(q, k, v, bias, q_len, kv_len) -> (out, lse [B, T, N])``: ``jax.nn.dot_product_attention``
    with ``args``' static settings (``implementation="xla"`` stands in for cuDNN in the CPU tests)."""
    window = None
    causal = args.causal
    if args.window is not None:
        left = args.window[0]
        # Work around jax PR 39576: (left, 0) without is_causal leaks the future in cuDNN.
        window = (left, 0)
        causal = True

    def call(q, k, v, bias, q_len, kv_len):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            scale=args.scale,
            is_causal=causal,
            query_seq_lengths=q_len,
            key_value_seq_lengths=kv_len,
            local_window_size=window,
            implementation=implementation,
            return_residual=True,
        )

    return call


def _even_lengths(call, args: base.AttentionArgs):
    """``call`` for a differentiated call: JAX's cuDNN training path refuses an odd ``T`` or ``S``
    with "Unsupported sequence length" (its check for a bias sees the placeholder bias JAX always
    passes), so there the queries (and the keys, values and bias) are padded by one row to even
    lengths and the outputs sliced back. The extra query's output is dropped (its cotangent is 0, so
    it adds nothing to dk / dv); the extra key is seen by no real query: causal calls here are
    square and top-left (``unsupported``; windows run causal), so only the extra query sees it,
    and otherwise it lies beyond ``key_value_seq_lengths`` (set to ``S`` when not given)."""
    T, S = args.q_len, args.kv_len
    pad_t, pad_s = T % 2, S % 2
    if not (pad_t or pad_s):
        return call
    masked_by_causality = args.causal or args.window is not None

    def pad(x, axis, n):
        return jnp.pad(x, [(0, n if d == axis else 0) for d in range(x.ndim)]) if n else x

    def padded(q, k, v, bias, q_len, kv_len):
        q, k, v = pad(q, 1, pad_t), pad(k, 1, pad_s), pad(v, 1, pad_s)
        if bias is not None:  # over every query and key (`unsupported`; T or S may be 1)
            bias = pad(bias, 2, pad_t if bias.shape[2] == T else 0)
            bias = pad(bias, 3, pad_s if bias.shape[3] == S else 0)
        if pad_s and not masked_by_causality:  # lengths past S (traced, unchecked) stop at S
            kv_len = jnp.full((q.shape[0],), S, jnp.int32) if kv_len is None else jnp.minimum(kv_len, S)
        out, lse = call(q, k, v, bias, q_len, kv_len)
        return out[:, :T], lse[:, :T]  # jax's residual LSE is [B, T, N]

    return padded


def _with_reference_derivative(call, args: base.AttentionArgs, *xs, train_call=None):
    """``call(*xs)`` (``xs = (q, k, v, bias, q_len, kv_len)``) with cuDNN's own gradient, whose
    derivative in turn is the reference's (:func:`base.reference_vjp`), as for every other fast
    backend: JAX's cuDNN backward is a custom call with no derivative, so grad of grad and
    Hessian-vector products (reverse over reverse) differentiate the same function in plain jnp.

    ``train_call`` (default ``call``), the same function, gives the outputs and cuDNN's vjp when the
    call is differentiated (:func:`_even_lengths`)."""
    # The static part of the call only (the arrays travel as arguments: no closed-over tracers).
    # The bridge takes no mask, segment ids or dropout key (`unsupported`), so these are all.
    template = args.replace(q=None, k=None, v=None, bias=None, q_seq_lengths=None, kv_seq_lengths=None)
    train_call = call if train_call is None else train_call

    def differentiable(primal):
        g = jax.custom_vjp(primal)
        g.defvjp(g_fwd, g_bwd)
        return g

    def g_fwd(*xs):
        # The outputs come from `g_train` itself (the same call as the vjp's forward, so XLA computes
        # it once) and cuDNN's vjp is taken on constants: under an outer differentiation (reverse
        # over reverse) nothing here is differentiated through cuDNN's forward rule, which has no
        # derivative of its own.
        _, vjp = jax.vjp(train_call, *jax.lax.stop_gradient(xs))  # a pytree of cuDNN's residuals
        return g_train(*xs), (xs, vjp)

    def g_bwd(res, ct):
        xs, vjp = res
        return backward(xs, vjp, ct)

    g, g_train = differentiable(call), differentiable(train_call)

    @jax.custom_vjp
    def backward(xs, vjp, ct):
        return vjp(ct)

    def backward_fwd(xs, vjp, ct):
        return vjp(ct), (xs, vjp, ct)

    def backward_bwd(res, cts):
        (q, k, v, bias, q_len, kv_len), vjp, (g_out, g_lse) = res

        def grads(q, k, v, bias, g_out):
            at = template.replace(q=q, k=k, v=v, bias=bias, q_seq_lengths=q_len, kv_seq_lengths=kv_len)
            dq, dk, dv, db = base.reference_vjp(at, g_out)  # cuDNN's LSE output has no gradient
            return dq, dk, dv, db

        _, vjp_ref = jax.vjp(grads, q, k, v, bias, g_out)
        dq, dk, dv, dbias, dg_out = vjp_ref(tuple(cts[:4]))
        none = lambda tree: jax.tree.map(lambda _: None, tree)  # noqa: E731
        return (dq, dk, dv, dbias, none(q_len), none(kv_len)), none(vjp), (dg_out, jnp.zeros_like(g_lse))

    backward.defvjp(backward_fwd, backward_bwd)
    return g(*xs)
