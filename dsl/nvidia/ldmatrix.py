"""``ldmatrix``: a warp loads 8x8 blocks of 16-bit elements from shared memory (sm_75+).

Semantics of ``ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (``nvgpu.ldmatrix``):
for block ``i`` (``i < num``), lane ``8 * i + r`` supplies the address of the block's row ``r``
(8 contiguous elements). Every lane ``l`` receives two elements of each block: without
``.trans`` row ``l // 4``, columns ``2 * (l % 4) + {0, 1}``; with ``.trans`` the same positions of
the transposed block (column ``l // 4``, rows ``2 * (l % 4) + {0, 1}``). The result is
``vector<2*num x T>``, block ``i`` in elements ``2i, 2i+1``.

:func:`load_a` and :func:`load_b` arrange the blocks so the result is exactly an ``mma.sync``
m16n8k16 A or B fragment (:func:`~kiln.layout.mma_m16n8k16_a` / ``_b``); row addresses go
through :meth:`SharedTile.offset`, so swizzled tiles work unchanged.

:func:`stmatrix` (sm_90) is the inverse: ``stmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16``
stores the same fragments, lane ``8 * i + r`` supplying the address of row ``r`` of block ``i``,
e.g. an ``mma.sync``/WGMMA accumulator cast to bf16 on its way to a TMA store.

Example::

    a = kiln.ldmatrix.load_a(a_s, (row0, k0))              # A tile stored M x K
    b = kiln.ldmatrix.load_b(b_s, (k0, col0), trans=True)  # B tile stored K x N (N contiguous)
    kiln.ldmatrix.stmatrix(c_s, (row0, col0), [(0, 0), (8, 0)], c_fragment)  # 2 blocks back
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mlir import ir
from mlir.dialects import nvgpu, vector

from .. import builder, ops
from ..core.ops import Effects, declare, op_args
from ..core.errors import KilnTypeError, KilnValueError, TargetError
from ..reg_tile import _concat
from ..shared_tile import SharedTile
from ..tensor import to_index
from ..values import Value

BLOCK = 8
A_BLOCKS = ((0, 0), (8, 0), (0, 8), (8, 8))  # a0a1, a2a3, a4a5, a6a7 of the m16n8k16 A fragment


def _check(tile: SharedTile, num: int) -> None:
    target = builder.current_target()
    if not target.is_nvidia:
        raise TargetError(f"ldmatrix is an NVIDIA instruction; {target.name} does not have it",
                          fix="on AMD use kiln.loader.TiledMmaLoader or SharedTile.load_fragments")
    if not isinstance(tile, SharedTile) or tile.dtype.bits != 16:
        raise KilnTypeError(f"ldmatrix loads 16-bit SharedTiles, got {tile!r}",
                            fix="use a bf16/f16 kiln.tiles.SharedTile")
    if num not in (1, 2, 4):
        raise KilnValueError(f"ldmatrix loads 1, 2 or 4 blocks, got {num!r}", fix="use 1, 2 or 4")
    if not tile.contiguous_width(BLOCK):
        raise KilnValueError(f"ldmatrix needs 8-element rows contiguous in the SharedTile "
                             f"(layout {tile.layout}, swizzle {tile.swizzle})",
                             fix="use a swizzle that moves 16-byte chunks, e.g. Swizzle.sw128b(2)")


def ldmatrix(tile: SharedTile, origin: tuple[Any, Any], blocks: Sequence[tuple[int, int]], *,
             trans: bool = False, offset: Any = None) -> Value:
    """Load ``len(blocks)`` 8x8 blocks whose top-left corners are ``origin + blocks[i]``
    (tile row, column); returns this lane's ``vector<2*num x T>`` (see the module docs).
    ``offset``: this lane's :func:`row_offset` for ``origin`` when the caller has it (e.g. that
    of another origin plus a constant), so loads can share one address register.

    Example: ``ldmatrix(tile, (r0, c0), [(0, 0), (0, 8)])`` loads two side-by-side blocks.
    """
    num = len(blocks)
    _check(tile, num)
    if offset is None:
        offset = row_offset(tile, origin, blocks, ops.lane_id())
    elem = tile.dtype.mlir_type()
    result = nvgpu.ldmatrix(ir.VectorType.get([num, 2], elem), tile.buffer.ir,
                            [to_index(offset)], trans, num)
    pairs = [vector.extract(result, [], [i]) for i in range(num)]
    return Value(_concat(pairs), tile.dtype)


def row_offset(tile: SharedTile, origin: tuple[Any, Any], blocks: Sequence[tuple[int, int]],
               lane: Any) -> Any:
    """The SharedTile offset of the row ``lane`` supplies: row ``lane % 8`` of block
    ``(lane // 8) % len(blocks)``. Evaluates traced values and numpy lane arrays alike."""
    num = len(blocks)
    block, row = (lane // BLOCK) % num, lane % BLOCK
    dr, dc = _select(block, [b[0] for b in blocks]), _select(block, [b[1] for b in blocks])
    return tile.offset(origin[0] + dr + row, origin[1] + dc)


def _select(index: Any, table: list[int]) -> Any:
    """``table[index]``: a Python int when constant, numpy indexing for arrays, else a chain
    of ``kiln.where``."""
    if len(set(table)) == 1:
        return table[0]
    if not isinstance(index, Value):
        return np.asarray(table)[index]
    result = table[-1]
    for i in range(len(table) - 2, -1, -1):
        result = ops.where(index == i, table[i], result)
    return result


def load_a(tile: SharedTile, origin: tuple[Any, Any]) -> Value:
    """The m16n8k16 A fragment (``vector<8xT>``) of the 16x16 block at ``origin`` of an M x K
    tile (``ldmatrix.x4``)."""
    return ldmatrix(tile, origin, A_BLOCKS)


def load_b(tile: SharedTile, origin: tuple[Any, Any], *, trans: bool = False) -> Value:
    """The m16n8k16 B fragment (``vector<4xT>``) of the 16(k) x 8(n) block at ``origin``.

    ``trans=False``: the tile is stored N x K (K contiguous) and ``origin`` is ``(n0, k0)``;
    ``trans=True``: stored K x N (N contiguous), ``origin`` is ``(k0, n0)`` (``ldmatrix.trans``).
    """
    blocks = ((0, 0), (8, 0)) if trans else ((0, 0), (0, 8))
    return ldmatrix(tile, origin, blocks, trans=trans)


# ---- stmatrix: declared through the op registry (docs/architecture.md, "Adding an op") --------

def _stmatrix_semantics(op, plan):
    """Interpreter semantics of :data:`STMATRIX`: per warp, write each lane's two elements of
    every block at the row addresses lanes ``8i .. 8i+7`` supply (transposed with ``trans``)."""
    args = op_args(op)
    num, trans = args["num"], bool(args["trans"])
    address, *registers = plan.operands(op)
    loc = plan.location(op)
    lane = np.arange(32)
    row, col = lane // 4, 2 * (lane % 4)  # this lane's two elements of a block: (row, col + 0/1)

    def run(env, ctx):
        n = ctx.size
        addrs = np.broadcast_to(env[address], (n,)).astype(np.int64)
        packed = np.stack([np.broadcast_to(env[r], (n,)) for r in registers], axis=1)
        halves = np.ascontiguousarray(packed.astype(np.int32)).view(np.uint16)  # [n, 2 * num]
        active = ctx.active()
        shared = ctx.cta.shared
        for start in range(0, n, 32):
            lanes = np.arange(start, start + 32)
            if not active[lanes].any():
                continue
            if not active[lanes].all():
                raise KilnValueError("stmatrix is .sync.aligned: all 32 lanes of a warp must "
                                     "execute it", fix="call it outside lane-divergent branches",
                                     loc=loc)
            targets = []
            for i in range(num):
                rows = addrs[lanes[8 * i:8 * i + 8]]  # byte address of each row of block i
                for half in (0, 1):
                    # Element (row, col + half) of block i; .trans stores it at (col + half, row).
                    at = rows[col + half] + 2 * row if trans else rows[row] + 2 * (col + half)
                    targets.append((at, halves[lanes, 2 * i + half]))
            where = np.concatenate([t[0] for t in targets])
            byte_addrs = (where[:, None] + np.arange(2)).reshape(-1)
            shared.check(byte_addrs, True, "this stmatrix", loc)
            shared.view(np.uint16)[where // 2] = np.concatenate([t[1] for t in targets])
            per_thread = byte_addrs.reshape(len(targets), 32, 2).transpose(1, 0, 2)
            shared.record_store(per_thread.reshape(32, -1), ctx.thread_ids[lanes], loc)

    return run


# A plain (synchronous) store, so it adds to no async counter; the wait passes find the buffer
# it writes by walking its address operand back (indirect_shared).
STMATRIX = declare("nvidia.ldmatrix.stmatrix", feature="sm90",
                   effects=Effects(indirect_shared=True), interpret=_stmatrix_semantics,
                   doc="a warp stores 1, 2 or 4 8x8 blocks of 16-bit elements to shared memory")


def stmatrix(tile: SharedTile, origin: tuple[Any, Any], blocks: Sequence[tuple[int, int]],
             values: Value, *, trans: bool = False, offset: Any = None) -> None:
    """Store ``len(blocks)`` 8x8 blocks whose top-left corners are ``origin + blocks[i]`` from
    this lane's ``vector<2*num x T>`` (block ``i`` in elements ``2i, 2i+1``, laid out as
    :func:`ldmatrix` returns them), with ``stmatrix.sync.aligned`` (sm_90+; every lane of the
    warp must call it). ``offset``: as :func:`ldmatrix`'s, this lane's row offset in the tile
    when the caller computes it (any row addresses, e.g. rows of a hand-swizzled buffer).

    Example: ``stmatrix(c_s, (r0, c0), [(0, 0), (8, 0)], frag)`` stores a 16x8 block.
    """
    num = len(blocks)
    STMATRIX.require(builder.current_target(), "kiln.ldmatrix.stmatrix")
    _check(tile, num)
    if not isinstance(values, Value) or values.dtype is not tile.dtype \
            or values.shape != (2 * num,):
        raise KilnTypeError(f"stmatrix of {num} blocks stores a vector<{2 * num} x "
                            f"{tile.dtype}> per lane, got {values!r}",
                            fix="pass the fragment ldmatrix would load for these blocks")
    i32 = ir.IntegerType.get_signless(32)
    words = vector.bitcast(ir.VectorType.get([num], i32), values.ir)
    registers = [vector.extract(words, [], [i]) for i in range(num)]
    if offset is None:
        offset = row_offset(tile, origin, blocks, ops.lane_id())
    address = tile.buffer.element_address(offset)
    regs = ", ".join(f"${i + 1}" for i in range(num))
    asm = f"stmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16 [$0], {{{regs}}};"
    STMATRIX.inline_asm(ir.Type.parse("!llvm.void"), [address, *registers], asm,
                        ",".join(["l"] + ["r"] * num), args={"num": num, "trans": int(trans)})

