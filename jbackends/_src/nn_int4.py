"""flax nnx int4 layers: `Int4Linear` and `quantize_4bit(model, groupsize=...)`.

`Int4Linear` holds a truly packed 4-bit weight (uint8 nibbles, float32
scales, optional float32 bias) as `Int4Weight` variables, not `nnx.Param`:
they are checkpointed with the model (``nnx.state``/orbax) but an optimizer
filtering on `nnx.Param` leaves them alone. The matmul goes through
`jbackends.quantized`, so it follows the ``quantized_engine`` flag (Pallas on
GPU, the C++/XLA kernels on CPU).

Two modes:

* ``"weight_only"`` (default): `jbackends.quantized.int4_matmul` (W4A16 /
  W4A32), no activation quantization.
* ``"dyn_quant"``: `jbackends.quantized.dyn_quant_matmul_4bit` (torch's
  int8 dynamic activation quantization, W4A8 numerics).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jbackends import quantized as _q

__all__ = ["Int4Weight", "Int4Linear", "quantize_4bit"]

_MODES = ("weight_only", "dyn_quant")
_COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _float_dtype(name: str, value: Any, allowed: tuple | None = None) -> Any:
    """None, or ``value`` as a floating dtype (one of ``allowed`` when given); else a TypeError naming it."""
    if value is None:
        return None
    try:
        dt = jnp.dtype(value)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating) or (allowed and dt not in allowed):
        want = ", ".join(d.name for d in allowed) if allowed else "a floating dtype"
        raise TypeError(f"{name} must be None or {want}, got {value!r}")
    return dt


class Int4Weight(nnx.Variable):
    """A frozen leaf of a packed int4 weight (nibbles, scales, bias)."""


class Int4Linear(nnx.Module):
    """``y = x @ W.T + b`` with ``W`` stored as packed int4 (0.5 byte per weight).

    Build one from a float layer with `Int4Linear.from_linear`, or a whole
    model with `quantize_4bit`.

    The output dtype follows `nnx.Linear`: ``dtype`` when set (the input is
    cast to it first), else the promotion of the input with ``param_dtype``
    (`from_linear` copies both from the float layer, so a bfloat16 layer stays
    bfloat16), else the input's dtype (float32 for integer input).

    Args:
      packed: a `jbackends.quantized.PackedInt4Weight`.
      mode: "weight_only" (int4_matmul) or "dyn_quant" (dyn_quant_matmul_4bit).
      compute_dtype: operand dtype for weight-only matmuls (None: default).
      dtype: computation / output dtype, as `nnx.Linear`'s (None: promote).
      param_dtype: the float layer's parameter dtype, used in that promotion
        (the packed weight itself is uint8 + float32).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> lin = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
      >>> q = Int4Linear.from_linear(lin, groupsize=32)
      >>> q(jnp.ones((2, 64))).shape
      (2, 8)
    """

    def __init__(
        self,
        packed: _q.PackedInt4Weight,
        *,
        mode: str = "weight_only",
        compute_dtype: Any = None,
        dtype: Any = None,
        param_dtype: Any = None,
    ):
        if not isinstance(packed, _q.PackedInt4Weight):
            raise TypeError(f"packed must be a PackedInt4Weight, got {type(packed).__name__}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode=!r}")
        compute_dtype = _float_dtype("compute_dtype", compute_dtype, _COMPUTE_DTYPES)
        self.dtype = _float_dtype("dtype", dtype)
        self.param_dtype = _float_dtype("param_dtype", param_dtype)
        self.weight = Int4Weight(packed.weight)
        self.scales = Int4Weight(packed.scales)
        self.bias = Int4Weight(packed.bias) if packed.bias is not None else None
        self.groupsize = packed.groupsize
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        self.mode = mode
        self.compute_dtype = compute_dtype

    @classmethod
    def from_linear(
        cls, linear: nnx.Linear, groupsize: int, *, mode: str = "weight_only", compute_dtype: Any = None
    ) -> "Int4Linear":
        """Quantizes an `nnx.Linear` (kernel ``[in, out]``) to int4 with `quantize_4bit` rules."""
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"linear must be an nnx.Linear, got {type(linear).__name__}")
        w = jnp.asarray(linear.kernel[...]).T  # [out, in]
        K, N = linear.in_features, linear.out_features
        q, s = _q.quantize_4bit(w, groupsize)
        b = None if linear.bias is None else jnp.asarray(linear.bias[...])
        return cls(
            _q.dyn_quant_pack_4bit_weight(q, s, b, groupsize, K, N),
            mode=mode,
            compute_dtype=compute_dtype,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
        )

    @property
    def packed(self) -> _q.PackedInt4Weight:
        """The layer's weight as a `PackedInt4Weight`."""
        bias = None if self.bias is None else self.bias[...]
        return _q.PackedInt4Weight(
            self.weight[...], self.scales[...], bias, self.groupsize, self.in_features, self.out_features
        )

    def _out_dtype(self, x: jax.Array):
        if self.dtype is not None:
            return self.dtype
        if self.param_dtype is not None:
            dt = jnp.result_type(x.dtype, self.param_dtype)  # nnx's promote_dtype
        else:
            dt = x.dtype
        return dt if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x)
        out = self._out_dtype(x)
        x = x.astype(out)
        if self.mode == "dyn_quant":
            xd = x if x.dtype in (jnp.float32, jnp.bfloat16) else x.astype(jnp.float32)
            y = _q.dyn_quant_matmul_4bit(xd, self.packed, self.groupsize, self.in_features, self.out_features)
            return y.astype(out)
        xw = x if x.dtype in _COMPUTE_DTYPES else x.astype(jnp.float32)
        return _q.int4_matmul(xw, self.packed, compute_dtype=self.compute_dtype).astype(out)


def _set_child(parent: Any, key: Any, value: Any) -> None:
    """``parent``'s child ``key`` becomes ``value``: a module's attribute, or an item of a container
    (an `nnx.List` / `nnx.Dict` item, a dict or list held through `nnx.data`)."""
    if isinstance(parent, nnx.Module) and isinstance(key, str):
        setattr(parent, key, value)
    else:
        parent[key] = value


def quantize_4bit(
    model: nnx.Module,
    groupsize: int = 128,
    *,
    mode: str = "weight_only",
    compute_dtype: Any = None,
    filter: Any = None,
    channelwise_fallback: bool = True,
) -> nnx.Module:
    """Replaces ``model``'s `nnx.Linear` layers by `Int4Linear`, in place (inference).

    Every argument is checked, and every layer is quantized, before the model
    is changed: an error leaves it as it was. A layer reachable by several
    paths (weight tying) becomes one `Int4Linear`, at every path. Layers are
    found in attributes, `nnx.Sequential` / `nnx.List` / `nnx.Dict`, and plain
    containers held through `nnx.data` (a dict, a list; a tuple or namedtuple
    is rebuilt with the new layers, where it was held).

    Args:
      model: an `nnx.Module` graph (also a bare `nnx.Linear`, which is
        returned converted). Anything else is a TypeError.
      groupsize: quantization group along in_features: a positive multiple
        of 32 (torch's rule; ValueError otherwise).
      mode: "weight_only" or "dyn_quant" (see `Int4Linear`).
      compute_dtype: forwarded to `Int4Linear` (None, float32, bfloat16 or
        float16).
      filter: None or ``filter(path, linear) -> bool``; only layers it
        accepts are converted (default: all). A layer reachable by several
        paths is converted where it accepts every one of them.
      channelwise_fallback: a layer whose in_features is not a multiple of
        ``groupsize`` gets channel-wise scales (``groupsize = in_features``,
        the layer's `Int4Linear.groupsize` says so) instead of raising.

    Returns:
      The model (the same object unless ``model`` itself is an `nnx.Linear`).
      Each `Int4Linear` keeps its float layer's ``dtype`` / ``param_dtype``.

    Raises:
      TypeError: ``model`` is not an nnx module; ``groupsize`` is not an int;
        ``filter`` is not callable; ``channelwise_fallback`` is not a bool;
        ``compute_dtype`` is not a supported float dtype.
      ValueError: ``groupsize`` is not a positive multiple of 32; ``mode`` is
        unknown; a layer's in_features is not a multiple of ``groupsize``
        and ``channelwise_fallback`` is False (or in_features is odd); a
        layer's kernel is not 2-D (stacked layers, from `nnx.vmap`).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> mlp = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
      >>> mlp = quantize_4bit(mlp, groupsize=32)
      >>> type(mlp.layers[0]).__name__, mlp(jnp.ones((1, 64))).shape
      ('Int4Linear', (1, 4))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model must be a flax nnx.Module (a model, or an nnx.Linear), got {type(model).__name__}"
        )
    if isinstance(groupsize, bool) or not isinstance(groupsize, (int, np.integer)):
        raise TypeError(f"groupsize must be an int, got {groupsize!r}")
    if groupsize <= 0 or groupsize % 32:
        raise ValueError(f"groupsize must be a positive multiple of 32, got groupsize={groupsize}")
    groupsize = int(groupsize)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode=!r}")
    _float_dtype("compute_dtype", compute_dtype, _COMPUTE_DTYPES)
    if filter is not None and not callable(filter):
        raise TypeError(f"filter must be None or a callable (path, linear) -> bool, got {filter!r}")
    if not isinstance(channelwise_fallback, (bool, np.bool_)):
        raise TypeError(f"channelwise_fallback must be a bool, got {channelwise_fallback!r}")

    def convert(path, lin: nnx.Linear) -> Int4Linear:
        shape = tuple(np.shape(lin.kernel[...]))
        if len(shape) != 2:
            where = "/".join(map(str, path)) or "<root>"
            raise ValueError(
                f"layer {where}: kernel has shape {shape}, not [in_features, out_features]: stacked layers "
                "(made by nnx.vmap, run by nnx.scan) are not supported; leave them out with `filter` "
                "(the model is left unchanged)"
            )
        g = groupsize
        if lin.in_features % g:
            if not channelwise_fallback or lin.in_features % 2:
                where = "/".join(map(str, path)) or "<root>"
                why = (
                    "channelwise_fallback=False"
                    if not channelwise_fallback
                    else "and in_features is odd, so no channel-wise fallback (two int4 weights per byte)"
                )
                raise ValueError(
                    f"layer {where}: groupsize={g} does not divide in_features={lin.in_features} ({why})"
                )
            g = lin.in_features
        return Int4Linear.from_linear(lin, g, mode=mode, compute_dtype=compute_dtype)

    if isinstance(model, nnx.Linear):
        return convert((), model)
    # Every reference to every Linear: a layer reachable by several paths (weight tying, such as
    # ``self.dec = self.enc``) is one node, which `nnx.iter_graph` yields once.
    edges, paths, layers = [], {}, {}  # edges: (parent, key, child) for every child of every node
    nodes = {tuple(path): node for path, node in nnx.iter_graph(model)}
    for path, node in nodes.items():
        # `nnx.iter_children` does not yield pytree tuples, and `iter_graph` yields a tuple held twice
        # once: every tuple a module or container holds is an edge too.
        if isinstance(node, tuple) and path:
            edges.append((nodes[path[:-1]], path[-1], node))
        held = (
            vars(node).items()
            if isinstance(node, nnx.Module)
            else node.items()
            if isinstance(node, dict)
            else ()
        )
        edges.extend((node, key, child) for key, child in held if isinstance(child, tuple))
        try:
            children = list(nnx.iter_children(node))
        except ValueError:  # not a graph node (a Variable, an array, a static attribute)
            continue
        for key, child in children:
            edges.append((node, key, child))
            if isinstance(child, nnx.Linear):
                paths.setdefault(id(child), []).append(path + (key,))
                layers[id(child)] = child
    # A shared layer is converted where ``filter`` accepts every path to it (and then at each).
    chosen = {i: ps for i, ps in paths.items() if filter is None or all(filter(p, layers[i]) for p in ps)}
    replace = {i: convert(ps[0], layers[i]) for i, ps in chosen.items()}  # all or nothing

    def rebuilt(obj):
        """``obj`` with its converted layers: a tuple (immutable, held through `nnx.data`) holding
        one is rebuilt, and set where the tuple was."""
        if id(obj) in replace:
            return replace[id(obj)]
        if isinstance(obj, tuple):
            items = [rebuilt(x) for x in obj]
            if any(a is not b for a, b in zip(items, obj)):
                replace[id(obj)] = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
                return replace[id(obj)]
        return obj

    for parent, key, child in edges:
        if not isinstance(parent, tuple) and rebuilt(child) is not child:
            _set_child(parent, key, rebuilt(child))
    return model
