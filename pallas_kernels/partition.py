"""Keep batch- and head-sharded inputs sharded through a kernel XLA cannot partition on its own.

XLA partitions ordinary ops by propagating shardings, but not a custom call (our C++ FFI kernels, our
Pallas kernels) nor a loop whose iteration axis folds the batch in (the blockwise XLA flash scans over
``batch x heads x blocks``): it gathers such a kernel's inputs onto every device and replicates its
outputs, which silently serialises a data-parallel run. :func:`sharded` wraps a kernel in
``jax.experimental.custom_partitioning`` with a rule that names, per operand dimension, a *factor*
(``"b"`` batch, ``"t"`` query position, ...): factors in ``parallel`` keep the sharding the inputs
arrive with, and the kernel then runs once per shard on its local block with no collective; every
other factor (sequence, head dim) is replicated, as the kernel needs whole rows.

The rule is given both ways JAX partitions: as a Shardy sharding rule, and as the GSPMD callbacks.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from pallas_kernels import partition
  >>> f = partition.sharded(lambda x: (jnp.cumsum(x, axis=1),), in_factors=(("b", "t"),),
  ...                       out_factors=(("b", "t"),), parallel=("b",))
  >>> f(jnp.ones((2, 3)))[0].tolist()
  [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import per_shard_lowering

__all__ = [
    "sharded",
    "sharded_vjp",
    "manual_axis_type",
    "varying_axes",
    "vary",
    "vary_like",
    "vma_like",
    "Factor",
]

#: A dimension's factor: a name, or a tuple of names for a dimension that is a product of factors
#: (row-major: ``("k", "g")`` is the query-head dimension ``n = k * G + g`` of grouped attention).
Factor = Union[str, Tuple[str, ...]]


def _names(f: Factor) -> Tuple[str, ...]:
    return (f,) if isinstance(f, str) else tuple(f)


def _rule(in_factors, out_factors) -> str:
    def dims(fs):
        return " ".join(f if isinstance(f, str) else "(" + " ".join(f) + ")" for f in fs)

    return ", ".join(dims(fs) for fs in in_factors) + " -> " + ", ".join(dims(fs) for fs in out_factors)


def _axis_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _as_axes(entry) -> Tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_of(sharding, ndim: int):
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (ndim - len(spec))


def _decoded(sharding, mesh, ndim):
    """An operand's sharding as a NamedSharding over ``mesh``, or None where it is none or cannot be one.

    The partitioner is asked for raw (GSPMD) shardings, since JAX's own decoding raises on a sharding
    that splits a dimension over part of a mesh axis, or over axes in another device order. Shardy
    gives such a split to a compound dimension's major factor: q's heads ``(k, g)`` split 4 ways over
    K = 2 kv heads put half an axis on the kv heads of the backward's gradients. Results are then not
    decoded at all (the rule here never reads them), and an operand that cannot be decoded is treated
    as unsplit: the kernel asks for it gathered, and XLA reshards it.
    """
    if sharding is None or isinstance(sharding, NamedSharding):
        return sharding
    hlo = getattr(sharding, "_hlo_sharding", None)
    if hlo is None or mesh is None or mesh.empty:
        return None
    try:
        from jax._src.sharding_impls import parse_flatten_op_sharding  # noqa: PLC0415

        spec = tuple(parse_flatten_op_sharding(hlo, mesh)[0])
    except Exception:  # noqa: BLE001 - IndivisibleError, AssertionError, KeyError (jax 0.10-0.12)
        return None
    return NamedSharding(mesh, P(*spec, *((None,) * (ndim - len(spec)))))


def _choose(mesh, shapes, shardings, in_factors, parallel, sizes):
    """Mesh axes per parallel factor: those of the first operand that shards it (whole factors only)."""
    chosen, used = {}, set()
    for name in parallel:
        for shape, sharding, factors in zip(shapes, shardings, in_factors):
            if sharding is None or not isinstance(sharding, NamedSharding):
                continue
            spec = _spec_of(sharding, len(shape))
            for dim, f in enumerate(factors):
                names = _names(f)
                if names[0] != name:  # a compound dimension is split along its major factor only
                    continue
                axes = _as_axes(spec[dim])
                if not axes or used & set(axes):
                    continue
                n = _axis_size(mesh, axes)
                if sizes[name] % n == 0:
                    chosen[name] = axes
                    used |= set(axes)
                    break
            if name in chosen:
                break
    return chosen


def _specs(mesh, factors_list, chosen):
    out = []
    for factors in factors_list:
        entries = []
        for f in factors:
            axes = chosen.get(_names(f)[0])
            entries.append(None if axes is None else (axes[0] if len(axes) == 1 else axes))
        out.append(NamedSharding(mesh, P(*entries)))
    return out


def _explicit_axes(mesh) -> set:
    types = getattr(mesh, "axis_types", None)
    if not types or mesh.empty:
        return set()
    return {n for n, t in zip(mesh.axis_names, types) if "Explicit" in str(t)}


def _explicit_mesh(operands):
    """The mesh of operands typed with Explicit sharding (``jax.make_mesh``'s default in new JAX).

    That is the mesh of an operand sharded along an Explicit axis; else a mesh with an Explicit axis
    (an operand's, or the one `jax.set_mesh` or a `shard_map` over some of its axes put in force):
    XLA refuses `custom_partitioning`'s custom call in such a program, so the kernel runs whole along
    the axes its operands' types do not split (an operand split along an Auto axis of a mixed mesh
    is gathered along it)."""
    typed = []
    for x in operands:
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        explicit = _explicit_axes(mesh)
        if explicit & {a for e in sharding.spec for a in _as_axes(e)}:
            return mesh
        typed.append(mesh)
    for mesh in typed + [jax.sharding.get_abstract_mesh()]:
        explicit = _explicit_axes(mesh)
        if explicit:
            return mesh
    return None


def manual_axis_type(x):
    """The `shard_map` axis typing of ``x`` (which mesh axes it varies over); None outside JAX types
    (outside `shard_map`, or under ``check_vma=False``, its ``varying`` is empty)."""
    return getattr(jax.typeof(x), "manual_axis_type", None)


def _varying(x) -> Optional[set]:
    t = manual_axis_type(x)
    return None if t is None else set(getattr(t, "varying", ()) or ())


def varying_axes(*trees) -> Tuple[str, ...]:
    """The `shard_map` axes any leaf of ``trees`` varies over, sorted (loop carries and kernel
    results computed from them must vary over them too)."""
    axes: set = set()
    for x in jax.tree.leaves(trees):
        axes |= _varying(x) or set()
    return tuple(sorted(axes))


def vary(tree, axes):
    """Every leaf of ``tree`` cast to vary over ``axes`` as well (``lax.pcast``); leaves outside JAX
    types as they are."""
    if not axes:
        return tree

    def one(x):
        have = _varying(x)
        if have is None or not (missing := tuple(a for a in axes if a not in have)):
            return x
        return jax.lax.pcast(x, missing, to="varying")

    return jax.tree.map(one, tree)


def vary_like(out, *likes):
    """``out`` typed as varying over every `shard_map` axis any of ``likes`` varies over.

    A kernel's custom call (``ffi_call``) types its result as the same on every device; computed
    per shard from operands that vary, it varies like them (unsaid, a ``shard_map`` with
    ``out_specs=P()`` would keep one device's block). Outside `shard_map`, ``out`` as is."""
    return vary(out, varying_axes(*(x for x in likes if x is not None)))


def vma_like(g, x):
    """A gradient ``g`` typed over the `shard_map` axes its primal ``x`` varies over.

    Inside `shard_map`, a primal that is the same on every device (a replicated key or weight used with
    sharded queries) gets a per-device partial gradient from a kernel: JAX's own autodiff sums it across
    those devices (the transpose of the implicit `pcast` to varying), and a `custom_vjp` rule must do
    the same, or JAX refuses its output type. A primal that varies over an axis the gradient does not
    gets the gradient cast to varying. Outside `shard_map` (or with ``check_vma=False``) ``g`` as is.
    """
    have, want = _varying(g), _varying(x)
    if have is None or want is None:
        return g
    if extra := tuple(sorted(have - want)):
        g = jax.lax.psum(g, extra)
    if missing := tuple(sorted(want - have)):
        g = jax.lax.pcast(g, missing, to="varying")
    return g


def with_auto_axes(fn: Callable, operands: Sequence, like: Sequence) -> tuple:
    """``fn(*operands)`` (a tuple), typed for Explicit sharding.

    Where an operand is typed with Explicit sharding, ``fn`` runs with the mesh's axes made automatic
    (`jax.sharding.auto_axes`): shardings propagate as on an Auto mesh (a contraction over sharded
    dims need not name its result's sharding), and result ``i`` comes out typed like ``like[i]``.
    Elsewhere it is a plain call."""
    mesh = _explicit_mesh(operands)
    if mesh is None:
        return tuple(fn(*operands))
    out = tuple(NamedSharding(mesh, P(*_spec_of(jax.typeof(a).sharding, a.ndim))) for a in like)
    with jax.sharding.use_abstract_mesh(mesh):
        return tuple(jax.sharding.auto_axes(fn, out_sharding=out)(*operands))


def _shard_mapped(local, choose, mesh, operands, in_factors, out_factors):
    """Explicit sharding (known at trace time): the kernel under ``shard_map`` over the chosen axes.

    Operands sharded along other factors are first made whole along them (``reshard``): that is the
    one collective, and it is what the kernel needs.
    """
    shardings = [jax.typeof(x).sharding for x in operands]
    chosen, base_fn = choose(mesh, [x.shape for x in operands], shardings)
    want_in = _specs(mesh, in_factors, chosen)
    specs_in = [s.spec for s in want_in]
    specs_out = [s.spec for s in _specs(mesh, out_factors, chosen)]
    operands = [
        x
        if _spec_of(jax.typeof(x).sharding, x.ndim) == _spec_of(want, x.ndim)
        else jax.sharding.reshard(x, want)
        for x, want in zip(operands, want_in)
    ]
    fn = local(chosen, base_fn)
    if not chosen:
        return tuple(fn(*operands))
    axes = {a for v in chosen.values() for a in v}
    mapped = jax.shard_map(
        lambda *xs: tuple(fn(*xs)),
        mesh=mesh,
        in_specs=tuple(specs_in),
        out_specs=tuple(specs_out),
        axis_names=axes,
        check_vma=False,
    )
    return mapped(*operands)


def _normalise(factors_list, sizes):
    out = []
    for fs in factors_list:
        dims = []
        for f in fs:
            if not isinstance(f, str):
                kept = tuple(n for n in f if sizes.get(n, 0) != 1) or (f[0],)
                f = kept[0] if len(kept) == 1 else kept
            dims.append(f)
        out.append(tuple(dims))
    return tuple(out)


def sharded(
    fn: Callable,
    *,
    in_factors: Sequence[Sequence[Factor]],
    out_factors: Sequence[Sequence[Factor]],
    parallel: Sequence[str],
    partial_sums: Optional[dict] = None,
    ring: Optional[Tuple[Tuple[str, ...], Callable]] = None,
    name: Optional[str] = None,
) -> Callable:
    """``fn`` (arrays -> tuple of arrays) partitioned along the ``parallel`` factors.

    Args:
      fn: the kernel; called once per shard with the local blocks, so it must read every size from its
        operands' shapes (never from a closure over the global shapes). Returns a tuple of arrays.
      in_factors: one tuple per operand, one :data:`Factor` per dimension. A size-1 broadcast dimension
        must get a factor of its own (it is never split).
      out_factors: the same for each output.
      parallel: the factors that may stay sharded (e.g. ``("b", "k")``); all others are replicated.
      partial_sums: ``{output index: factors}`` for outputs that each shard computes as a partial sum
        over those factors (the gradient of a bias broadcast over the batch): they are summed across
        the devices that split those factors (the one collective such an output needs).
      ring: ``(factors, make)``: when the operands arrive split along the first of these factors (the
        sequence), every one of them is split along the same mesh axes and each shard runs
        ``make(axes, n)`` (``n`` devices along ``axes``) instead of ``fn``: a function of the local
        blocks that may use collectives over ``axes`` (a ring), or None to decline that split.
        Without it (or declined) those factors are gathered.
      name: a name for error messages.

    Returns:
      A function of the same operands. Outside a partitioned computation (one device) it is ``fn``.

    Raises:
      ValueError: a factor in ``parallel`` appears in no operand, or the factors do not match the
        operands' ranks (checked at the call).
    """
    in_factors = tuple(tuple(fs) for fs in in_factors)
    out_factors = tuple(tuple(fs) for fs in out_factors)
    parallel = tuple(parallel)
    label = name or getattr(fn, "__name__", "kernel")
    partial_sums = dict(partial_sums or {})
    all_names = {n for fs in in_factors + out_factors for f in fs for n in _names(f)}
    missing = [p for p in parallel if p not in all_names]
    if missing:
        raise ValueError(f"sharded({label}): parallel factors {missing} appear in no operand")

    def call(*operands):
        if len(operands) != len(in_factors):
            raise ValueError(
                f"sharded({label}): {len(operands)} operands for {len(in_factors)} factor tuples"
            )
        sizes, whole = {}, set()
        for x, fs in zip(operands, in_factors):
            if x.ndim != len(fs):
                raise ValueError(f"sharded({label}): an operand of shape {x.shape} has factors {fs}")
            for d, f in zip(x.shape, fs):
                if isinstance(f, str):
                    sizes[f] = d
                    whole.add(f)
        for x, fs in zip(operands, in_factors):  # sizes of factors seen only inside a compound dim
            for d, f in zip(x.shape, fs):
                if not isinstance(f, str):
                    known = math.prod(sizes.get(n, 1) for n in f if n in sizes)
                    unknown = [n for n in f if n not in sizes]
                    if len(unknown) == 1:
                        sizes[unknown[0]] = d // max(known, 1)
        # Shardy refuses size-1 parts of a compound dimension (no GQA: g = 1; MQA: k = 1): drop them.
        ins, outs = _normalise(in_factors, sizes), _normalise(out_factors, sizes)
        names = {n for fs in ins + outs for f in fs for n in _names(f)}
        whole = {f for fs in ins + outs for f in fs if isinstance(f, str)}
        compound_only = {n: sizes[n] for n in names if n not in whole}
        # Shardy wants special factors in the order the rule first names them.
        order = [n for fs in ins + outs for f in fs for n in _names(f)]
        ring_names = () if ring is None else tuple(ring[0])
        replicated = tuple(
            sorted((n for n in names if n not in parallel and n not in ring_names), key=order.index)
        )

        def choose(mesh, shapes, shardings):
            """(chosen axes per factor, the per-shard base function)."""
            chosen = _choose(mesh, shapes, shardings, ins, parallel, sizes)
            if ring is None:
                return chosen, fn
            axes = _choose(mesh, shapes, shardings, ins, ring_names[:1], sizes).get(ring_names[0])
            used = {a for v in chosen.values() for a in v}
            if not axes or used & set(axes) or any(sizes[f] % _axis_size(mesh, axes) for f in ring_names):
                return chosen, fn
            ring_fn = ring[1](axes, _axis_size(mesh, axes))
            if ring_fn is None:  # the ring declines this split: gather along the sequence
                return chosen, fn
            chosen.update({f: axes for f in ring_names})
            return chosen, ring_fn

        def local(chosen, base_fn):
            """The per-shard function: ``base_fn``, then the partial sums across the devices that split
            them."""
            if not any(f in chosen for fs in partial_sums.values() for f in fs):
                return base_fn

            def run_local(*xs):
                res = list(base_fn(*xs))
                for i, fs in partial_sums.items():
                    axes = tuple(a for f in fs if f in chosen for a in chosen[f])
                    if axes:
                        res[i] = jax.lax.psum(res[i], axes)
                return tuple(res)

            return run_local

        explicit = _explicit_mesh(operands)
        if explicit is not None:
            return _shard_mapped(local, choose, explicit, operands, ins, outs)

        cp = custom_partitioning(fn)

        def arg_shardings(mesh, arg_shapes):
            return [_decoded(a.sharding, mesh, len(a.shape)) for a in arg_shapes]

        def partition(mesh, arg_shapes, result_shape):
            chosen, base_fn = choose(mesh, [a.shape for a in arg_shapes], arg_shardings(mesh, arg_shapes))
            per_shard = local(chosen, base_fn)
            if per_shard_lowering.NEEDED:
                per_shard = per_shard_lowering.without_stack_frames(per_shard)
            return (
                mesh,
                per_shard,
                tuple(_specs(mesh, outs, chosen)),
                tuple(_specs(mesh, ins, chosen)),
            )

        def infer(mesh, arg_shapes, result_shape):
            chosen, _ = choose(mesh, [a.shape for a in arg_shapes], arg_shardings(mesh, arg_shapes))
            return tuple(_specs(mesh, outs, chosen))

        cp.def_partition(
            partition,
            infer_sharding_from_operands=infer,
            decode_shardings=False,  # decoded by `_decoded`, which survives sub-axis shardings
            sharding_rule=_rule(ins, outs),
            need_replication_factors=replicated,
            **compound_only,
        )

        # custom_partitioning has no batching rule: under vmap the kernel runs batched, unpartitioned.
        @jax.custom_batching.custom_vmap
        def run(*xs):
            return tuple(cp(*xs))

        @run.def_vmap
        def _run_batched(axis_size, in_batched, *xs):
            del axis_size
            outs = jax.vmap(lambda *a: tuple(fn(*a)), in_axes=tuple(0 if b else None for b in in_batched))(
                *xs
            )
            return outs, tuple(True for _ in outs)

        return run(*operands)

    return call


def _typed_like(g, x):
    """``g`` resharded to ``x``'s sharding type where the two differ (Explicit mode only)."""
    want, have = getattr(jax.typeof(x), "sharding", None), getattr(jax.typeof(g), "sharding", None)
    if want is None or have is None or _explicit_mesh((x, g)) is None:
        return g
    if _spec_of(want, x.ndim) == _spec_of(have, g.ndim):
        return g
    return jax.sharding.reshard(g, want)


def sharded_vjp(
    fwd: Callable,
    bwd: Callable,
    *,
    in_factors: Sequence[Sequence[Factor]],
    out_factors: Sequence[Sequence[Factor]],
    parallel: Sequence[str],
    diff: Sequence[int],
    grad_partial_sums: Optional[dict] = None,
    skippable: Sequence[int] = (),
    ring: Optional[tuple] = None,
    bwd_derivative: Optional[Callable] = None,
    name: Optional[str] = None,
) -> Callable:
    """A differentiable kernel whose forward and backward are each :func:`sharded`.

    Args:
      fwd: ``fwd(*xs) -> outs`` (a tuple), the forward kernel.
      bwd: ``bwd(*xs, *outs, *cotangents) -> grads``, one gradient per index in ``diff`` (the
        backward kernel, given the forward's outputs as residuals). With ``skippable``, it is called
        with a keyword ``skip``: the operand indices whose gradient nobody asked for (their entry may
        be None; it is not used).
      in_factors, out_factors, parallel, name: as for :func:`sharded` (cotangents take the outputs'
        factors, gradients their operands').
      diff: indices of the operands that get gradients (the others, integer lengths or ids, get none).
      grad_partial_sums: ``{operand index: factors}``: that operand's gradient is a partial sum over
        those factors on each shard (a bias broadcast over the batch); see :func:`sharded`.
      skippable: indices in ``diff`` whose gradient ``bwd`` can skip when that operand is not
        differentiated (a bias used as a mask).
      ring: ``(factors, make_fwd, make_bwd)``: the :func:`sharded` ``ring`` of the forward and of the
        backward (``make_bwd(axes, n)`` takes the backward's operands, with no ``skip``).
      bwd_derivative: a differentiable function with ``bwd``'s signature and values (the backward in a
        plain formulation), differentiated instead of ``bwd`` for second order (grad of grad); by
        default ``bwd`` itself.

    Returns:
      ``call(*xs) -> outs``, reverse-mode differentiable w.r.t. ``xs[i]`` for ``i in diff``, to any
      order: the second differentiates ``bwd_derivative`` (or ``bwd``), unpartitioned.
    """
    in_factors = tuple(tuple(fs) for fs in in_factors)
    out_factors = tuple(tuple(fs) for fs in out_factors)
    diff, skippable = tuple(diff), tuple(skippable)
    label = name or getattr(fwd, "__name__", "kernel")
    fwd_sh = sharded(
        fwd,
        in_factors=in_factors,
        out_factors=out_factors,
        parallel=parallel,
        ring=None if ring is None else (ring[0], ring[1]),
        name=label + " forward",
    )
    grad_partial_sums = dict(grad_partial_sums or {})

    def backward_for(skip):
        """The differentiable, partitioned backward computing the gradients not in ``skip``."""
        want = tuple(i for i in diff if i not in skip)

        def wanted(f):
            def run(*a):
                grads = f(*a, skip=skip) if skippable else f(*a)
                return tuple(g for i, g in zip(diff, grads) if i not in skip)

            return run

        bwd_wanted = wanted(bwd)
        bwd_plain = wanted(bwd_derivative) if bwd_derivative is not None else bwd_wanted

        bwd_ring = None if ring is None or skip else (ring[0], ring[2])
        bwd_sh = sharded(
            bwd_wanted,
            in_factors=in_factors + out_factors + out_factors,
            out_factors=tuple(in_factors[i] for i in want),
            parallel=parallel,
            partial_sums={want.index(i): fs for i, fs in grad_partial_sums.items() if i in want},
            ring=bwd_ring,
            name=label + " backward",
        )

        @jax.custom_vjp
        def backward(*a):
            return tuple(bwd_sh(*a))

        def backward_fwd(*a):
            return tuple(bwd_sh(*a)), a

        def backward_bwd(a, ct):
            return jax.vjp(bwd_plain, *a)[1](tuple(ct))

        backward.defvjp(backward_fwd, backward_bwd)
        return want, backward

    @jax.custom_vjp
    def call(*xs):
        return tuple(fwd_sh(*xs))

    def call_fwd(*xs):
        skip = () if not skippable else tuple(i for i in skippable if not xs[i].perturbed)
        xs = tuple(x.value for x in xs) if skippable else xs
        outs = tuple(call(*xs))  # through `call`, so that this rule is differentiable again
        flags = tuple(None if i in skip else () for i in skippable)  # static: pytree structure only
        return outs, (xs, outs, flags)

    def call_bwd(res, cts):
        xs, outs, flags = res
        skip = tuple(i for i, f in zip(skippable, flags) if f is None)
        if skippable:
            cts = tuple(
                jnp.zeros(o.shape, o.dtype) if isinstance(c, SymbolicZero) else c for c, o in zip(cts, outs)
            )
        want, backward = backward_for(frozenset(skip))
        grads = backward(*xs, *outs, *cts)
        full = [None] * len(xs)
        for i, g in zip(want, grads):
            full[i] = _typed_like(vma_like(g, xs[i]), xs[i])
        return tuple(full)

    call.defvjp(call_fwd, call_bwd, symbolic_zeros=bool(skippable))
    return call
