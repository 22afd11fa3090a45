"""Row and column vectors of register tiles, and the row structure of a fragment layout.

A :class:`TileVector` is what ``kiln.reduce(tile, op, axis)`` of a :class:`~kiln.reg_tile.RegTile`
returns: one scalar per row (or column) group of each thread's fragment values, which
broadcasts back onto a tile along the rows (columns) it was reduced from.
:func:`row_structure` says which of a layout's values share a row in registers and which lane
bits keep the row (combined by XOR shuffles).

Example::

    m = kiln.reduce(s, "max", axis=1)      # a TileVector
    p = kiln.exp2(s - m)                   # m broadcast along each row
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
from mlir import ir
from mlir.dialects import vector

from . import ops
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .layout import ThreadValueLayout, transpose
from .values import Value, cast, constant


def pairwise(values: list[Value], combine) -> Value:
    """``combine`` over ``values`` as a balanced tree: log2(n) dependent steps instead of n,
    which is the latency the softmax's row max and row sum sit on."""
    while len(values) > 1:
        paired = [combine(values[k], values[k + 1]) for k in range(0, len(values) - 1, 2)]
        values = paired + values[len(values) - len(values) % 2:]
    return values[0]


@functools.lru_cache(maxsize=None)  # immutable; every reduce and row broadcast asks again
def row_structure(tv: ThreadValueLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(group_of_value, lane_masks)`` for reducing each row of one fragment.

    Values whose row is the same in every lane form a group (reduced in registers); flipping a
    lane bit in ``lane_masks`` keeps every value's row (those lanes are then combined by
    shuffles). Raises when the two do not cover each row's columns exactly.
    """
    rows, _ = tv.coords()
    keys: dict[tuple, int] = {}
    group_of = tuple(keys.setdefault(tuple(rows[:, v]), len(keys)) for v in range(tv.num_values))
    lanes = np.arange(tv.num_threads)
    # (a bit that takes some thread past the block, as 256 of 384 threads, is no shuffle)
    masks = tuple(1 << b for b in range(tv.num_threads.bit_length() - 1)
                  if np.all(lanes ^ (1 << b) < tv.num_threads)
                  and np.array_equal(rows[lanes ^ (1 << b)], rows))
    per_group = np.bincount(group_of)
    if not np.all(per_group * (1 << len(masks)) == tv.tile[1]):
        raise KilnValueError(f"fragment layout {tv.layout} cannot be reduced along rows with "
                             "register combines and XOR shuffles",
                             fix="reduce a fragment whose row-mates differ in lane bits only")
    return group_of, masks


@functools.lru_cache(maxsize=None)  # immutable, as row_structure
def row_keys(tv: ThreadValueLayout) -> tuple[tuple[int, ...], ...]:
    """Every value group's rows, one per thread (:func:`row_structure`'s group order): what a
    row vector needs to broadcast onto another layout whose threads hold the same rows."""
    rows, _ = tv.coords()
    keys: dict[tuple, int] = {}
    for v in range(tv.num_values):
        keys.setdefault(tuple(int(r) for r in rows[:, v]), len(keys))
    return tuple(keys)


class TileVector:
    """A per-row (``axis="row"``) or per-column vector reduced from a :class:`RegTile`.

    ``values[i][g]`` is this lane's scalar for grid line ``i`` and value group ``g``;
    ``group_of[v]`` names the group fragment value ``v`` belongs to. Elementwise ops with
    scalars and other TileVectors of the same structure work like RegTile's. ``keys`` (from
    ``kiln.reduce`` and :meth:`full`) are each group's rows per thread: with them the vector
    also broadcasts onto a tile of another layout whose threads hold the same rows, e.g. an
    attention row max of ``S`` (``BM x BN``) onto the output accumulator (``BM x D``).
    """

    def __init__(self, values: list[list[Value]], group_of: tuple[int, ...], axis: str,
                 keys: tuple | None = None):
        self.values, self.group_of, self.axis, self.keys = values, group_of, axis, keys

    @classmethod
    def full(cls, layout: ThreadValueLayout, value: float, dtype=dt.f32,
             axis: int = 1) -> "TileVector":
        """The vector ``kiln.reduce(tile, op, axis)`` of a one-fragment tile in ``layout``
        gives, with every scalar ``value``: the start of a running reduction.

        Example: ``m = kiln.tiles.TileVector.full(s.layout, -float("inf"))``.
        """
        tv = layout if axis == 1 else transpose(layout)
        group_of, _ = row_structure(tv)
        scalar = constant(value, dt.dtype(dtype))
        return cls([[scalar] * (max(group_of) + 1)], group_of, "row" if axis == 1 else "col",
                   row_keys(tv))

    def map(self, fn: Callable[[Value], Value]) -> "TileVector":
        """``fn`` applied to every scalar. Example: ``scale = (m_old - m).map(kiln.exp2)``."""
        return TileVector([[fn(x) for x in line] for line in self.values], self.group_of,
                          self.axis, self.keys)

    def _zip(self, other: Any, fn) -> "TileVector":
        if isinstance(other, TileVector):
            if (other.axis, other.group_of, len(other.values)) != \
                    (self.axis, self.group_of, len(self.values)):
                raise KilnTypeError(f"cannot combine a {self.axis} vector with a {other.axis} "
                                    "vector of a different tile structure",
                                    fix="combine reductions of tiles with the same layout")
            return TileVector([[fn(x, y) for x, y in zip(a, b)]
                               for a, b in zip(self.values, other.values)], self.group_of,
                              self.axis, self.keys if self.keys == other.keys else None)
        return self.map(lambda x: fn(x, other))

    def __add__(self, o): return self._zip(o, lambda a, b: a + b)
    def __sub__(self, o): return self._zip(o, lambda a, b: a - b)
    def __mul__(self, o): return self._zip(o, lambda a, b: a * b)
    def __truediv__(self, o): return self._zip(o, lambda a, b: a / b)
    def __rsub__(self, o): return self.map(lambda a: o - a)
    def __radd__(self, o): return self + o
    def __rmul__(self, o): return self * o

    __kiln_elementwise__ = map  # kiln.exp(v), kiln.sqrt(v): per scalar

    def __kiln_binary__(self, other: Any, fn) -> "TileVector":
        return self._zip(other, fn)

    def cast(self, dtype) -> "TileVector":
        """Every scalar converted to ``dtype``."""
        return self.map(lambda x: cast(x, dtype))

    def item(self) -> Value:
        """The one scalar of a vector reduced from a single row or column (e.g. a block-wide
        row of :func:`kiln.layout.blocked`): ``mean = kiln.reduce(x, "sum", 1).item() / n``."""
        if len(self.values) != 1 or len(self.values[0]) != 1:
            raise KilnValueError(f"this {self.axis} vector holds {len(self.values)} x "
                                 f"{len(self.values[0])} scalars per thread, not one",
                                 fix="reduce a one-row tile, or index .values[line][group]")
        return self.values[0][0]

    def maximum(self, other: Any) -> "TileVector":
        """Elementwise max with a scalar or a TileVector: ``m_new = m_old.maximum(s.row_max())``."""
        return self._zip(other, ops.maximum)

    def any_greater(self, limit: float) -> Value:
        """This lane's i32 flag (0/1): whether any of its scalars exceeds ``limit``. One lane's
        answer only; vote on it across lanes, e.g. ``kiln.shuffle.any_lane(m.any_greater(8.0))``.
        """
        flags = [cast(x > limit, dt.i32) for line in self.values for x in line]
        flag = flags[0]
        for other in flags[1:]:
            flag = flag | other
        return flag

    def fragment(self, line: int, width: int) -> Value:
        """The ``width``-wide vector that broadcasts this vector onto fragment values."""
        scalars = [self.values[line][g] for g in self.group_of]
        if len(set(self.group_of)) == 1:
            return Value(vector.broadcast(ir.VectorType.get([width], scalars[0].ir.type),
                                          scalars[0].ir), scalars[0].dtype)
        return Value(vector.from_elements(ir.VectorType.get([width], scalars[0].ir.type),
                                          [s.ir for s in scalars]), scalars[0].dtype)

    def __kiln_flatten__(self):
        flat = [x.ir for line in self.values for x in line]
        return flat, (len(self.values), self.group_of, self.axis, self.keys)

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        lines, group_of, axis, keys = aux
        per = len(values) // lines
        return cls([[Value(v) for v in values[i * per:(i + 1) * per]] for i in range(lines)],
                   group_of, axis, keys)
