"""A workaround for jaxlib 0.10: the per-shard function of a ``custom_partitioning`` rule lowered as one
primitive without stack-frame locations (used by :mod:`pallas_kernels.partition` on that version only).

jaxlib 0.10's XLA keeps the stack frames (Python tracebacks) of the per-shard module that the
custom_partitioning callback lowers on its instructions, but does not merge that module's
stack-frame table into the partitioned module's: after SPMD partitioning those instructions carry
ids of the other table, most past the end of the module's own. The next pass that inlines a call
or a while body (CallInliner, run by WhileLoopSimplifier on the kernels' loops) follows them as
parent chains (PropagateCallMetadata -> StackFrames::IsPrefix) through whatever lies past the
table and, depending on the two tables' sizes, never returns: the compile hangs. The sizes depend
on the caller's Python stack depth and on the jaxprs earlier traces cached, hence a hang under
pytest or after another sharded compile only. On that jaxlib the per-shard function is therefore
lowered with no traceback locations (op names only): no stack-frame id, the same computation.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
from jax.interpreters import mlir

__all__ = ["NEEDED", "without_stack_frames"]

#: Whether this JAX needs it (jaxlib < 0.11).
NEEDED = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)

_per_shard_p = jex_core.Primitive("sharded_kernel_per_shard")
_per_shard_p.multiple_results = True
_per_shard_p.def_abstract_eval(lambda *avals, jaxpr: jaxpr.out_avals)


def _per_shard_lowering(ctx, *args, jaxpr):
    # jax 0.10 internals (this path runs on that version only): traceback locations of 0 frames.
    from jax._src import config  # noqa: PLC0415
    from jax._src.interpreters import mlir as mlir_internal  # noqa: PLC0415

    with config.include_full_tracebacks_in_locations(True), config.traceback_in_locations_limit(0):
        caches = mlir_internal.TracebackCaches()
        module = ctx.module_context.replace(traceback_caches=caches)
        return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(
            ctx.replace(module_context=module), *args
        )


mlir.register_lowering(_per_shard_p, _per_shard_lowering)


def without_stack_frames(fn):
    """``fn`` (the per-shard function) as one primitive lowered without stack-frame locations."""

    def run(*xs):
        closed = jax.make_jaxpr(lambda *a: tuple(fn(*a)))(*xs)
        return tuple(_per_shard_p.bind(*xs, jaxpr=closed))

    return run
