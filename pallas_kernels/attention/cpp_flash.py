"""FlashAttention-2 as a C++ CPU kernel inside XLA (``jax.ffi``): the fast CPU path of FLASH.

``csrc/flash_attention.cc`` holds a forward and a backward kernel (register-blocked matmul tiles,
12 x 32 with AVX-512 and 6 x 16 with AVX2 + FMA, picked at run time; base-2 online softmax, one
thread per core), built by ``pip install`` next to this module (:func:`isa` / :func:`set_isa`). They compute exactly what :mod:`xla_flash` computes (same masks, same residuals:
``out`` and the natural-log ``lse``), so the dispatcher lists them first for FLASH on CPU
(``cpp_flash``) and runs them whenever :func:`unsupported` has nothing to say and the flag
``flash_cpu_kernel`` allows, and the blockwise XLA implementation (``xla_flash``) otherwise (and on every
other platform, and where the extension could not be built).

The kernels take causal masks (either alignment), local windows, query / key lengths, segment
ids, a logits soft cap, an additive ``bias`` (differentiable) and a boolean ``mask``, both broadcast
over batch and heads (the kernel reads them in place; a T or S broadcast is materialised). They do
not take dropout: those calls run the XLA implementation. A row that sees no key gives 0 and LSE
``-inf`` (the kernels' contract; the API layer turns that into jax.nn's or torch's answer).

bfloat16 q, k and v go to the kernel as they are. On a CPU with AMX-BF16 (Intel Sapphire Rapids
and later) the forward runs both matmuls on AMX tiles: bf16 products summed in float32, the softmax
in float32, its probabilities rounded to bf16 for ``p @ v`` (as torch's and cuDNN's bf16 kernels
do; :func:`amx` says whether it runs, :func:`set_amx` turns it off). Elsewhere, and for the
backward, they are widened to float32 (exactly). float16 is computed in float32 (cast once) and
cast back; float64 is refused (the dispatcher runs MATH, which keeps float64).

Peak temporary memory is ``O((T + S) * (H + Hv))`` (packed copies of k and v, plus a dQ buffer per
thread when there are fewer (batch, kv head) pairs than threads can share), never ``O(T * S)``
without a bias or mask; :func:`workspace_bytes` gives it (``memory_analysis`` of an executable cannot
see it). With a bias or mask it is not: one broadcast over T or S is materialised at ``[.., T, S]``.
The bias gradient is summed in the kernel over the batches and heads the bias broadcasts over, so it
takes the bias's ``[1|B, 1|N, T, S]`` float32 (see :func:`dbias_dims`; where that split would leave
threads idle, every head writes its own dS, ``[B, N, T, S]``, and XLA sums them).

Limits: ``jax.vmap`` runs the kernel once per batch element (``vmap_method="sequential"``); under
``shard_map`` each shard runs it on its own block; under plain ``jit`` with sharded inputs XLA cannot
partition a custom call, so every device runs it on the gathered inputs (correct, not parallel): use
``shard_map``, or the flag ``flash_cpu_kernel="xla"`` (blockwise XLA, which GSPMD partitions). A CPU
``jax.export`` carries the custom calls and needs them allowed explicitly (see ``TARGETS``).
Forward-mode AD (``jvp``) is not defined (a ``custom_vjp``, like the XLA implementation).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels.attention import base, cpp_flash
  >>> q = jax.random.normal(jax.random.key(0), (1, 300, 4, 32))
  >>> args = base.make_args(q, q, q, is_causal=True)
  >>> if not cpp_flash.unsupported(args):
  ...   out, lse = cpp_flash.attention(args)
  ...   ref, _ = base.reference(args)
  ...   assert jnp.allclose(out, ref, atol=1e-5)
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import partition
from pallas_kernels.attention import base, sharded
from pallas_kernels.ffi import load_library, register_at_import, unavailable_reason, xla_pool_setter

__all__ = [
    "Config",
    "FORWARD_TARGET",
    "FORWARD_BF16_TARGET",
    "BACKWARD_TARGET",
    "TARGETS",
    "available",
    "threads",
    "set_threads",
    "set_xla_pool",
    "isa",
    "set_isa",
    "amx",
    "set_amx",
    "unsupported",
    "attention",
    "workspace_bytes",
]

#: The XLA custom-call targets of the kernels. ``jax.export`` refuses them unless disabled, each
#: of :data:`TARGETS` (``[jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]``): an
#: exported artifact that carries them runs only where this extension is loaded. The flag
#: ``flash_cpu_kernel="xla"`` (the blockwise XLA implementation) gives a portable one instead.
FORWARD_TARGET = _FWD = "jb_flash_attention_fwd_f32"
BACKWARD_TARGET = _BWD = "jb_flash_attention_bwd_f32"
#: The forward of bfloat16 q, k, v (float32 out and lse); exports of bf16 calls carry it too.
FORWARD_BF16_TARGET = _FWD_BF16 = "jb_flash_attention_fwd_bf16"
#: Every custom-call target a CPU export of these kernels may carry.
TARGETS = (FORWARD_TARGET, FORWARD_BF16_TARGET, BACKWARD_TARGET)


_MODULE = f"{__package__}._flash_cpu"


@functools.cache
def _library() -> Optional[ctypes.CDLL]:
    return load_library(
        _MODULE,
        check="JbFlashAvailable",
        targets={_FWD: "JbFlashFwdF32", _FWD_BF16: "JbFlashFwdBf16", _BWD: "JbFlashBwdF32"},
        restypes={"JbFlashIsa": ctypes.c_char_p, "JbFlashSetIsa": ctypes.c_int, "JbFlashAmx": ctypes.c_int},
        argtypes={
            "JbFlashSetThreads": [ctypes.c_int],
            "JbFlashSetAmx": [ctypes.c_int],
            "JbFlashSetIsa": [ctypes.c_char_p],
            "JbFlashSetXlaPool": [ctypes.c_int],
        },
    )


# Registered at import (`jbackends` imports this module), so that a deserialized CPU export carrying
# the kernels runs in a fresh process that imported jbackends (ctypes loading is cheap; nothing is
# compiled here; a refusal warns at the kernels' first use, not at import).
register_at_import(_library)


def set_threads(n: int = 0) -> None:
    """Overrides the kernels' thread count for this process (tests, benchmarks); 0 restores the
    default (the CPUs this process may run on). Calls below ~8 MFLOP always run on one thread."""
    lib = _library()
    if lib is not None:
        lib.JbFlashSetThreads(int(n))


set_xla_pool = xla_pool_setter(_library, "JbFlashSetXlaPool")


#: The kernels' code paths, best first; the default is the best this CPU runs (AVX2 + FMA at least).
ISAS = ("avx512", "avx2", "scalar")


def isa() -> str:
    """The code path the kernels use here (one of :data:`ISAS`), or ``"unavailable"``."""
    lib = _library()
    return lib.JbFlashIsa().decode() if lib is not None else "unavailable"


def set_isa(name: str = "") -> bool:
    """Selects the kernels' code path for this process: ``"avx512"``, ``"avx2"`` or ``"scalar"``
    (plain C++); ``""`` restores the default (the best this CPU runs). For tests and benchmarks.

    Returns False (and changes nothing) when this CPU cannot run it or the kernels are unavailable.
    Raises ``ValueError`` for a name not in :data:`ISAS`. Read when a kernel runs, not when it is
    traced: it also switches calls already compiled.
    """
    if name and name not in ISAS:
        raise ValueError(f"set_isa: name must be one of {ISAS} or ''; got {name!r}")
    lib = _library()
    return lib is not None and lib.JbFlashSetIsa(name.encode()) == 0


def amx() -> bool:
    """Whether the forward of bfloat16 inputs runs on AMX tiles here: the CPU has AMX-BF16 (and the
    OS grants the tile state), the code path is ``"avx512"`` and :func:`set_amx` left them on."""
    lib = _library()
    return lib is not None and bool(lib.JbFlashAmx())


def set_amx(on: bool = True) -> bool:
    """Turns the AMX bfloat16 forward off (``False``: bf16 inputs are widened to float32 for the
    AVX-512 path) or back on, for this process; for tests and benchmarks. Read when a kernel runs,
    like :func:`set_isa`. Returns :func:`amx` after the change. Raises ``TypeError`` unless ``on``
    is a bool."""
    if not isinstance(on, bool):
        raise TypeError(f"set_amx: on must be a bool; got {on!r}")
    lib = _library()
    if lib is not None:
        lib.JbFlashSetAmx(int(on))
    return amx()


def available() -> bool:
    """Whether the C++ kernels were built and this CPU can run them (x86-64 with AVX2 + FMA)."""
    return _library() is not None


def threads() -> int:
    """Threads a large call uses (the CPUs this process may run on); 0 when unavailable."""
    lib = _library()
    return int(lib.JbFlashThreads()) if lib is not None else 0


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of the C++ kernels (``block_k`` a multiple of 16).

    The defaults were measured best on a 2-core AVX2 CPU at L = 4k, head dim 64: 96 query rows x 256
    keys forward (a multiple of the 6-row matmul tile; the score tile stays in L2, a 16-key panel of
    k / v in L1), 64 x 256 backward (its two score-sized tiles).
    """

    block_q: int = 96
    block_k: int = 256
    block_q_bwd: int = 64
    block_k_bwd: int = 256

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1 or (name.startswith("block_k") and val % 16):
                need = "a positive multiple of 16" if name.startswith("block_k") else "an int >= 1"
                raise ValueError(f"cpp_flash.Config.{name} must be {need}; got {name}={val!r}")

    def fit(self, args: base.AttentionArgs) -> "Config":
        """Tiles no larger than the (16-rounded) sequence lengths."""

        def f(n, b, m):
            return max(m, min(b, -(-n // m) * m))

        T, S = args.q_len, args.kv_len
        return Config(
            block_q=f(T, self.block_q, 1),
            block_k=f(S, self.block_k, 16),
            block_q_bwd=f(T, self.block_q_bwd, 1),
            block_k_bwd=f(S, self.block_k_bwd, 16),
        )


def workspace_bytes(
    q_shape,
    k_shape,
    v_shape,
    *,
    backward: bool,
    config: Optional[Config] = None,
    num_threads: Optional[int] = None,
    dbias_of: Optional[tuple] = None,
    dtype=jnp.float32,
) -> int:
    """Bytes the kernel allocates outside XLA's buffers during one call (``memory_analysis`` of the
    executable cannot see them): packed copies of k and v (backward: of q and dO too), the per-thread
    tiles and, backward, the dQ accumulators. Mirrors the allocations in ``csrc/flash_attention.cc``
    for ``num_threads`` threads (default: all, as a large call uses) and the unshrunk tiles, so it is
    exact for long sequences and an upper bound for short ones. ``dbias_of``: the shape of a bias
    whose gradient the backward computes (it changes how the work is split), else None. ``dtype``:
    the inputs' (a bfloat16 forward packs bf16 tiles where :func:`amx` holds, else widens q, k, v to
    float32 first).
    """
    B, T, N, H = q_shape
    S, K, Hv = k_shape[1], k_shape[2], v_shape[3]
    cfg = config or Config()
    rnd = lambda n, m=16: -(-n // m) * m  # noqa: E731
    Hp, Hvp, Sp = rnd(H), rnd(Hv), rnd(S)
    nt = num_threads or max(threads(), 1)
    if not backward:
        bq, bk = cfg.block_q, cfg.block_k
        if jnp.dtype(dtype) == jnp.bfloat16 and amx():  # ForwardAmx: tiles of 32 rows and keys
            bq, bk, Hq, Sq = rnd(bq, 32), rnd(bk, 32), rnd(H, 32), rnd(S, 32)
            packs = B * K * Sq * (Hq + Hvp) // 2  # bf16
            # qb and pb (bf16), the score tile (rows of bk + 16), acc, m, l (16 lanes), lo / hi (int64)
            tiles = nt * ((bq * Hq + bq * bk) // 2 + bq * (bk + 16) + bq * Hvp + bq * (1 + 16 + 4))
            return 4 * (packs + tiles)
        widened = B * (T * N * H + S * K * (H + Hv)) if jnp.dtype(dtype) == jnp.bfloat16 else 0
        packs = B * K * (H + Hvp) * Sp
        tiles = nt * (bq * H + bq * (bk + 16) + bq * Hvp + bq * (1 + 16 + 4))
        return 4 * (widened + packs + tiles)
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    packs = B * K * (H * Sp + Sp * Hp + Hv * Sp) + B * N * T * (Hp + Hvp + 2)
    owners = B * K
    if dbias_of is not None:
        dims = dbias_dims(q_shape, k_shape, dbias_of, config=cfg, num_threads=nt)
        owners = _owners(B, N, K, *dims)
    whole = nt == 1 or owners >= 4 * nt or owners % nt == 0
    dq = (1 if whole else nt) * B * T * N * Hp
    tiles = nt * (2 * bq * bk + bk * Hp + bk * Hvp + 4 * bq + 2 * bk)
    return 4 * (packs + dq + tiles)


def _owners(B, N, K, Bd, Nd) -> int:
    """Task owners of the backward (``Backward`` in csrc/flash_attention_body.h) for a dbias of
    [Bd, Nd, T, S]: every (batch, kv head) group, or the sets of groups that share dbias entries."""
    return B * K if Bd * Nd == B * N else Bd * (1 if Nd == 1 else K)


def dbias_dims(
    q_shape, k_shape, bias_shape, *, config: Optional[Config] = None, num_threads: Optional[int] = None
) -> tuple:
    """(batch, heads) of the bias gradient the backward kernel writes: the bias's own where it
    broadcasts over batches or heads and the kernel can sum their dS itself, else ``(B, N)``.

    Summed in the kernel, dbias takes the bias's memory, not ``B * N * T * S`` floats (for a
    ``[1, 1, T, S]`` bias at B=8, N=32, T=S=4096: 64 MiB instead of 16 GiB). The groups of heads that
    share a dbias entry then run in one task, one after another in a fixed order (the sums are
    reproducible), so this is chosen only where such tasks, one per key block and group, keep every
    thread busy (``num_threads``: default all); otherwise each head writes its own dS and XLA sums.
    With fewer owners of dbias entries than threads, the tasks are key blocks and each thread keeps
    a dQ buffer of its own (``B * T * N * H`` floats; :func:`workspace_bytes` with ``dbias_of``).
    """
    B, N = q_shape[0], q_shape[2]
    S, K = k_shape[1], k_shape[2]
    Bb, Nb = bias_shape[0], bias_shape[1]
    if Bb * Nb == B * N:
        return B, N
    cfg = config or Config()
    nt = num_threads or max(threads(), 1)
    owners = _owners(B, N, K, Bb, Nb)
    key_blocks = -(-S // cfg.block_k_bwd)
    return (Bb, Nb) if owners * key_blocks >= nt else (B, N)


def unsupported(args: base.AttentionArgs, platform: str = "cpu") -> list:
    """Reasons the C++ kernels cannot run ``args`` on ``platform`` (empty if they can)."""
    reasons = []
    if platform != "cpu":
        reasons.append(f"the C++ flash kernel is CPU only (lowering for {platform})")
    if not available():
        reasons.append(
            unavailable_reason(
                _MODULE,
                "the C++ flash kernel",
                "is not built or this CPU lacks AVX2 + FMA (pip install -e . with a C++ compiler)",
            )
        )
    if args.dropout_rate > 0:
        reasons.append("the C++ flash kernel has no dropout")
    if args.head_dim == 0 or args.v_head_dim == 0:
        reasons.append("the C++ flash kernel needs head dims >= 1 (the XLA code handles 0)")
    if not jnp.issubdtype(args.q.dtype, jnp.floating):
        reasons.append(f"the C++ flash kernel needs float inputs; got {args.q.dtype}")
    reasons += base.float64_reasons(args, "the C++ flash kernel")
    return reasons


def attention(args: base.AttentionArgs, *, config: Optional[Config] = None, **opts):
    """C++ CPU flash attention: ``(out [B, T, N, Hv] q.dtype, lse [B, N, T] float32)``.

    Differentiable (``jax.vjp``) w.r.t. q, k, v. Raises ``NotImplementedError`` naming the reasons
    when :func:`unsupported` is not empty (CPU lowering is assumed; the dispatcher lowers
    :mod:`xla_flash` for other platforms).
    """
    del opts
    reasons = unsupported(args, "cpu")
    if reasons:
        raise NotImplementedError("; ".join(reasons))
    cfg = (config or Config()).fit(args)
    if 0 in (args.batch, args.q_len, args.kv_len, args.num_heads):
        B, T, N, _ = args.q.shape
        return (
            jnp.zeros((B, T, N, args.v.shape[3]), args.q.dtype),
            jnp.full((B, N, T), -jnp.inf, jnp.float32),
        )

    def forward(a):
        st, aux = _prepare(a, cfg)
        return _forward(st, a.q, a.k, a.v, aux)

    def backward(a, out, lse, g_out, g_lse, need_dbias=True):
        st, aux = _prepare(a, cfg)
        g_lse = None if isinstance(g_lse, jax.custom_derivatives.SymbolicZero) else g_lse
        need = need_dbias and a.bias is not None
        dq, dk, dv, dbias = _kernel_backward(
            st, a.q, a.k, a.v, a.bias if need else None, aux, out, lse, g_out, g_lse
        )
        return dq, dk, dv, dbias

    return sharded.attention_vjp(args, forward, backward, name="cpu flash (C++)", skips_dbias=True)


def _prepare(args, cfg):
    """The kernel's attributes and its integer operands (lengths, segment ids; (0,) when absent)."""
    st = _Static(**args.statics().fields(), cfg=cfg)
    B = args.q.shape[0]
    z = jnp.zeros((0,), jnp.int32)
    ql = z if args.q_seq_lengths is None else jnp.broadcast_to(args.q_seq_lengths, (B,)).astype(jnp.int32)
    kl = z if args.kv_seq_lengths is None else jnp.broadcast_to(args.kv_seq_lengths, (B,)).astype(jnp.int32)
    qs = z if args.q_segment_ids is None else args.q_segment_ids.astype(jnp.int32)
    ks = z if args.kv_segment_ids is None else args.kv_segment_ids.astype(jnp.int32)
    T, S = args.q.shape[1], args.k.shape[1]

    def full_ts(x, dtype):  # broadcast over T and S only (the kernel broadcasts batch and heads)
        return jnp.broadcast_to(x, x.shape[:2] + (T, S)).astype(dtype)

    bias = jnp.zeros((0,), jnp.float32) if args.bias is None else full_ts(args.bias, jnp.float32)
    mask = jnp.zeros((0,), jnp.bool_) if args.mask is None else full_ts(args.mask, jnp.bool_)
    return st, (ql, kl, qs, ks, bias, mask)


@dataclasses.dataclass(frozen=True)
class _Static(base.Statics):
    """The call's :class:`base.Statics` plus the kernel's tiles."""

    cfg: Config = Config()

    def attrs(self, backward: bool, need_dbias: bool = False):
        left, right = self.window or (0, 0)
        bq, bk = (
            (self.cfg.block_q_bwd, self.cfg.block_k_bwd) if backward else (self.cfg.block_q, self.cfg.block_k)
        )
        return dict(
            scale=np.float32(self.scale),
            causal=self.causal,
            diag_offset=np.int64(self.diag_offset),
            window=self.window is not None,
            left=np.int64(left),
            right=np.int64(right),
            has_q_len=self.has_q_len,
            has_kv_len=self.has_kv_len,
            has_seg=self.has_segments,
            block_q=np.int64(bq),
            block_k=np.int64(bk),
            softcap=np.float32(self.softcap or 0.0),
            has_bias=self.bias_shape is not None,
            has_mask=self.mask_shape is not None,
            need_dbias=need_dbias,
        )


def _f32(x):
    return x.astype(jnp.float32)


def _struct(shape):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.float32)


def _varying(outs, like):
    """Types the FFI outputs as varying over the ``shard_map`` axes ``like`` varies over.

    ``ffi_call`` types its results as replicated (and refuses output types that carry axes); each
    shard's kernel computes its own values, so they vary like the inputs do (`partition.vary_like`).
    """
    return tuple(partition.vary_like(o, *like) for o in outs)


#: A name scope around the kernel's custom calls. jax.export's refusal of a custom call names the
#: call's location, name stack included: this scope puts the way out into that message.
EXPORT_HINT = (
    "jbackends C++ flash kernel: for a portable jax.export trace under "
    "jb.with_backends(flash_cpu_kernel=xla), or opt in with disabled_checks="
    "[DisabledSafetyCheck.custom_call(target)] for the jb_flash_attention targets"
)


def _forward(st, q, k, v, aux):
    B, T, N, _ = q.shape
    bf16 = all(
        x.dtype == jnp.bfloat16 for x in (q, k, v)
    )  # the bf16 kernel (AMX tiles where the CPU has them)
    target, qkv = (_FWD_BF16, (q, k, v)) if bf16 else (_FWD, (_f32(q), _f32(k), _f32(v)))
    with jax.named_scope(EXPORT_HINT):
        out, lse = jax.ffi.ffi_call(
            target, (_struct((B, T, N, v.shape[3])), _struct((B, N, T))), vmap_method="sequential"
        )(*qkv, *aux, **st.attrs(False))
    out, lse = _varying((out, lse), (q, k, v, *aux))
    return out.astype(q.dtype), lse


def _kernel_backward(st, q, k, v, bias, aux, out, lse, g_out, g_lse):
    """(dq, dk, dv, dbias); dbias (the bias's shape and dtype) only when ``bias`` is given."""
    delta = jnp.einsum("btnv,btnv->bnt", _f32(g_out), _f32(out), precision=jax.lax.Precision.HIGHEST)
    if g_lse is not None:
        delta = delta - _f32(g_lse)
    B, T, N, _ = q.shape
    S = k.shape[1]
    structs = tuple(_struct(x.shape) for x in (q, k, v))
    dbias_shape = (0,) if bias is None else dbias_dims(q.shape, k.shape, bias.shape, config=st.cfg) + (T, S)
    structs += (_struct(dbias_shape),)
    with jax.named_scope(EXPORT_HINT):
        dq, dk, dv, ds = jax.ffi.ffi_call(_BWD, structs, vmap_method="sequential")(
            _f32(q), _f32(k), _f32(v), _f32(g_out), lse, delta, *aux, **st.attrs(True, bias is not None)
        )
    dq, dk, dv, ds = _varying((dq, dk, dv, ds), (q, k, v, g_out, lse, delta, *aux))
    dbias = None
    if bias is not None:  # dS summed over the dimensions the bias broadcasts
        axes = tuple(d for d in range(4) if bias.shape[d] == 1 and ds.shape[d] != 1)
        dbias = jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
