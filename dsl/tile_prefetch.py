"""``kiln.prefetch(g)``: start bringing a GlobalTile's bytes into L2, with nothing to wait for.

A hint for streaming kernels: a later :func:`kiln.copy` / :func:`kiln.load` of the tile then
reads L2 instead of DRAM, so fewer bytes a thread (or a ``cp.async`` request slot) wait a DRAM
round trip. No destination, no registers, no wait; no value a thread sees changes, so a
prefetch never needs a barrier, and one of memory another block writes is harmless.

==============================  ============================================================
target                          instructions
==============================  ============================================================
sm_90+, ``align >= 16``         per tile row, one ``cp.async.bulk.prefetch.L2.global`` of the
                                row's bytes inside the masks (rounded down to 16 bytes), the
                                rows spread over the block's threads (a one-row tile: thread 0)
other NVIDIA                    ``prefetch.global.L2``, one per 128-byte line, the lines
                                spread over the block's threads
AMD (gfx9)                      nothing: gfx9 has no L2 prefetch instruction
==============================  ============================================================

Rows past ``row_end`` and columns past ``col_end`` are not fetched. The interpreter runs
nothing (a prefetch changes no value).

Example (a persistent block streaming rows: the row after next comes from L2)::

    kiln.prefetch(kiln.GlobalTile(x, (1, BLOCK), (row + 2 * grid, 0), row_end=m, col_end=n,
                                  align=16))
"""

from __future__ import annotations

import contextlib

from mlir import ir
from mlir.dialects import scf

from . import builder, ops
from .core import dtypes as dt
from .core.errors import KilnTypeError
from .global_tile import GlobalTile
from .nvidia import tma
from .nvidia.sync import prefetch_l2
from .values import to_value

LINE_BYTES = 128   # the L2 line prefetch.global.L2 brings in
BULK_ALIGN = 16    # cp.async.bulk: 16-byte aligned address, a multiple of 16 bytes


@contextlib.contextmanager
def _when(condition):
    """Emit the body under ``scf.if condition`` (no else)."""
    branch = scf.IfOp(to_value(condition).ir)
    with ir.InsertionPoint(branch.then_block):
        yield
        scf.YieldOp([])


def _row_bytes(g: GlobalTile):
    """The i32 byte count of a tile row inside ``col_end`` (clamped to ``[0, cols]``)."""
    cols = g.shape[1]
    if g.col_end is None:
        return to_value(cols * g.dtype.itemsize, dt.i32)
    inside = ops.maximum(ops.minimum(to_value(g.col_end, dt.i32) - g.origin[1], cols), 0)
    return inside * g.dtype.itemsize


def prefetch(src: GlobalTile) -> None:
    """Start bringing ``src``'s bytes (inside its masks) into L2 (see the module table); the
    whole block makes the call, each thread issuing its share. Example:
    ``kiln.prefetch(kiln.GlobalTile(x, (1, BLOCK), (row + 2 * grid, 0), row_end=m,
    col_end=n, align=16))``."""
    if not isinstance(src, GlobalTile):
        raise KilnTypeError(f"kiln.prefetch takes a GlobalTile, got {type(src).__name__}",
                            fix="kiln.prefetch(kiln.GlobalTile(t, shape, origin, row_end=m))")
    target = builder.current_target()
    if not target.is_nvidia:
        return
    threads = builder.current().block[0]
    thread = ops.thread_id(0)
    rows, cols = src.shape
    if target.has("tma") and src.align is not None and src.align >= BULK_ALIGN:
        nbytes = _row_bytes(src) // BULK_ALIGN * BULK_ALIGN
        for r in range(rows):
            go = (thread == r % threads) & (nbytes > 0)
            valid = src.row_valid(r)
            go = go if valid is None else go & valid
            with _when(go):
                tma.bulk_prefetch(src.tensor.element_address(*src.indices(r, 0)), nbytes)
        return
    per_line = max(LINE_BYTES // src.dtype.itemsize, 1)
    lines = -(-cols // per_line)
    for k in range(-(-rows * lines // threads)):
        index = thread + k * threads
        r, col = index // lines, index % lines * per_line
        go = index < rows * lines
        if src.col_end is not None:
            go = go & (src.origin[1] + col < src.col_end)
        if src.row_end is not None:
            go = go & (src.origin[0] + r < src.row_end)
        with _when(go):
            prefetch_l2(src.tensor.element_address(*src.indices(r, col)))


__all__ = ["prefetch"]
