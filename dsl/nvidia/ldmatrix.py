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

Example::

    a = kiln.ldmatrix.load_a(a_s, (row0, k0))              # A tile stored M x K
    b = kiln.ldmatrix.load_b(b_s, (k0, col0), trans=True)  # B tile stored K x N (N contiguous)
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mlir import ir
from mlir.dialects import nvgpu, vector

from .. import builder, ops
from ..errors import KilnTypeError, KilnValueError, TargetError
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
             trans: bool = False) -> Value:
    """Load ``len(blocks)`` 8x8 blocks whose top-left corners are ``origin + blocks[i]``
    (tile row, column); returns this lane's ``vector<2*num x T>`` (see the module docs).

    Example: ``ldmatrix(tile, (r0, c0), [(0, 0), (0, 8)])`` loads two side-by-side blocks.
    """
    num = len(blocks)
    _check(tile, num)
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
