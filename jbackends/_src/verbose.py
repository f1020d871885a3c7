"""Dispatch reporting for the scoped verbose mode (`jb.verbose(level)`, `jb.mkl.verbose(level)`).

Kernels call `report_dispatch(...)` when they choose a backend. When the `verbose` flag in force is 0 the
call returns after one attribute read. Otherwise one line per event goes to the `jbackends` logger:

    jbackends dispatch op=<op> chosen=<backend> shapes=<shapes> dtypes=<dtypes> rejected=<name: reason; ...>
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from jbackends._src import flags as _flags

logger = logging.getLogger("jbackends")


def report_dispatch(op: str, chosen: str, reasons: Mapping[str, str], shapes: tuple = (), dtypes: tuple = ()) -> None:
    """Log one dispatch decision if verbose is on (no cost beyond a flag read when off).

    Args:
      op: the operation, e.g. "sdpa" or "int4_matmul".
      chosen: the backend that will run.
      reasons: for each backend not taken, why.
      shapes: the argument shapes (tuples), in argument order.
      dtypes: the argument dtypes, in argument order.
    """
    if not _flags.current_flags().verbose:
        return
    rejected = "; ".join(f"{name}: {why}" for name, why in reasons.items()) or "-"
    shapes_s = ",".join("x".join(map(str, s)) if isinstance(s, tuple) else str(s) for s in shapes)
    dtypes_s = ",".join(str(d) for d in dtypes)
    logger.info("jbackends dispatch op=%s chosen=%s shapes=%s dtypes=%s rejected=%s",
                op, chosen, shapes_s, dtypes_s, rejected)
