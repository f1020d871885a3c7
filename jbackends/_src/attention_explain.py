"""`jb.explain` (what it returns and how it decides) and the torch.backends.cuda-style capability
queries (``SDPAParams``, ``can_use_*_attention``): the dispatch decision, described without computing
anything."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jbackends._src import attention_dispatch as _dispatch
from jbackends._src import sdpa_registry as _sdpa_registry
from jbackends._src.attention_args import implementation_code, jaxnn_to_args, torch_to_args
from jbackends._src.flag_state import current_flags
from jbackends._src.sdp_backends import SDPBackend

__all__ = [
    "EXPLAIN_PLATFORMS",
    "Explanation",
    "explain_call",
    "sharding_plan",
    "SDPAParams",
    "can_use_flash_attention",
    "can_use_efficient_attention",
    "can_use_cudnn_attention",
    "is_flash_attention_available",
]


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which backend a call would use on ``platform`` and, for every other backend, why not.

    Attributes:
      platform: the lowering platform explained (``"cpu"``, ``"cuda"``, ...).
      chosen: the ``SDPBackend`` that would run, or None (the call would raise).
      order: the backends in the priority order that was tried.
      reasons: ``SDPBackend -> reason`` for every backend not chosen.
      implementation: the name of the implementation that would run (``"cpp_flash"``,
        ``"triton_flash"``, ``"xla_mem_efficient"``, ...; ``docs/architecture.md`` lists them).
      kernel: what that implementation is (technology, one line), then why each other implementation
        of the chosen backend on this platform was not used (e.g. ``"not cpp_flash: ... soft cap"``);
        None when nothing can run.
      sharding: for inputs that carry a ``NamedSharding`` (arrays or ``ShapeDtypeStruct``s): what
        stays split and how (``docs/sharding.md``), e.g. ``"sequence split over sp: a ring of 8
        steps"``; None for unsharded inputs.
    """

    platform: str
    chosen: Optional[SDPBackend]
    order: Tuple[SDPBackend, ...]
    reasons: Mapping[SDPBackend, str]
    implementation: Optional[str]
    kernel: Optional[str] = None
    sharding: Optional[str] = None

    def __str__(self) -> str:
        head = (
            f"SDPA on {self.platform}: {self.chosen.name} ({self.implementation})"
            if self.chosen is not None
            else f"SDPA on {self.platform}: no enabled backend can run"
        )
        if self.kernel:
            head += f"\n  runs: {self.kernel}"
        if self.sharding:
            head += f"\n  sharding: {self.sharding}"
        return "\n".join([head] + [f"  {b.name}: {self.reasons[b]}" for b in self.order if b in self.reasons])


def sharding_plan(query, key, api, args, chosen) -> Optional[str]:
    """The ``sharding`` line of :func:`explain` (None when the inputs carry no NamedSharding)."""
    specs = []
    for x in (query, key):
        s = getattr(x, "sharding", None)
        if not isinstance(s, jax.sharding.NamedSharding) or getattr(x, "ndim", len(x.shape)) != 4:
            return None
        spec = tuple(s.spec) + (None,) * (4 - len(tuple(s.spec)))
        specs.append(spec if api == "dot_product_attention" else (spec[0], spec[2], spec[1], spec[3]))
    if not any(e is not None for spec in specs for e in spec):
        return None
    if chosen is None:
        return None
    if SDPBackend(chosen) in (SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
        return "partitioned by XLA / JAX's own rules (plain XLA ops or JAX's cuDNN call)"
    from pallas_kernels.attention import sharded  # noqa: PLC0415

    return sharded.plan(args, specs[0], specs[1], dict(query.sharding.mesh.shape))


#: The values `jb.explain(platform=...)` takes (besides None: the default backend's).
EXPLAIN_PLATFORMS = _dispatch.PLATFORM_NAMES


def explain_call(
    apis: Mapping[str, Callable[..., Any]],
    query,
    key,
    value,
    *,
    api: str,
    platform: Optional[str],
    compute_capability: Optional[float],
    cudnn_version: Optional[int],
    kwargs: dict,
) -> Explanation:
    """The work of `jb.explain` (its docstring is the contract): validate, run the decision, describe it.

    ``apis`` maps each ``api=`` name to the public function it explains (``"dot_product_attention"``,
    ``"sdpa"``); the keywords that function takes are the keywords ``kwargs`` may hold.
    """
    flags = current_flags()
    if api not in apis:
        raise ValueError(f"`api` must be 'dot_product_attention' or 'sdpa'; got {api!r}")
    if platform is not None and (not isinstance(platform, str) or platform.lower() not in EXPLAIN_PLATFORMS):
        raise ValueError(
            f"`platform` must be one of {list(EXPLAIN_PLATFORMS)} (or None: the default "
            f"backend's); got {platform!r}"
        )
    api_fn = apis[api]
    valid = [n for n in inspect.signature(api_fn).parameters if n not in ("query", "key", "value")]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise TypeError(
            f"explain(api={api!r}) got unexpected keyword argument(s) {unknown}; the "
            f"keywords of {api_fn.__name__} are {valid}"
        )
    plat = _dispatch.canonical_platform(platform) if platform else _dispatch.default_platform()
    implementation = kwargs.pop("implementation", None)
    only = implementation_code(implementation)
    device_info = dict(_dispatch.local_device_info(plat) or {})  # what a call would see, as run() does
    if compute_capability is not None:
        device_info["compute_capability"] = float(compute_capability)
    if cudnn_version is not None:
        device_info["cudnn_version"] = int(cudnn_version)
    for name in ("return_residual", "platforms", "fully_masked_rows", "residual_gradient", "residual_dtype"):
        kwargs.pop(name, None)
    result = {}

    def probe(q, k, v, kw):
        if api == "sdpa":
            args, _ = torch_to_args(q, k, v, **kw)
        else:
            args, _ = jaxnn_to_args(q, k, v, **kw)
        result["d"] = _dispatch.decide(args, flags, plat, only=only, device_info=device_info or None)
        result["args"] = args
        return 0

    arrays, static = {}, {}
    for name, val in kwargs.items():
        if isinstance(val, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or (
            isinstance(val, (tuple, list))
            and val
            and all(isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in val)
        ):
            arrays[name] = val
        else:
            static[name] = val
    jax.eval_shape(lambda q, k, v, arr: probe(q, k, v, {**static, **arr}), query, key, value, arrays)
    d = result["d"]
    impl = d.implementation
    kernel = None
    if impl is not None:
        kernel = f"{impl.name}: {impl.technology}" + (f", {impl.description}" if impl.description else "")
        if impl.name == "cpp_flash":
            from pallas_kernels.attention import cpp_flash  # noqa: PLC0415 - optional extension

            kernel += f" (up to {cpp_flash.threads()} threads)"
        kernel += "".join(f"\n    not {n}: {r}" for n, r in d.implementation_reasons.items())
    return Explanation(
        platform=plat,
        chosen=None if d.chosen is None else SDPBackend(d.chosen),
        order=tuple(SDPBackend(b) for b in d.order),
        reasons={SDPBackend(b): r for b, r in d.reasons.items()},
        implementation=None if impl is None else impl.name,
        kernel=kernel,
        sharding=sharding_plan(query, key, api, result["args"], d.chosen),
    )


# ----------------------------------------------------------------------------------------------
# torch.backends.cuda-style capability queries.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class SDPAParams:
    """The arguments of one SDPA call, for the ``can_use_*`` queries (``torch.backends.cuda.SDPAParams``)."""

    query: Any
    key: Any
    value: Any
    attn_mask: Any = None
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False


def _can_use(backend: SDPBackend, params: SDPAParams, debug: bool) -> bool:
    if not isinstance(params, SDPAParams):
        raise TypeError(f"`params` must be an SDPAParams; got {type(params).__name__}")
    plat = _dispatch.default_platform()
    reasons = []
    q, k, v = params.query, params.key, params.value
    dropout_rng = jax.ShapeDtypeStruct((2,), jnp.uint32) if params.dropout else None

    def probe(q, k, v, m):
        args, _ = torch_to_args(
            q, k, v, m, params.dropout, params.is_causal, None, params.enable_gqa, dropout_rng
        )
        choice = _dispatch.backend_choice(args, int(backend), plat)  # flags not consulted, as in torch
        reasons.extend(_dispatch.backend_reasons(choice, int(backend)))
        return 0

    try:
        jax.eval_shape(probe, q, k, v, params.attn_mask)
    except (ValueError, TypeError) as e:
        reasons.append(f"invalid arguments: {e}")
    if debug:
        for r in reasons:
            warnings.warn(f"{backend.name} cannot be used: {r}", UserWarning, stacklevel=3)
    return not reasons


def can_use_flash_attention(params: SDPAParams, debug: bool = False) -> bool:
    """Whether FLASH_ATTENTION can run ``params`` here (the XLA implementation counts on CPU).

    ``debug=True`` warns once per failed constraint. Flags are not consulted (as in torch).

    Example:
      >>> import jax.numpy as jnp
      >>> from jbackends.attention import SDPAParams, can_use_flash_attention
      >>> x = jnp.ones((1, 2, 8, 16))
      >>> can_use_flash_attention(SDPAParams(x, x, x, None, 0.0, True, False))
      True
    """
    return _can_use(SDPBackend.FLASH_ATTENTION, params, debug)


def can_use_efficient_attention(params: SDPAParams, debug: bool = False) -> bool:
    """Whether EFFICIENT_ATTENTION can run ``params`` here (see :func:`can_use_flash_attention`)."""
    return _can_use(SDPBackend.EFFICIENT_ATTENTION, params, debug)


def can_use_cudnn_attention(params: SDPAParams, debug: bool = False) -> bool:
    """Whether CUDNN_ATTENTION can run ``params`` here (False on CPU, with the reason under debug)."""
    return _can_use(SDPBackend.CUDNN_ATTENTION, params, debug)


def is_flash_attention_available() -> bool:
    """Whether a FLASH_ATTENTION implementation exists for the default platform (always, via XLA)."""
    return bool(_sdpa_registry.implementations(_dispatch.FLASH, _dispatch.default_platform()))
