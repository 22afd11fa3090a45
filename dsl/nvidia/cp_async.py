"""``cp.async`` (sm_80+): asynchronous global -> shared copies of 4, 8 or 16 bytes per thread.

Semantics: :func:`copy` starts copying ``width`` elements from a GlobalTile position to a
SharedTile position and returns a :class:`Token`; bytes past ``src_elements`` (0 for masked
rows) are written as zeros. :func:`commit` closes the copies issued so far into a group
(``cp.async.commit_group``); :func:`wait` blocks until at most ``pending`` groups are still in
flight (``cp.async.wait_group``). Data is visible to the other threads after ``wait`` and a
``kiln.barrier()``. 16-byte copies bypass L1 (``cp.async.cg``), smaller ones use ``.ca``.

Built on ``nvgpu.device_async_copy`` / ``device_async_create_group`` / ``device_async_wait``.

Example (double buffering)::

    g = kiln.cp_async.commit([kiln.cp_async.copy(a_s, (r, c), a_g, (r, c), width=8)])
    kiln.cp_async.wait(pending=1)       # all but the newest group have landed
    kiln.barrier()
"""

from __future__ import annotations

from typing import Any, Sequence

from mlir import ir
from mlir.dialects import nvgpu

from .. import builder
from ..core.ops import CP_ASYNC, Effects, declare, int_attr
from ..core import dtypes as dt
from ..core.errors import KilnTypeError, KilnValueError
from ..global_tile import GlobalTile
from ..shared_tile import SharedTile
from ..tensor import to_index
from ..values import Handle, Value, cast
from .. import ops
from ..ops import where

COPY_BYTES = (4, 8, 16)


class Token(Handle):
    """An in-flight copy (``!nvgpu.device.async.token``); pass tokens to :func:`commit`."""


class Group(Handle):
    """A committed group of copies; :func:`wait` on it or by count."""


def _copied_to(op) -> tuple:
    """The shared buffers the copies of a cp.async group write (each copy's destination)."""
    copies = [t.owner.operation for t in op.operands if not isinstance(t.owner, ir.Block)]
    return tuple(c.operands[0] for c in copies if c.name == "nvgpu.device_async_copy")


# A copy is issued alone; its group (create_group) is the event that the wait retires.
COPY = declare("nvidia.cp_async.copy", feature="sm80", mlir_names=("nvgpu.device_async_copy",))
COMMIT = declare("nvidia.cp_async.commit", feature="sm80",
                 mlir_names=("nvgpu.device_async_create_group",),
                 effects=Effects(counter=CP_ASYNC, writes=_copied_to))
WAIT = declare("nvidia.cp_async.wait", feature="sm80", mlir_names=("nvgpu.device_async_wait",),
               effects=Effects(waits=lambda op: {CP_ASYNC: int_attr("numGroups", 0)(op)}))


def copy(dst: SharedTile, dst_pos: tuple[Any, Any], src: GlobalTile, src_pos: tuple[Any, Any], *,
         width: int, dst_offset: Any = None, src_row: ir.Value | None = None) -> Token:
    """Start copying ``src[src_pos .. +width]`` to ``dst[dst_pos .. +width]`` (along the row);
    masked source elements (rows past ``src.row_end``, columns past ``src.col_end``) fill zeros
    and read nothing (``cp.async``'s ``src-size``). ``dst_offset``: ``dst``'s element offset of
    ``dst_pos`` when the caller has it (e.g. an earlier chunk's plus a constant); ``src_row``:
    the tensor row of ``src_pos`` as an ``index`` (an earlier chunk's plus a constant, which
    LLVM's straight-line strength reduction turns into one add to that chunk's address)."""
    COPY.require(builder.current_target(), "cp_async.copy")
    if not isinstance(dst, SharedTile) or not isinstance(src, GlobalTile):
        raise KilnTypeError("cp_async.copy copies a GlobalTile into a SharedTile",
                            fix="wrap the tensor in kiln.tiles.GlobalTile and the buffer in "
                                "kiln.tiles.SharedTile")
    if src.dtype is not dst.dtype:
        raise KilnTypeError(f"cp_async.copy from {src.dtype} to {dst.dtype}",
                            fix="copy between tiles of the same dtype")
    nbytes = width * dst.dtype.itemsize if isinstance(width, int) else None
    if nbytes not in COPY_BYTES:
        raise KilnValueError(f"cp.async moves 4, 8 or 16 bytes; width={width!r} of {dst.dtype} "
                             f"is {nbytes} bytes",
                             fix=f"use width={16 // dst.dtype.itemsize} (16 bytes, cp.async.cg)")
    if not dst.contiguous_width(width):
        raise KilnValueError(f"{width}-element chunks are not contiguous in the SharedTile",
                             fix="use a narrower width or a coarser swizzle")
    if src.tensor.rank != 2:
        raise KilnTypeError("cp_async.copy reads a GlobalTile of a 2-D tensor",
                            fix="view the 1-D tensor as 2-D (one row) on the host")
    row, col = src.indices(*src_pos)
    valid = src.row_valid(src_pos[0])
    src_elements = None
    # A masked chunk keeps its (possibly out-of-bounds) address: cp.async with src-size 0
    # reads nothing, and an address affine in the loop's k lets LLVM hoist its arithmetic.
    if src.col_end is not None and src.col_multiple % width == 0:
        # whole chunks (col_end a multiple of the width): a 0-or-width source size, which
        # ptxas issues as a predicated copy instead of a partial zero fill
        src_elements = _select(col < src.col_end, width, 0)
    elif src.col_end is not None:
        src_elements = ops.minimum(ops.maximum(src.col_end - col, 0), width)
    if valid is not None:
        src_elements = _select(valid, width if src_elements is None else src_elements, 0)
    if src_elements is not None:
        src_elements = cast(src_elements, dt.index).ir
    dst_index = to_index(_as_i32(dst.offset(*dst_pos) if dst_offset is None else dst_offset))
    token = nvgpu.device_async_copy(dst.buffer.ir, [dst_index], src.tensor.ir,
                                    [to_index(row) if src_row is None else src_row,
                                     to_index(col)],
                                    ir.IntegerAttr.get(ir.IndexType.get(), width),
                                    src_elements=src_elements,
                                    bypass_l1=True if nbytes == 16 else None)
    return Token(token)


def _as_i32(x: Any) -> Any:
    return cast(x, dt.i32) if isinstance(x, Value) else x


def _select(cond: Value, a: Any, b: Any) -> Value:

    return where(cond, a, b)


def commit(tokens: Sequence[Token]) -> Group:
    """``cp.async.commit_group`` over ``tokens`` (the copies issued since the last commit)."""
    COMMIT.require(builder.current_target(), "cp_async.commit")
    if not tokens or not all(isinstance(t, Token) for t in tokens):
        raise KilnTypeError("cp_async.commit needs a non-empty list of cp_async.copy tokens",
                            fix="collect the values returned by kiln.cp_async.copy")
    return Group(nvgpu.device_async_create_group([t.ir for t in tokens]))


def wait(group: Group, *, pending: int = 0) -> None:
    """``cp.async.wait_group pending``: block until at most ``pending`` committed groups are in
    flight (0: everything, including ``group``, has landed)."""
    WAIT.require(builder.current_target(), "cp_async.wait")
    if not isinstance(group, Group):
        raise KilnTypeError(f"cp_async.wait needs a Group from cp_async.commit, got {group!r}",
                            fix="pass the value returned by kiln.cp_async.commit")
    if not isinstance(pending, int) or isinstance(pending, bool) or pending < 0:
        raise KilnValueError(f"pending must be an int >= 0, got {pending!r}",
                             fix="use 0 to wait for every group")
    nvgpu.device_async_wait(group.ir, num_groups=pending)
