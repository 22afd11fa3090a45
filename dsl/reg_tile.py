"""Register tiles: a matrix spread over a warp's registers in an MMA fragment layout.

A :class:`RegTile` is a ``grid_m x grid_n`` grid of fragments. Every fragment is one
``kiln.Value`` vector per lane laid out by the same :class:`~kiln.layout.ThreadValueLayout`
(an MMA atom's A, B or C layout), covering ``frag_rows x frag_cols``; the tile is
``grid_m * frag_rows`` by ``grid_n * frag_cols``. Element ``(r, c)`` sits in fragment
``(r // frag_rows, c // frag_cols)`` at the lane/value ``layout`` maps to ``(r % frag_rows,
c % frag_cols)``.

Semantics (what the interpreter and tests model): elementwise ops (``+ - * /``, :meth:`map`,
:func:`where`) apply per element; a Python/traced scalar broadcasts to every element; a
:class:`TileVector` from a row (column) reduction broadcasts along the rows (columns) it was
reduced from. ``row_max``/``row_sum`` reduce each row over all its columns: first in
registers, then across the lanes that share the row with XOR shuffles (``kiln.shuffle``)
whose masks come from the layout. :attr:`T` re-tags the same registers as the transposed
matrix (no IR), e.g. the ``col_l`` MFMA accumulator view (lane ``l`` owns column ``l % 32``)
becomes the ``row_l`` view (lane owns a row). :meth:`cast` converts the whole tile with one
``arith.truncf``/``extf`` on the concatenated fragments.

Example (online softmax step on an accumulator ``s``)::

    m = s.row_max()
    p = (s - m).exp2()          # m broadcast along each row
    l = p.row_sum()
    p16 = p.cast(kiln.bf16)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mlir import ir
from mlir.dialects import llvm, vector

from . import builder, ops
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .layout import ThreadValueLayout, transpose
from .shuffle import butterfly_reduce
from .tile_vector import TileVector, pairwise, row_keys, row_structure
from .values import Value, broadcast, cast, constant, known, to_value, unify

ROW_LANES = "row_l"
COL_LANES = "col_l"


def _concat(values: list[ir.Value]) -> ir.Value:
    """One vector holding ``values`` (1-D vectors) back to back, built with ``vector.shuffle``."""
    while len(values) > 1:
        pairs = []
        for i in range(0, len(values) - 1, 2):
            a, b = values[i], values[i + 1]
            n = ir.VectorType(a.type).shape[0] + ir.VectorType(b.type).shape[0]
            pairs.append(vector.shuffle(a, b, list(range(n))))
        if len(values) % 2:
            pairs.append(values[-1])
        values = pairs
    return values[0]


def pack_struct(registers: list[ir.Value]) -> ir.Value:
    """Scalars of one type as an ``!llvm.struct`` (field ``i`` = ``registers[i]``): the form
    of :meth:`RegTile.from_struct`."""
    struct_type = llvm.StructType.get_literal([registers[0].type] * len(registers))
    value = llvm.mlir_undef(struct_type)
    for i, register in enumerate(registers):
        value = _create("llvm.insertvalue", results=[struct_type], operands=[value, register],
                        attributes={"position": ir.DenseI64ArrayAttr.get([i])}).result
    return value


def _struct_fields(struct_type: ir.Type) -> tuple[int, ir.Type | None]:
    """An ``!llvm.struct`` type's field count and its one field type (None when its fields
    differ), remembered per trace: reading a 64-field body costs ~100 us."""
    state = builder.current_or_none()
    memo = state.struct_fields if state is not None else {}
    found = memo.get(struct_type)
    if found is None:
        body = llvm.StructType(struct_type).body
        found = memo[struct_type] = (len(body), body[0] if len(set(body)) == 1 else None)
    return found


def _lane(fragment: Value, v: int) -> Value:
    """Value ``v`` of a fragment vector (``vector.extract``, built as :func:`_create` says)."""
    return known(_create("vector.extract", results=[fragment.dtype.mlir_type()],
                         operands=[fragment.ir],
                         attributes={"static_position": ir.DenseI64ArrayAttr.get([v])}).result,
                 fragment.dtype, ())


# llvm.extractvalue/insertvalue and vector.extract built by the generic builder: the
# generated ones' Python layers cost 3x as much, and a WGMMA accumulator's 64 fields are read
# at every use.
_create = ir.Operation.create


class RegTile:
    """A matrix held in registers as a grid of MMA fragments (see the module docs): Kiln's one
    register-fragment type, for ``mma.sync``/MFMA operands and accumulators, the WGMMA
    accumulator and register A operands (:mod:`kiln.wgmma`), and raw lists of registers
    (:meth:`from_registers`, :meth:`registers`). A 1 x 1 tile may keep its registers as the
    ``!llvm.struct`` WGMMA reads and writes (:meth:`from_struct`); every method works on both.

    ``RegTile.full(layout, (2, 4), 0.0, kiln.f32)`` makes a 2x4 grid of zero fragments.
    """

    def __init__(self, fragments: list[Value], layout: ThreadValueLayout, grid: tuple[int, int]):
        grid = tuple(grid)
        if len(fragments) != grid[0] * grid[1]:
            raise KilnValueError(f"a {grid[0]}x{grid[1]} RegTile needs {grid[0] * grid[1]} "
                                 f"fragments, got {len(fragments)}",
                                 fix="pass one fragment per grid cell, row-major")
        width = layout.num_values
        for f in fragments:
            if not isinstance(f, Value) or f.shape != (width,):
                raise KilnTypeError(f"RegTile fragments must be vector<{width}x T> values for "
                                    f"this layout, got {f!r}",
                                    fix="build fragments with this layout's num_values")
        self._fragments, self.layout, self.grid = list(fragments), layout, grid
        self._struct = None

    @classmethod
    def full(cls, layout: ThreadValueLayout, grid: tuple[int, int], value: float,
             dtype=dt.f32) -> "RegTile":
        """Every element ``value`` (one splat constant shared by all fragments)."""
        frag = constant(value, dt.dtype(dtype), (layout.num_values,))
        return cls([frag] * (grid[0] * grid[1]), layout, grid)

    @classmethod
    def from_registers(cls, registers: list[Any], layout: ThreadValueLayout,
                       grid: tuple[int, int] = (1, 1)) -> "RegTile":
        """The tile whose :meth:`registers` are ``registers`` (scalar ``kiln.Value`` s of one
        dtype, fragment after fragment): the raw-list form of a fragment back as a tile.

        Example: ``acc = RegTile.from_registers([x * 2.0 for x in acc.registers()],
        acc.layout)``.
        """
        width = layout.num_values
        values = [to_value(r) for r in registers]
        if len(values) != width * grid[0] * grid[1]:
            raise KilnValueError(f"a {grid[0]}x{grid[1]} RegTile of {width}-value fragments "
                                 f"needs {width * grid[0] * grid[1]} registers, got "
                                 f"{len(values)}", fix="pass every register of every fragment")
        if any(v.shape or v.dtype is not values[0].dtype for v in values):
            raise KilnTypeError("RegTile registers must be scalars of one dtype, got "
                                f"{sorted({repr(v.dtype) for v in values})}",
                                fix="kiln.cast the registers to one dtype first")
        frag_type = ir.VectorType.get([width], values[0].ir.type)
        frags = [Value(vector.from_elements(frag_type, [v.ir for v in values[k:k + width]]),
                       values[0].dtype) for k in range(0, len(values), width)]
        return cls(frags, layout, grid)

    @classmethod
    def from_struct(cls, value: ir.Value, layout: ThreadValueLayout) -> "RegTile":
        """The 1 x 1 tile whose register ``i`` is field ``i`` of ``value``, an
        ``!llvm.struct`` of ``layout.num_values`` scalars: the form NVIDIA's WGMMA reads and
        writes. The tile keeps the struct (no IR is emitted); :meth:`element` reads a field,
        :attr:`fragments` builds the vector form where it is used.

        Example: ``acc = RegTile.from_struct(wgmma_result, kiln.layout.wgmma_m64_accumulator(64))``.
        """
        fields, field_type = _struct_fields(value.type)
        if fields != layout.num_values or field_type is None:
            raise KilnTypeError(f"{value.type} is not a struct of {layout.num_values} registers "
                                "of one type", fix="pass a WGMMA accumulator struct")
        tile = cls.__new__(cls)
        tile._fragments, tile.layout, tile.grid = None, layout, (1, 1)
        tile._struct, tile._struct_dtype = value, dt.from_mlir(field_type)
        tile._field_type = field_type
        return tile

    def struct(self) -> ir.Value:
        """A 1 x 1 tile's registers as an ``!llvm.struct`` (:meth:`from_struct`'s form): the
        one it was built from, else built here from the registers."""
        if self._struct is not None:
            return self._struct
        if self.grid != (1, 1):
            raise KilnValueError(f"only a 1 x 1 RegTile has a struct form, this one is "
                                 f"{self.grid[0]} x {self.grid[1]}",
                                 fix="take one: RegTile([t.fragment(i, j)], layout, (1, 1))")
        return pack_struct([r.ir for r in self.registers()])

    @property
    def fragments(self) -> list[Value]:
        """The fragment vectors, row-major over the grid (built here for a struct tile)."""
        if self._struct is None:
            return self._fragments
        frag_type = ir.VectorType.get([self.layout.num_values], self._struct_dtype.mlir_type())
        return [Value(vector.from_elements(frag_type, [r.ir for r in self.registers()]),
                      self._struct_dtype)]

    def unpacked(self) -> "RegTile":
        """The tile with its fragments as vectors (one conversion here rather than one per
        use of a struct tile's :attr:`fragments`)."""
        return self if self._struct is None else RegTile(self.fragments, self.layout, self.grid)

    @property
    def dtype(self) -> dt.DType:
        return self._struct_dtype if self._struct is not None else self.fragments[0].dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (self.grid[0] * self.layout.tile[0], self.grid[1] * self.layout.tile[1])

    def fragment(self, i: int, j: int) -> Value:
        """The fragment at grid position ``(i, j)``."""
        return self.fragments[i * self.grid[1] + j]

    def __len__(self) -> int:
        return self.grid[0] * self.grid[1]

    def __getitem__(self, k: int) -> Value:
        """Fragment ``k``, row-major over the grid: a grid of operands reads like a list of
        them, e.g. ``p[j]`` is the ``j``-th A operand of
        :func:`kiln.wgmma.a_fragment_from_accumulator`."""
        if not isinstance(k, int) or not -len(self) <= k < len(self):
            raise IndexError(f"fragment {k!r} of a {self.grid[0]} x {self.grid[1]} RegTile")
        return self.fragments[k]

    def element(self, i: int) -> Value:
        """This thread's register ``i`` (value ``i % num_values`` of fragment
        ``i // num_values``, row-major over the grid) as a scalar ``kiln.Value``."""
        width = self.layout.num_values
        count = width * self.grid[0] * self.grid[1]
        if not 0 <= i < count:
            raise KilnValueError(f"register {i} is outside this tile's {count} registers per "
                                 "thread", fix="index registers from 0")
        if self._struct is not None:
            return self._field(i)
        frag = self._fragments[i // width]
        return _lane(frag, i % width)

    def _field(self, i: int) -> Value:
        """Field ``i`` of a struct tile."""
        return known(_create("llvm.extractvalue", results=[self._field_type],
                             operands=[self._struct],
                             attributes={"position": ir.DenseI64ArrayAttr.get([i])}).result,
                     self._struct_dtype, ())

    def registers(self) -> list[Value]:
        """All of this thread's registers, :meth:`element` order: the raw-list form."""
        count = self.layout.num_values * self.grid[0] * self.grid[1]
        if self._struct is not None:
            return [self._field(i) for i in range(count)]
        return [self.element(i) for i in range(count)]

    @property
    def view(self) -> str:
        """``"row_l"`` when neighbouring lanes hold different rows, ``"col_l"`` when they hold
        different columns of the same row (lane bit 0 decides)."""
        rows, _ = self.layout.coords()
        return COL_LANES if np.array_equal(rows[0], rows[1]) else ROW_LANES

    @property
    def T(self) -> "RegTile":  # noqa: N802 - the matrix transpose, as in numpy
        """The same registers read as the transposed matrix: a re-tag, no IR is emitted."""
        gm, gn = self.grid
        frags = [self.fragment(i, j) for j in range(gn) for i in range(gm)]
        return RegTile(frags, transpose(self.layout), (gn, gm))

    def as_view(self, view: str) -> "RegTile":
        """This tile if it already has ``view`` (``"row_l"``/``"col_l"``), else :attr:`T`."""
        if view not in (ROW_LANES, COL_LANES):
            raise KilnValueError(f"unknown RegTile view {view!r}", fix='use "row_l" or "col_l"')
        return self if self.view == view else self.T

    # --- elementwise

    def map(self, fn: Callable[[Value], Value]) -> "RegTile":
        """``fn`` applied to every fragment vector. Example: ``p = s.map(kiln.exp2)``."""
        return RegTile([fn(f) for f in self.fragments], self.layout, self.grid)

    __kiln_elementwise__ = map  # kiln.exp(tile), kiln.rsqrt(tile): per fragment

    def __kiln_binary__(self, other: Any, fn) -> "RegTile":
        return self._zip(other, fn)

    def __kiln_where__(self, a: Any, b: Any) -> "RegTile":
        return where(self, a, b)

    def exp2(self) -> "RegTile":
        """``2**x`` elementwise (``math.exp2`` on each fragment)."""
        return self.map(ops.exp2)

    def _operand(self, other: Any, i: int, j: int) -> Any:
        if isinstance(other, RegTile):
            if other.grid != self.grid or other.layout != self.layout:
                raise KilnTypeError(f"RegTiles of grids {self.grid}/{other.grid} or different "
                                    "fragment layouts cannot be combined elementwise",
                                    fix="combine tiles produced by the same TiledMma")
            return other.fragment(i, j)
        if isinstance(other, TileVector):
            if other.axis == "row":
                return other.fragment(i, self.layout.num_values)
            return other.fragment(j, self.layout.num_values)
        return other

    def _zip(self, other: Any, fn) -> "RegTile":
        if isinstance(other, TileVector):
            other = self._fit_vector(other)
        gm, gn = self.grid
        return RegTile([fn(self.fragment(i, j), self._operand(other, i, j))
                        for i in range(gm) for j in range(gn)], self.layout, self.grid)

    def _fit_vector(self, v: TileVector) -> TileVector:
        """``v`` with this tile's value groups: as it is, or regrouped by its ``keys`` when
        this tile's threads hold the same rows in other registers."""
        tv = self.layout if v.axis == "row" else transpose(self.layout)
        group_of = row_structure(tv)[0]
        lines = self.grid[0] if v.axis == "row" else self.grid[1]
        if v.group_of == group_of and len(v.values) == lines:
            return v
        index = {} if v.keys is None else {k: g for g, k in enumerate(v.keys)}
        keys = row_keys(tv) if index and len(v.values) == lines else ()
        if not keys or any(k not in index for k in keys):
            raise KilnTypeError(f"this {v.axis} vector was reduced from a tile of another "
                                "layout, whose threads hold other rows",
                                fix="broadcast a reduction onto a tile of the same layout, or "
                                    "of one with the same rows per thread")
        return TileVector([[line[index[k]] for k in keys] for line in v.values], group_of,
                          v.axis, keys)

    def _check_vector(self, v: TileVector) -> None:
        structure = row_structure(self.layout if v.axis == "row" else transpose(self.layout))
        lines = self.grid[0] if v.axis == "row" else self.grid[1]
        if v.group_of != structure[0] or len(v.values) != lines:
            raise KilnTypeError(f"this {v.axis} vector was reduced from a tile of another layout",
                                fix="broadcast a reduction onto a tile of the same layout")

    def __add__(self, o): return self._zip(o, lambda a, b: a + b)
    def __radd__(self, o): return self + o
    def __sub__(self, o): return self._zip(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._zip(o, lambda a, b: b - a)
    def __mul__(self, o): return self._zip(o, lambda a, b: a * b)
    def __rmul__(self, o): return self * o
    def __truediv__(self, o): return self._zip(o, lambda a, b: a / b)
    def __rtruediv__(self, o): return self._zip(o, lambda a, b: b / a)
    def __neg__(self): return self.map(lambda a: -a)
    def __lt__(self, o): return self._zip(o, lambda a, b: a < b)
    def __le__(self, o): return self._zip(o, lambda a, b: a <= b)
    def __gt__(self, o): return self._zip(o, lambda a, b: a > b)
    def __ge__(self, o): return self._zip(o, lambda a, b: a >= b)
    def __and__(self, o): return self._zip(o, lambda a, b: a & b)
    def __or__(self, o): return self._zip(o, lambda a, b: a | b)

    # --- reductions

    def _reduce_rows(self, combine, axis: str, across_lanes: bool = True) -> TileVector:
        group_of, masks = row_structure(self.layout)
        groups = max(group_of) + 1
        gm, gn = self.grid
        lines = []
        for i in range(gm):
            members: list[list[Value]] = [[] for _ in range(groups)]
            for j in range(gn):
                frag = self.fragment(i, j)
                for v, g in enumerate(group_of):
                    members[g].append(_lane(frag, v))
            lines.append([butterfly_reduce(pairwise(m, combine), masks if across_lanes else (),
                                           combine)
                          for m in members])
        return TileVector(lines, group_of, axis)

    def row_reduce(self, combine: Callable[[Value, Value], Value], *,
                   across_lanes: bool = True) -> TileVector:
        """Reduce every row with ``combine`` (associative, commutative): registers first,
        then XOR shuffles across the lanes sharing the row.

        ``across_lanes=False`` stops after the registers: each lane's partial result, for a
        kernel that decides something per lane first and finishes with :meth:`reduce_lanes`::

            part = p.row_reduce(add, across_lanes=False)   # no shuffles yet
            rows = p.reduce_lanes(part, add)               # == p.row_reduce(add)
        """
        return self._reduce_rows(combine, "row", across_lanes)

    def reduce_lanes(self, partial: TileVector, combine: Callable[[Value, Value], Value]
                     ) -> TileVector:
        """Finish a ``row_reduce(..., across_lanes=False)`` of a tile of this layout: combine
        ``partial`` across the lanes sharing each row (XOR shuffles)."""
        self._check_vector(partial)
        if partial.axis != "row":
            raise KilnTypeError("reduce_lanes finishes row reductions, got a column vector",
                                fix="reduce the transposed tile's rows instead")
        masks = row_structure(self.layout)[1]
        return partial.map(lambda x: butterfly_reduce(x, masks, combine))

    def col_reduce(self, combine: Callable[[Value, Value], Value]) -> TileVector:
        """Reduce every column with ``combine`` (see :meth:`row_reduce`)."""
        return self.T._reduce_rows(combine, "col")

    def row_max(self) -> TileVector:
        """Max of every row. Example: ``m = s.row_max()``."""
        return self.row_reduce(ops.maximum)

    def row_sum(self) -> TileVector:
        """Sum of every row. Example: ``l = p.row_sum()``."""
        return self.row_reduce(lambda a, b: a + b)

    def col_max(self) -> TileVector:
        """Max of every column."""
        return self.col_reduce(ops.maximum)

    def col_sum(self) -> TileVector:
        """Sum of every column."""
        return self.col_reduce(lambda a, b: a + b)

    # --- conversion

    def cast(self, dtype) -> "RegTile":
        """The tile converted to ``dtype`` with one conversion op on all fragments at once
        (f32 -> bf16/f16/fp8 is a single ``arith.truncf``, which LLVM emits as packed
        conversions). Example: ``p16 = p.cast(kiln.bf16)``."""
        target = dt.dtype(dtype)
        if target is self.dtype:
            return self
        width = self.layout.num_values
        whole = Value(_concat([f.ir for f in self.fragments]), self.dtype)
        converted = cast(whole, target)
        frags = [Value(vector.shuffle(converted.ir, converted.ir,
                                      list(range(k * width, (k + 1) * width))), target)
                 for k in range(len(self))]
        return RegTile(frags, self.layout, self.grid)

    def __kiln_flatten__(self):
        if self._struct is not None:
            return [self._struct], (self.layout, None)
        return [f.ir for f in self.fragments], (self.layout, self.grid)

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        layout, grid = aux
        if grid is None:  # a struct tile stays one struct through loops and branches
            return cls.from_struct(values[0], layout)
        return cls([Value(v) for v in values], layout, grid)


def where(cond: RegTile, a: Any, b: Any) -> RegTile:
    """Elementwise ``a if cond else b`` for an i1 RegTile ``cond`` (``arith.select`` per
    fragment); ``a``/``b`` are RegTiles of the same layout or scalars.

    Example: ``s = where(s_mask, s, -float("inf"))``.
    """
    if not isinstance(cond, RegTile) or cond.dtype is not dt.i1:
        raise KilnTypeError("kiln.tiles.where needs an i1 RegTile condition",
                            fix="compare tiles first, e.g. where(cols < n, s, 0.0)")
    gm, gn = cond.grid
    frags = []
    for i in range(gm):
        for j in range(gn):
            x, y = cond._operand(a, i, j), cond._operand(b, i, j)
            if not isinstance(x, Value) and not isinstance(y, Value):
                x = to_value(x)
            x, y = (broadcast(v, (cond.layout.num_values,)) for v in unify(x, y))
            frags.append(ops.where(cond.fragment(i, j), x, y))
    return RegTile(frags, cond.layout, cond.grid)

