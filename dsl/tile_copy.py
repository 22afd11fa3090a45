"""``kiln.copy`` and ``kiln.load``: move whole tiles between global, shared and registers.

One call per tile; the instruction is chosen from the tiles' kinds, layouts and the target:

======================  =====================================================================
global -> registers     ``kiln.load(g, layout)`` / ``kiln.copy(g, layout)``: per thread, one
                        vector load per run of consecutive columns it owns (up to 16 bytes:
                        ``ld.global.v4`` / ``global_load_dwordx4``); masked rows and columns
                        read nothing and give the GlobalTile's ``fill``
shared -> registers     the same with ``ld.shared`` / ``ds_read_b128``
registers -> global     ``kiln.copy(tile, g)``: vector stores, masked elements skipped;
                        ``staged=True``: through a swizzled shared tile, then 16 bytes a
                        thread along whole rows (an MMA accumulator's 4-byte runs scattered
                        over 8 rows become coalesced row stores); TMA stores on sm_90a where
                        ``g`` qualifies (:mod:`kiln.tile_tma`)
registers -> shared     vector stores into the SharedTile's layout and swizzle
shared -> global        sm_90a: TMA stores where the GlobalTile qualifies (the whole block
                        makes the call: two barriers); elsewhere through registers
global -> shared        sm_90a: TMA boxes on the tile's mbarrier where the GlobalTile's masks
                        are its tensor's extents and ``align=16`` (:mod:`kiln.tile_tma`); else
                        every thread of the block takes 16-byte chunks: ``cp.async`` (committed
                        as one group) on sm_80+ when the GlobalTile's ``align`` promises 4/8/16-
                        byte aligned chunks, the fill is 0 and the threads divide the chunks;
                        buffer -> LDS DMA on gfx942/gfx950 (:mod:`kiln.amd.tile_dma`); vector
                        loads and stores otherwise (:func:`kiln.tiles.copy`)
======================  =====================================================================

The asynchronous paths need no wait from the user: ``kiln-insert-waits`` puts the
``mbarrier.try_wait`` / ``cp.async.wait_group`` / ``s_waitcnt vmcnt`` before the first read of
the shared tile (a
``kiln.barrier()`` is still needed before reading what other threads copied, as with a
synchronous copy).

``kiln.load(tiles, layout, via=shared_tiles, refill=next_tiles)`` reads GlobalTiles (a row in
pieces) from the SharedTiles an earlier copy filled and refills each with the next row's piece
once every thread has read it (a barrier a piece; the waits placed as above): a persistent
block streams its rows with no barrier or wait of its own (docs/tiles.md).

A register tile is a :class:`~kiln.reg_tile.RegTile` of one fragment held by the block's
threads ``0 .. layout.num_threads - 1`` (thread ``t`` holds ``layout(t % num_threads, v)``),
usually with a :func:`kiln.layout.blocked` layout.

Example (one row of a softmax)::

    tv = kiln.layout.blocked((1, BLOCK), THREADS)
    x = kiln.load(kiln.GlobalTile(x_t, (1, BLOCK), (row, 0), col_end=n, fill=-inf), tv)
    kiln.copy(x * 2.0, kiln.GlobalTile(y_t, (1, BLOCK), (row, 0), col_end=n))
"""

from __future__ import annotations

from typing import Any

from mlir import ir
from mlir.dialects import scf, vector

from . import builder, ops, tile_handoff, tile_tma
from .core import dtypes as dt
from .core.errors import KilnTypeError, KilnValueError
from .core.ops import AUTO_WAIT_ATTR
from .global_tile import GlobalTile
from .layout import ThreadValueLayout
from .amd import tile_dma
from .nvidia import cp_async
from .nvidia.sync import fence_proxy_async
from .reg_tile import RegTile, _concat
from .shared_tile import SharedTile
from .layout import blocked
from .shared import dynamic_shared
from .swizzle import Swizzle
from .tile_gemm_wgmma import ATOM_BYTES, CHUNK_BYTES, chunked_layout
from .tiles import copy as copy_to_shared, copy_width, mask, row_run_width
from .values import Value, to_value

MAX_VECTOR_BYTES = 16


def _thread(layout: ThreadValueLayout) -> Value:
    return ops.thread_id(0) % layout.num_threads


def _run_width(layout: ThreadValueLayout, dtype: dt.DType, mem: Any) -> int:
    """The vector width of one access: the layout's run of consecutive columns, at most 16
    bytes, and (shared) contiguous in the SharedTile's swizzle."""
    width = min(row_run_width(layout), max(MAX_VECTOR_BYTES // dtype.itemsize, 1))
    while isinstance(mem, SharedTile) and width > 1 and not mem.contiguous_width(width):
        width //= 2
    return width


def _check_cover(tile: Any, layout: ThreadValueLayout, what: str) -> None:
    if tuple(layout.tile) != tuple(tile.shape):
        raise KilnValueError(f"{what}: the layout covers a {layout.tile[0]}x{layout.tile[1]} "
                             f"tile but the {type(tile).__name__} is "
                             f"{tile.shape[0]}x{tile.shape[1]}",
                             fix="build the layout for the tile's shape, e.g. "
                                 f"kiln.layout.blocked({tuple(tile.shape)}, THREADS)")
    threads = builder.current().block[0]
    if layout.num_threads > threads:
        raise KilnValueError(f"{what}: the layout spreads over {layout.num_threads} threads but "
                             f"the block has {threads}",
                             fix="build the layout for kiln.block_dim(0) threads or fewer")


def load(src: GlobalTile | SharedTile | list, layout: ThreadValueLayout, *,
         via: SharedTile | list | None = None, refill: list | None = None) -> RegTile | list:
    """The register tile holding ``src`` in ``layout`` (vector loads; see the module table).

    ``via``: ``src`` (a GlobalTile, or a list of them: a row in pieces) is read from these
    SharedTiles, where an earlier :func:`copy` put it (past its masks the copy wrote zeros;
    a nonzero ``fill`` is put back with one select per access, as ``kiln.tiles.mask`` gives).
    ``refill`` (with lists): each SharedTile is refilled by :func:`copy` from its GlobalTile
    as soon as every thread has read it, so the next copies are in flight while the later
    pieces are read: per piece a block barrier (after it the piece has landed for every
    thread and the previous piece is free), the previous piece's refill and the piece's
    loads; then a barrier and the last refill. The whole block makes that call, with no
    ``kiln.barrier()`` of its own before it.

    Example: ``x = kiln.load(kiln.GlobalTile(x_t, (4, 256), (r0, 0), col_end=n), tv)``; a row
    streamed through ``row_s`` (a list of SharedTiles) over a persistent grid::

        xs = kiln.load(row_tiles(x, row), tv, via=row_s, refill=row_tiles(x, row + grid))
    """
    if via is not None:
        return _load_via(src, layout, via, refill)
    if refill is not None:
        raise KilnTypeError("kiln.load(refill=...) refills the SharedTiles a row is read "
                            "through, and no via= is given",
                            fix="kiln.load(row_tiles, tv, via=shared_tiles, refill=next_tiles)")
    if not isinstance(src, (GlobalTile, SharedTile)) or not isinstance(layout, ThreadValueLayout):
        raise KilnTypeError(f"kiln.load reads a GlobalTile or SharedTile into a layout, got "
                            f"{type(src).__name__} and {type(layout).__name__}",
                            fix="kiln.load(kiln.GlobalTile(t, shape, origin), "
                                "kiln.layout.blocked(shape, THREADS))")
    _check_cover(src, layout, "kiln.load")
    width = _run_width(layout, src.dtype, src)
    if isinstance(src, GlobalTile) and src.tensor.rank == 1 and src.col_end is not None:
        return RegTile([_broadcast_row(src, layout, width)], layout, (1, 1))
    return RegTile([_pieces(src, layout, width)], layout, (1, 1))


def _load_via(src: Any, layout: ThreadValueLayout, via: Any, refill: list | None) -> Any:
    """``load(src, layout, via=..., refill=...)`` (see :func:`load`)."""
    many = isinstance(src, (list, tuple))
    srcs, vias = (list(src), list(via)) if many else ([src], [via])
    if not srcs or len(vias) != len(srcs) or not all(isinstance(g, GlobalTile) for g in srcs) \
            or not all(isinstance(t, SharedTile) for t in vias):
        raise KilnTypeError(f"kiln.load(src, layout, via=...) reads GlobalTiles through as many "
                            f"SharedTiles, got {type(src).__name__} via {type(via).__name__}",
                            fix="pass a GlobalTile and a SharedTile, or lists of equal length")
    if refill is not None and (not many or not isinstance(refill, (list, tuple))
                               or len(refill) != len(vias)
                               or not all(isinstance(g, GlobalTile) for g in refill)):
        raise KilnValueError(f"kiln.load(refill=...) needs a list of {len(vias)} GlobalTiles, "
                             "one for each SharedTile of via=",
                             fix="pass lists: kiln.load(tiles, tv, via=shared, refill=next)")
    out = []
    for k, (g, tile) in enumerate(zip(srcs, vias)):
        if refill is not None:
            ops.barrier()   # piece k landed for every thread (the wait goes before); k - 1 read
            if k:
                copy(refill[k - 1], vias[k - 1])
        t = load(tile, layout)
        masked = g.row_end is not None or g.col_end is not None
        out.append(ops.where(mask(g, layout), t, g.fill) if masked and g.fill != 0 else t)
    if refill is not None:
        ops.barrier()
        copy(refill[-1], vias[-1])
    return out if many else out[0]


def _pieces(src: GlobalTile | SharedTile, layout: ThreadValueLayout, width: int) -> Value:
    """The thread's values of ``src`` in ``layout``, ``width`` at a time; a 1-D tensor (the
    same row in every row) is read once per distinct run of columns."""
    thread = _thread(layout)
    broadcast = isinstance(src, GlobalTile) and src.tensor.rank == 1
    cols = layout.coords()[1] if broadcast else None
    loaded: dict[Any, Any] = {}
    pieces = []
    for v in range(0, layout.num_values, width):
        key = tuple(cols[:, v]) if broadcast else v
        if key not in loaded:
            row, col = layout(thread, v)
            piece = (src._vector_load(row, col, width) if isinstance(src, SharedTile)
                     else src.load(row, col, width=width))
            loaded[key] = piece.ir
        pieces.append(loaded[key])
    return Value(_concat(pieces), src.dtype)


def _broadcast_row(src: GlobalTile, layout: ThreadValueLayout, width: int) -> Value:
    """A masked 1-D row broadcast down the tile (a GEMM bias): unmasked loads in one block
    when the whole row is inside (one uniform branch, so ptxas can issue each load just
    before its use instead of holding every column's value in registers), else masked."""
    inside = (src.origin[1] + src.shape[1]) <= src.col_end
    whole = GlobalTile(src.tensor, src.shape, src.origin, fill=src.fill, align=src.align)
    vtype = ir.VectorType.get([layout.num_values], src.dtype.mlir_type())
    branch = scf.IfOp(to_value(inside).ir, [vtype], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        scf.YieldOp([_pieces(whole, layout, width).ir])
    with ir.InsertionPoint(branch.else_block):
        scf.YieldOp([_pieces(src, layout, width).ir])
    return Value(branch.results[0], src.dtype)


def store(tile: RegTile, dst: GlobalTile | SharedTile) -> None:
    """Write every fragment of ``tile`` into ``dst`` (masked elements of a GlobalTile are
    skipped), one vector store per run of consecutive columns."""
    if tile.dtype is not dst.dtype:
        raise KilnTypeError(f"cannot store a {tile.dtype} register tile into a {dst.dtype} "
                            f"{type(dst).__name__}", fix=f"kiln.cast(tile, kiln.{dst.dtype}) first")
    if tile.shape[0] > dst.shape[0] or tile.shape[1] > dst.shape[1]:
        raise KilnValueError(f"a {tile.shape} register tile does not fit the {dst.shape} "
                             f"{type(dst).__name__}", fix="copy into a tile at least as large")
    layout = tile.layout
    threads = builder.current().block[0]
    if layout.num_threads < threads:
        raise KilnValueError(f"this register tile is held by {layout.num_threads} threads (one "
                             f"warp's fragments?) but the block has {threads}: every group of "
                             f"{layout.num_threads} would store it to the same place",
                             fix="store a warp's fragments with kiln.tiles.store(tile, g, "
                                 "warp_origin), or use a block-wide layout (kiln.gemm's "
                                 "accumulator, kiln.layout.blocked)")
    width = _run_width(layout, tile.dtype, dst)
    thread = _thread(layout)
    fr, fc = layout.tile
    for i in range(tile.grid[0]):
        for j in range(tile.grid[1]):
            frag = tile.fragment(i, j)
            for v in range(0, layout.num_values, width):
                row, col = layout(thread, v)
                piece = Value(vector.shuffle(frag.ir, frag.ir, list(range(v, v + width))),
                              frag.dtype)
                dst.store(i * fr + row, j * fc + col, piece)


def _check_staged(tile: RegTile, dst: GlobalTile) -> None:
    if tile.dtype is not dst.dtype:
        raise KilnTypeError(f"cannot store a {tile.dtype} register tile into a {dst.dtype} "
                            "GlobalTile", fix=f"kiln.cast(tile, kiln.{dst.dtype}) first")
    if tuple(tile.shape) != tuple(dst.shape):
        raise KilnValueError(f"kiln.copy(staged=True) of a {tile.shape} register tile into a "
                             f"{dst.shape} GlobalTile", fix="stage a tile of the GlobalTile's "
                                                            "shape")


def _staged_store(tile: RegTile, dst: GlobalTile) -> None:
    """``store(tile, dst)`` through shared memory: the tile goes into its own shared tile in
    128-byte-swizzled chunks of rows (each run of 8 rows of a chunk hits every bank once), then
    every thread stores 16-byte runs of whole rows (coalesced, masked like any store)."""
    if tile_tma.store(tile, dst):
        return
    rows, cols = tile.shape
    itemsize = tile.dtype.itemsize
    chunk = CHUNK_BYTES // itemsize
    swizzled = cols % chunk == 0 and rows % 8 == 0
    layout = chunked_layout(rows, cols, tile.dtype) if swizzled else None
    flat = dynamic_shared((rows * cols,), tile.dtype, align=ATOM_BYTES)
    stage = SharedTile.view(flat, (rows, cols), layout,
                            Swizzle.sw128b(itemsize) if swizzled else None)
    ops.barrier()   # threads still reading the stage from this copy's last run (in a loop)
    store(tile, stage)
    ops.barrier()
    vec = max(MAX_VECTOR_BYTES // itemsize, 1)
    while cols % vec:
        vec //= 2
    store(load(stage, blocked((rows, cols), builder.current().block[0], vec=vec)), dst)


def _async_width(src: GlobalTile, dst: SharedTile, threads: int) -> int | None:
    """The cp.async chunk width (elements) when cp.async fits, else None: sm_80+, zero fill,
    4/8/16-byte chunks that the GlobalTile's ``align`` promises are aligned in global memory
    (cp.async faults on a misaligned source; without ``align`` nothing is promised), and every
    thread one chunk per step."""
    if not builder.current_target().has("sm80") or src.fill != 0 or src.align is None \
            or src.tensor.rank != 2:
        return None
    width = min(copy_width(dst), max(src.align // dst.dtype.itemsize, 1))
    chunks = src.shape[0] * (src.shape[1] // width)
    if width * dst.dtype.itemsize not in cp_async.COPY_BYTES or chunks % threads:
        return None
    return width


def _mark_shared_stores(ops: list) -> None:
    """Mark a synchronous copy's stores (``AUTO_WAIT_ATTR``) so kiln-insert-waits retires
    the WGMMAs still reading the SharedTile before them, as for an async copy's group."""
    def visit(op):
        if op.name in ("vector.store", "vector.maskedstore", "memref.store"):
            op.attributes[AUTO_WAIT_ATTR] = ir.UnitAttr.get()
        return ir.WalkResult.ADVANCE

    for op in ops:
        op.operation.walk(visit)


def copy(src: Any, dst: Any, *, staged: bool = False) -> Any:
    """Copy tile ``src`` into ``dst`` (see the module table for what each pair compiles to).

    ``dst`` may be a :class:`~kiln.layout.ThreadValueLayout`: the loaded register tile is
    returned (:func:`load`). Global -> shared returns the ``cp.async`` group (NVIDIA) or the
    DMAs' tokens (AMD) when it went asynchronously (else None); read the shared tile after a
    ``kiln.barrier()``. ``staged=True`` (register tile -> global) goes through a shared tile of
    its own (rows x cols elements of dynamic shared memory) and two block barriers, so every
    thread of the block must make the call; the global stores become 16-byte runs of whole rows.

    Example::

        a_s = kiln.SharedTile((64, 32), kiln.bf16)
        kiln.copy(kiln.GlobalTile(a, (64, 32), (m0, k0), row_end=m, col_end=k), a_s)
        kiln.barrier()
        kiln.copy(acc.cast(kiln.bf16), kiln.GlobalTile(c, (64, 64), (m0, n0), col_end=n))
    """
    if isinstance(dst, ThreadValueLayout):
        return load(src, dst)
    if not isinstance(staged, bool):
        raise KilnTypeError(f"kiln.copy staged= must be a bool, got {staged!r}",
                            fix="pass staged=True or staged=False")
    if staged and not (isinstance(src, RegTile) and isinstance(dst, GlobalTile)):
        raise KilnTypeError(f"kiln.copy(staged=True) stores a register tile into a GlobalTile, "
                            f"not a {type(src).__name__} into a {type(dst).__name__}",
                            fix="drop staged=True, or copy a RegTile (e.g. kiln.cast(acc, "
                                "kiln.bf16)) into a GlobalTile")
    if isinstance(src, RegTile) and isinstance(dst, (GlobalTile, SharedTile)):
        if staged:
            _check_staged(src, dst)
            _staged_store(src, dst)
        else:
            store(src, dst)
        return None
    if isinstance(src, GlobalTile) and isinstance(dst, SharedTile):
        if tile_tma.load(src, dst):
            return None
        tile_handoff.note_copy(dst)
        threads = builder.current().block[0]
        target = builder.current_target()
        width = tile_dma.dma_width(src, dst, threads, target)
        if width is not None:
            tokens = tile_dma.dma_copy(src, dst, threads=threads, width=width,
                                       wave=target.warp_size)
            for token in tokens:
                token.op.attributes[AUTO_WAIT_ATTR] = ir.UnitAttr.get()
            return tokens
        width = _async_width(src, dst, threads)
        if width is not None:
            group = cp_async.commit(copy_to_shared(src, dst, threads=threads, async_copy=True,
                                                   width=width))
            group.ir.owner.attributes[AUTO_WAIT_ATTR] = ir.UnitAttr.get()
            return group
        block = ir.InsertionPoint.current.block
        first = len(block.operations)
        copy_to_shared(src, dst, threads=threads)
        _mark_shared_stores(list(block.operations)[first:])
        if getattr(dst, "wgmma_operand", None):
            # st.shared is a generic-proxy write; WGMMA reads through the async proxy
            fence_proxy_async()
        return None
    if isinstance(src, SharedTile) and isinstance(dst, GlobalTile):
        if tile_tma.store_shared(src, dst):
            return None
        raise KilnTypeError("kiln.copy from shared to global is a TMA store, on sm_90a where "
                            "the GlobalTile qualifies (docs/tiles.md); elsewhere it goes "
                            "through registers", fix="kiln.copy(kiln.load(s, layout), g)")
    raise KilnTypeError(f"kiln.copy cannot copy a {type(src).__name__} into a "
                        f"{type(dst).__name__}",
                        fix="copy GlobalTile -> SharedTile, a tile -> a layout (registers), or "
                            "a RegTile -> GlobalTile/SharedTile")

