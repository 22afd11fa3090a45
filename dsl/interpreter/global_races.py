"""Races on global memory between the blocks of one launch.

The blocks of a launch may run in any order and at the same time on a GPU, so two plain
accesses to one global element from different blocks, at least one of them a store, are a race
unless something orders the blocks. The interpreter runs blocks one after another, which hides
such races (the later block simply wins); this module sees them. Per element of every global
tensor argument it keeps the last plain store and the first plain load of the launch (and the
last load, see below), each packed into one int64 ``(block + 1) << 32 | site << 12 | thread`` (``0``: none, so the
shadows are ``np.zeros``, whose pages the OS maps only when touched), so that every access is a
few vectorised gathers and one compare. Blocks run in block order, so when block ``b`` stores
to an element that another block loaded, the element's first loader is not ``b``; only the
CTAs of a cluster run together, and for them the last loader is kept as well.

Atomics are exempt. The interpreter knows two cross-block orderings: two blocks that both did
an atomic (``memref.atomic_rmw``, or the counter read of ``kiln.nvidia_asm.wait_for_count``) on
one element, and two CTAs of a cluster once a cluster barrier released them (its arrive
releases and its wait acquires), are treated as ordered, whichever accesses and fences surround
the atomics or the barrier (the "last block reduces" pattern; a missing fence is not detected,
as elsewhere in the interpreter).
"""

from __future__ import annotations

import numpy as np

from kiln.core.errors import RaceError

from .state import MemRef

_THREAD_BITS = 12
_SITE_BITS = 20
_BLOCK_SHIFT = _THREAD_BITS + _SITE_BITS  # 32


class _Shadow:
    """The race state of one global tensor's storage (allocated at its first access: a
    launch often leaves some arguments untouched)."""

    __slots__ = ("mem", "writer", "first_reader", "last_reader", "written")

    def __init__(self, mem: MemRef):
        self.mem = mem
        self.writer = None
        self.written = False  # no plain store yet: loads need not look for one

    def allocate(self) -> None:
        n = self.mem.storage.size
        self.writer = np.zeros(n, np.int64)
        self.first_reader = np.zeros(n, np.int64)
        self.last_reader = np.zeros(n, np.int64)  # used when blocks run together only


class GlobalAccesses:
    """Global-memory race tracking for one launch over ``grid``: register the tensor arguments
    with :meth:`register`, then every plain access goes through :meth:`access`.

    Example (what ``interpret_kernel`` does)::

        tracker = GlobalAccesses((4, 1, 1), concurrent=False)
        tracker.register(values)        # the converted arguments; MemRefs are tracked
        tracker.access(mem, flat, ctx, is_write=True, loc=loc)
    """

    def __init__(self, grid: tuple[int, int, int], concurrent: bool = False):
        self.grid = grid
        self.concurrent = concurrent  # blocks run together (clusters), not only in block order
        self._shadows: dict[int, _Shadow] = {}  # id(storage) -> shadow
        self._sites: list = [None]
        self._site_ids: dict[int, int] = {}
        self._atomic_places: dict[int, set] = {}  # block -> elements it did atomics on
        # (block, block) pairs ordered by atomics or a cluster barrier
        self._ordered: set[tuple[int, int]] = set()

    def register(self, values: list) -> None:
        for value in values:
            if isinstance(value, MemRef) and not value.is_shared and value.storage.size:
                self._shadows.setdefault(id(value.storage), _Shadow(value))

    def linear_block(self, block_id: tuple) -> int:
        gx, gy, _ = self.grid
        return int(block_id[0] + gx * (block_id[1] + gy * block_id[2]))

    def _site(self, loc) -> int:
        key = id(loc)
        site = self._site_ids.get(key)
        if site is None:
            site = self._site_ids[key] = len(self._sites)
            self._sites.append(loc)
        return site & ((1 << _SITE_BITS) - 1)

    def access(self, mem: MemRef, flat: np.ndarray, ctx, is_write: bool, loc,
               width: int = 1) -> None:
        """Check and record a plain access of ``width`` consecutive elements at ``flat`` (one
        row per thread of ``ctx``, or one row for all) of a global memref."""
        shadow = self._shadows.get(id(mem.storage))
        if shadow is None:  # a private array, or shared memory
            return
        if shadow.writer is None:
            shadow.allocate()
        threads = ctx.thread_ids
        if flat.shape[0] == 1:
            first = int(np.argmax(ctx.active())) if ctx.mask is not None else 0
            threads = threads[first:first + 1]
        elif ctx.mask is not None:
            flat, threads = flat[ctx.mask], threads[ctx.mask]
        if width > 1:
            flat = (flat[:, None] + np.arange(width) * mem.strides[-1]).reshape(-1)
            threads = np.repeat(threads, width)
        if mem.buffer is not None:  # out-of-range buffer accesses touch nothing
            keep = (flat >= mem.buffer[0]) & (flat < mem.buffer[1])
            flat, threads = flat[keep], threads[keep]
        if not flat.size:
            return
        block = ctx.cta.linear_id + 1
        lo = block << _BLOCK_SHIFT  # this block's records are [lo, lo + 2**32)
        me = lo | (self._site(loc) << _THREAD_BITS) | threads
        records = [shadow.writer] if shadow.written else []
        if is_write:
            records.append(shadow.first_reader)
            if self.concurrent:
                records.append(shadow.last_reader)
        for record in records:
            seen = record[flat]
            # An earlier block's records lie in [1, lo) (0 wraps to the top as unsigned); only
            # the CTAs of a cluster, which run together, can have left records above.
            if (seen - 1).view(np.uint64).min() < lo - 1 or \
                    (self.concurrent and seen.max() >= lo + (1 << _BLOCK_SHIFT)):
                clash = (seen != 0) & ((seen >> _BLOCK_SHIFT) != block)
                self._clash(shadow, flat, me, seen, clash, is_write, record is shadow.writer,
                            ctx, loc)
        if is_write:
            shadow.writer[flat] = me
            shadow.written = True
        else:
            first = shadow.first_reader[flat]
            if first.min() == 0:  # some element's first load
                shadow.first_reader[flat] = np.where(first == 0, me, first)
            if self.concurrent:
                shadow.last_reader[flat] = me

    def atomic(self, mem: MemRef, flat: np.ndarray, ctx) -> None:
        """An atomic (or an acquire load of a counter) on elements ``flat`` of ``mem``: it
        orders this block with every block that did one on the same element."""
        if mem.is_shared:
            return
        places = self._atomic_places.setdefault(ctx.cta.linear_id, set())
        places.update((id(mem.storage), int(f)) for f in np.unique(flat))

    def order(self, blocks: list[int]) -> None:
        """A cluster barrier released the CTAs ``blocks`` (linear ids): they are ordered."""
        self._ordered.update((a, b) for a in blocks for b in blocks if a < b)

    def _ordered_with(self, a: int, b: int) -> bool:
        pair = (min(a, b), max(a, b))
        if pair in self._ordered:
            return True
        ours, theirs = self._atomic_places.get(a, ()), self._atomic_places.get(b, ())
        if ours and theirs and not ours.isdisjoint(theirs):
            self._ordered.add(pair)
            return True
        return False

    def _clash(self, shadow, flat, me, seen, clash, is_write, with_store, ctx, loc) -> None:
        block = ctx.cta.linear_id
        blocks = (seen >> _BLOCK_SHIFT) - 1
        racing = [b for b in np.unique(blocks[clash]).tolist()
                  if not self._ordered_with(block, b)]
        if not racing:
            return
        k = int(np.argmax(clash & (blocks == racing[0])))
        other = int(seen[k])
        other_thread = other & ((1 << _THREAD_BITS) - 1)
        other_site = self._sites[(other >> _THREAD_BITS) & ((1 << _SITE_BITS) - 1)]
        thread = int(me[k]) & ((1 << _THREAD_BITS) - 1)
        verb = "stores to" if is_write else "loads"
        other_verb = "stored" if with_store else "loaded"
        raise RaceError(
            f"thread {thread} of block {ctx.cta.block_id} {verb} "
            f"{_element(shadow.mem, int(flat[k]))} that thread {other_thread} of block "
            f"{self.block_id(racing[0])} {other_verb} at {other_site}: the blocks of a launch "
            "run in any order (and at once) on a GPU, so this is a race",
            fix="give each block its own elements (check the grid, BLOCK and num_warps: a "
                "block of more threads than BLOCK elements overlaps the next block), or use "
                "atomics", loc=loc)

    def block_id(self, linear: int) -> tuple[int, int, int]:
        gx, gy, _ = self.grid
        return (linear % gx, linear // gx % gy, linear // (gx * gy))


def _element(mem: MemRef, flat: int) -> str:
    """``element (i, j) of tensor 'x'`` for a storage index of a tensor argument."""
    rest = flat
    order = sorted(range(len(mem.strides)), key=lambda d: -mem.strides[d])
    coords = [0] * len(mem.strides)
    for d in order:
        if mem.strides[d]:
            coords[d], rest = divmod(rest, mem.strides[d])
    index = tuple(coords) if rest == 0 else (flat,)
    return f"element {index if len(index) > 1 else index[0]} of {mem.name}"
