"""Run-time state of the interpreter: memrefs, one CTA's shared memory, execution contexts.

Values are numpy arrays whose first axis runs over the threads of an execution context: shape
``(T,)`` for a scalar, ``(T, n)`` for a ``vector<n x ...>``. A value that is the same for every
thread (constants, block ids, uniform loop counters) keeps a first axis of size 1 and broadcasts,
which keeps most of the arithmetic of a kernel as cheap as one thread's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.core.errors import DeadlockError, OutOfBoundsError, RaceError, SourceLoc, UnsupportedError

from .phase_clock import PhaseClock

SHARED_SPACE = 3
POISON_BYTE = 0xFF  # fresh shared memory reads as NaN (floats) or -1 (ints)
NO_WRITER = -1
ALL_THREADS = -2  # a uniform store: every thread reads back its own value


@dataclass
class MemRef:
    """A memref descriptor over a flat typed ``storage`` array: offset, sizes, strides in elements.

    ``offset`` may be a per-thread array (a subview at a thread-dependent position); ``arena`` is
    the CTA's shared byte array for shared memrefs (``None`` for global ones); ``pointer`` is
    the element index of the descriptor's aligned pointer (a shared memref's address is
    ``pointer * itemsize`` bytes into the arena). ``buffer`` is the ``[lo, hi)`` range of
    storage indices an AMD buffer view may touch: outside it loads give 0 and stores vanish.
    """

    storage: np.ndarray
    offset: Any
    sizes: tuple
    strides: tuple
    name: str
    arena: np.ndarray | None = None
    pointer: int = 0
    buffer: tuple[int, int] | None = None

    @property
    def is_shared(self) -> bool:
        return self.arena is not None


@dataclass
class AsyncOp:
    """An in-flight asynchronous copy or MMA: names it in race messages; ``land`` (if any)
    writes its data when it completes."""

    what: str
    loc: SourceLoc | None
    land: Any = None
    touched: tuple = ()  # the byte-address arrays it marked pending (read or write)


def uniform(value: np.ndarray, mask, what: str, loc) -> Any:
    """The single value that every active thread holds (an interpreter limit otherwise)."""
    if value.shape[0] == 1:
        return value[0]
    active = value if mask is None else value[mask]
    first = active[0]
    if np.any(active != first):
        raise UnsupportedError(f"the interpreter needs {what} to be the same on every active "
                               "thread here", fix="compute it from warp-uniform values", loc=loc)
    return first


def select(cond: np.ndarray, a: Any, b: Any) -> Any:
    """Per-thread ``cond ? a : b`` for the results of a divergent ``scf.if`` or masked loop."""
    if a is b:
        return a
    if isinstance(a, np.ndarray):
        c = cond.reshape(cond.shape + (1,) * (a.ndim - 1))
        return np.where(c, a, b).astype(a.dtype, copy=False)
    if getattr(a, "merge", None) is not None:
        return a.merge(cond, b)
    if np.all(cond):
        return a
    if not np.any(cond):
        return b
    raise UnsupportedError(f"the interpreter cannot merge {type(a).__name__} values that "
                           "differ between threads of one execution context",
                           fix="keep descriptors, barriers and accumulators warp-group uniform")


class SharedMemory:
    """One CTA's shared memory: a byte arena plus race-tracking shadows of in-flight async ops."""

    def __init__(self, nbytes: int):
        nbytes = (nbytes + 15) // 16 * 16 or 16
        self.arena = np.full(nbytes, POISON_BYTE, np.uint8)
        self._views: dict[np.dtype, np.ndarray] = {}
        self.pending_write = np.zeros(nbytes, np.int32)  # id of the async op that will write a byte
        self.pending_read = np.zeros(nbytes, np.int32)  # id of the async op still reading a byte
        self.async_ops: dict[int, AsyncOp] = {0: AsyncOp("", None)}
        self.in_flight = 0
        # Plain-access race tracking: per byte, the thread that last stored it (-1: nobody or
        # an async copy; ALL_THREADS: every thread of a context stored the same value), the
        # synchronisation epoch of that store and the store's source line.
        self.writer = np.full(nbytes, NO_WRITER, np.int32)
        self.writer_epoch = np.zeros(nbytes, np.int32)
        self.writer_site = np.zeros(nbytes, np.int32)
        self.sites: list = [(None, "")]  # (source line, how the thread wrote) per site
        self.epoch = 1
        # TMA-landed bytes (allocated at the first landing): the landing that wrote each
        # (index into tma_loads, -1: none), the mbarrier's PhaseClock slot and the phase count
        # a toucher must have observed.
        self.tma_load = self.tma_slot = self.tma_phase = None
        self.tma_loads: list[str] = []  # "the TMA load issued at ... by thread ..."

    def view(self, dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        v = self._views.get(dtype)
        if v is None:
            v = self._views[dtype] = self.arena.view(dtype)
        return v

    def begin(self, what: str, loc, write_bytes=None, read_bytes=None, land=None) -> int:
        """Start an async op that will write ``write_bytes`` (calling ``land`` on completion)
        and/or keeps reading ``read_bytes``; returns its id for :meth:`end`."""
        op_id = len(self.async_ops)
        touched = tuple(b for b in (write_bytes, read_bytes) if b is not None)
        self.async_ops[op_id] = AsyncOp(what, loc, land, touched)
        if write_bytes is not None:
            self.check(write_bytes, True, f"{what}", loc)
            self.pending_write[write_bytes] = op_id
            self.writer[write_bytes] = NO_WRITER  # ordered by its own wait, checked above
            if self.tma_loads:
                self.tma_load[write_bytes] = -1
        if read_bytes is not None:
            self.check(read_bytes, False, f"{what}", loc)
            self.pending_read[read_bytes] = op_id
        self.in_flight += 1
        return op_id

    def end(self, op_id: int) -> None:
        op = self.async_ops[op_id]
        if op.land is not None:
            op.land()
        for pending in (self.pending_write, self.pending_read):
            for addrs in op.touched:  # only these bytes can hold its id
                pending[addrs[pending[addrs] == op_id]] = 0
        self.in_flight -= 1

    def synchronised(self) -> None:
        """A barrier released or an mbarrier phase completed: earlier stores are visible."""
        self.epoch += 1

    def record_store(self, byte_addrs: np.ndarray, threads, loc, how: str = "stored") -> None:
        """Plain store of ``byte_addrs`` (shape ``(k, bytes)``) by ``threads`` (shape ``(k,)``,
        or ``None`` when every active thread stored the same bytes); ``how`` says in race
        messages how the thread wrote them (an async copy landing counts as its issuer's
        store: its wait orders the data for the issuing thread only)."""
        last = self.sites[-1]
        if last[0] is not loc or last[1] != how:
            self.sites.append((loc, how))
        if self.tma_loads:
            self.tma_load[byte_addrs] = -1
        self.writer[byte_addrs] = ALL_THREADS if threads is None else threads[:, None]
        self.writer_epoch[byte_addrs] = self.epoch
        self.writer_site[byte_addrs] = len(self.sites) - 1

    def tma_landed(self, byte_addrs: np.ndarray, slot: int, phase: int, what: str) -> None:
        """A TMA load (``what`` names it) landed on ``byte_addrs`` with the completion of phase
        count ``phase`` of the mbarrier in PhaseClock slot ``slot``."""
        if self.tma_load is None:
            n = self.arena.size
            self.tma_load = np.full(n, -1, np.int32)
            self.tma_slot, self.tma_phase = np.zeros(n, np.int32), np.zeros(n, np.int32)
        self.tma_load[byte_addrs] = len(self.tma_loads)
        self.tma_slot[byte_addrs] = slot
        self.tma_phase[byte_addrs] = phase
        self.tma_loads.append(what)

    def check_observed(self, byte_addrs: np.ndarray, threads: np.ndarray, clock, rank: int,
                       verb: str, loc) -> None:
        """RaceError if a thread of ``threads`` touches TMA-landed bytes before observing the
        mbarrier phase they landed with. ``byte_addrs`` has one row per thread, or one row
        that every thread touches (a uniform access, or a warp-level read whose data reaches
        all of them)."""
        load = self.tma_load[byte_addrs]
        marked = load >= 0
        if not marked.any():
            return
        slots = np.where(marked, self.tma_slot[byte_addrs], 0)
        phases = self.tma_phase[byte_addrs]
        rows = rank * clock.per_cta + threads
        shared_row = byte_addrs.shape[0] == 1 and rows.shape[0] > 1
        if shared_row:  # what the least informed thread saw, then one gather per byte
            have = clock.seen[rows].min(axis=0)[slots]
        else:
            have = clock.seen[rows[:, None], slots]
        blind = marked & (have < phases)
        if not blind.any():
            return
        row, col = np.unravel_index(int(np.argmax(blind)), blind.shape)
        byte = int(byte_addrs[row, col])
        if shared_row:
            row = int(np.argmax(clock.seen[rows, slots[0, col]] < phases[0, col]))
        reader = int(threads[row])
        landing = self.tma_loads[int(self.tma_load[byte])]
        raise RaceError(f"thread {reader} {verb} shared byte {byte} that {landing}, but "
                        f"thread {reader} has not observed that mbarrier phase: it did "
                        "not wait on it, nor pass a barrier after a thread that did",
                        fix="wait on the mbarrier (try_wait) in every thread that reads the "
                            "tile, or put kiln.barrier() after the wait", loc=loc)

    def check_load(self, byte_addrs: np.ndarray, threads: np.ndarray, loc) -> None:
        """RaceError if a thread of ``threads`` loads a byte of ``byte_addrs`` (one row per
        thread, or one row read by all of them) that another thread stored since the last
        barrier."""
        writer = self.writer[byte_addrs]
        fresh = (writer >= 0) & (self.writer_epoch[byte_addrs] == self.epoch)
        if byte_addrs.shape[0] == threads.shape[0]:
            fresh &= writer != threads[:, None]
        elif threads.shape[0] == 1:
            fresh &= writer != threads[0]
        if not fresh.any():
            return
        row, col = np.unravel_index(int(np.argmax(fresh)), fresh.shape)
        reader = int(threads[row if threads.shape[0] > 1 else 0])
        if byte_addrs.shape[0] == 1 and threads.shape[0] > 1:
            reader = int(threads[threads != writer[row, col]][0])
        byte = int(byte_addrs[row, col])
        site, how = self.sites[int(self.writer_site[byte])]
        raise RaceError(f"thread {reader} loads shared byte {byte} that thread "
                        f"{int(writer[row, col])} {how} at {site} with no barrier in between",
                        fix="put kiln.barrier() (or an mbarrier wait) between the store and "
                            "the load (an async copy's wait orders it for the issuing thread "
                            "only)", loc=loc)

    def check(self, byte_addrs: np.ndarray, is_write: bool, what: str, loc) -> None:
        """Raise RaceError if ``byte_addrs`` touch the destination of an in-flight copy, or (for
        writes) a buffer an in-flight copy or MMA still reads."""
        if self.in_flight == 0:
            return
        hits = self.pending_write[byte_addrs]
        culprit = int(hits.max()) if hits.size else 0
        kind = "reads" if not is_write else "writes"
        if culprit:
            op = self.async_ops[culprit]
            raise RaceError(f"{what} {kind} shared memory that the {op.what} issued at "
                            f"{op.loc} has not finished writing",
                            fix="wait for the copy first (mbarrier wait / async wait) before "
                                "touching its destination", loc=loc)
        if is_write:
            readers = self.pending_read[byte_addrs]
            culprit = int(readers.max()) if readers.size else 0
            if culprit:
                op = self.async_ops[culprit]
                raise RaceError(f"{what} overwrites shared memory that the {op.what} issued at "
                                f"{op.loc} is still reading",
                                fix="wait for that operation (wait_group) before reusing the buffer",
                                loc=loc)


def thread_ranges(threads: np.ndarray) -> str:
    """``0-31, 64`` for the sorted thread ids ``[0, ..., 31, 64]``."""
    cuts = np.flatnonzero(np.diff(threads) != 1) + 1
    runs = [(int(r[0]), int(r[-1])) for r in np.split(threads, cuts) if r.size]
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def element_bytes(mem: MemRef, flat: np.ndarray) -> np.ndarray:
    """Byte addresses in the shared arena of the elements at ``flat`` of ``mem``."""
    size = mem.storage.itemsize
    return (flat.reshape(-1, 1) * size + np.arange(size)).reshape(-1)


def bounds_error(mem: MemRef, index: tuple, thread: int, ctx, loc) -> OutOfBoundsError:
    return OutOfBoundsError(
        f"index {tuple(int(i) for i in index)} is out of bounds for {mem.name} of shape "
        f"{tuple(int(s) for s in mem.sizes)} (thread {thread} of block {ctx.cta.block_id})",
        fix="mask the access (if i < n / mask=) or fix the index arithmetic", loc=loc)


@dataclass
class Context:
    """A group of threads of one CTA that execute in lock step (the whole CTA or a warp group).

    ``mask`` is ``None`` when every thread is active, else a bool array over the threads.
    """

    cta: "CTA"
    thread_ids: np.ndarray  # linear thread ids within the block, shape (T,)
    mask: Any = None
    waiting_on: str = ""
    async_groups: list = field(default_factory=list)  # committed (kind, [async op ids])
    pending_async: list = field(default_factory=list)  # TMA stores not yet committed
    pending_wgmma: list = field(default_factory=list)  # wgmma.mma_async not yet committed
    pending_cp_async: list = field(default_factory=list)  # cp.async copies not yet grouped

    @property
    def size(self) -> int:
        return self.thread_ids.shape[0]

    def active(self) -> np.ndarray:
        return np.ones(self.size, bool) if self.mask is None else self.mask


class Cluster:
    """The CTAs that run together (a thread-block cluster, or one CTA): one scheduler — lock,
    blocked contexts, first failure — and the cluster barrier (``barrier.cluster``)."""

    def __init__(self, shape: tuple[int, int, int], timeout: float):
        self.shape = shape
        self.ctas: list[CTA] = []  # by rank
        self.cond = threading.Condition()
        self.live = 0  # live contexts of all the cluster's CTAs
        self.blocked: dict[int, tuple] = {}  # context id -> (predicate, description)
        self.failed: BaseException | None = None
        self.timeout = timeout
        self.barrier_threads = 0  # threads arrived at the current cluster barrier phase
        self.barrier_generation = 0
        self.arrived_in: dict[int, int] = {}  # context id -> generation it arrived in
        self.clock = PhaseClock(0, 0)  # sized by the launcher once the CTAs are known

    def arrive(self, ctx: "Context") -> None:
        """``barrier.cluster.arrive``: this context's active threads arrive."""
        self.arrived_in[id(ctx)] = self.barrier_generation
        self.barrier_threads += int(ctx.active().sum())
        if self.barrier_threads >= sum(int(np.prod(c.block)) for c in self.ctas):
            self.barrier_threads = 0
            self.barrier_generation += 1
            for cta in self.ctas:
                cta.shared.synchronised()
            self.clock.join()
            if len(self.ctas) > 1:  # release/acquire: the CTAs' global accesses are ordered too
                self.ctas[0].globals.order([cta.linear_id for cta in self.ctas])
            self.cond.notify_all()

    def wait(self, ctx: "Context", loc) -> None:
        """``barrier.cluster.wait``: until every thread of the cluster arrived."""
        generation = self.arrived_in.pop(id(ctx), None)
        if generation is None:
            return  # no arrive of its own: nothing pending to wait for
        ctx.cta.block_until(ctx, lambda: self.barrier_generation != generation,
                            lambda: f"cluster barrier ({self.barrier_threads} threads of "
                                    f"{len(self.ctas)} CTAs arrived)", loc)


class CTA:
    """One block's shared state: shared memory, barriers; scheduling through its cluster."""

    def __init__(self, block_id: tuple, block: tuple, grid: tuple, shared_bytes: int,
                 cluster: Cluster, rank: int = 0):
        self.block_id = block_id
        self.block = block
        self.grid = grid
        self.shared = SharedMemory(shared_bytes)
        self.objects: dict[int, Any] = {}  # per-CTA objects created by ops (mbarrier groups)
        self.cluster = cluster
        self.rank = rank  # %cluster_ctarank
        self.check_bounds = True  # KILN_INTERPRET_CHECK_BOUNDS, read once per launch
        self.cond = cluster.cond
        self.live = 0  # live contexts of this CTA (gpu.barrier counts them)
        self._barrier_arrived = 0
        self._barrier_generation = 0
        # barrier id -> [threads arrived, generation, PhaseClock rows of each arrival...]
        self._named: dict[int, list] = {}
        self._named_votes: dict[tuple[int, int], bool] = {}  # (id, generation) -> bar.red.or

    @property
    def failed(self) -> BaseException | None:
        return self.cluster.failed

    @failed.setter
    def failed(self, err: BaseException) -> None:
        self.cluster.failed = err

    def object(self, key: int, factory) -> Any:
        obj = self.objects.get(key)
        if obj is None:
            obj = self.objects[key] = factory()
        return obj

    # ---- blocking (called with self.cond held by the running context) ----
    def block_until(self, ctx: Context, ready, what, loc) -> None:
        """Block ``ctx`` until ``ready()``; other contexts run meanwhile. Deadlock → error.

        ``what`` (a string, or a callable giving one when the deadlock is reported) names the
        wait in the error message."""
        if ready():
            return
        me = id(ctx)
        blocked = self.cluster.blocked
        blocked[me] = (ready, lambda: f"{what() if callable(what) else what} at {loc}")
        try:
            while not ready():
                self._check_deadlock(loc)
                self.cond.notify_all()
                if not self.cond.wait(self.cluster.timeout) and not ready():
                    self._fail(self._deadlock_error(loc, timed_out=True))
                if self.failed is not None:
                    raise ContextAborted()
        finally:
            blocked.pop(me, None)

    def _check_deadlock(self, loc) -> None:
        blocked = self.cluster.blocked
        if len(blocked) < self.cluster.live:
            return
        if any(ready() for ready, _ in blocked.values()):
            return
        self._fail(self._deadlock_error(loc, timed_out=False))

    def _deadlock_error(self, loc, timed_out: bool) -> DeadlockError:
        waits = "; ".join(describe() for _, describe in self.cluster.blocked.values())
        how = "timed out" if timed_out else "every execution context is blocked"
        return DeadlockError(f"deadlock in block {self.block_id}: {how}, waiting on {waits}",
                             fix="check mbarrier arrival counts, expect_tx byte counts and phases, "
                                 "and that every thread reaches each kiln.barrier()", loc=loc)

    def _fail(self, err: BaseException) -> None:
        if self.failed is None:
            self.failed = err
        self.cond.notify_all()
        raise err

    def notify(self) -> None:
        self.cond.notify_all()

    def barrier(self, ctx: Context, loc, what: str = "kiln.barrier()", unit: int = 1) -> None:
        """``gpu.barrier``: rendezvous every live context of the CTA. Every thread must arrive
        (``unit=1``), or for a wave-level barrier (``s_barrier``, ``unit`` = wave size) every
        wave with at least one active lane."""
        if ctx.mask is not None:
            self._check_converged(ctx, loc, what, unit)
        if self.live == 1:
            self.shared.synchronised()
            self.cluster.clock.join(self.clock_rows())
            return
        generation = self._barrier_generation
        self._barrier_arrived += 1
        if self._barrier_arrived >= self.live:
            self._release_barrier()
            return
        self.block_until(ctx, lambda: self._barrier_generation != generation,
                         "kiln.barrier() (gpu.barrier)", loc)

    def _check_converged(self, ctx: Context, loc, what: str, unit: int) -> None:
        """A CTA barrier that only some threads reach hangs (or is undefined) on a GPU."""
        unit = unit if ctx.size % unit == 0 else 1
        here = ctx.mask.reshape(-1, unit).any(axis=1).repeat(unit)
        if here.all():
            return
        raise DeadlockError(
            f"{what} in divergent control flow: threads {thread_ranges(ctx.thread_ids[here])} "
            f"of block {self.block_id} arrive here, threads "
            f"{thread_ranges(ctx.thread_ids[~here])} do not (they took another branch or left "
            "a loop earlier)",
            fix="move the barrier out of the if/loop so that every thread of the block reaches "
                "it (kiln.nvidia_asm.named_barrier syncs a subset of warps)",
            loc=loc)

    def named_barrier(self, ctx: Context, barrier_id: int, num_threads: int, loc) -> None:
        """``bar.sync id, n``: the arriving contexts' active threads count toward ``n``."""
        state = self._named.setdefault(barrier_id, [0, 0])
        generation = state[1]
        if self._arrive_named(ctx, state, num_threads):
            return
        self.block_until(ctx, lambda: state[1] != generation,
                         lambda: f"named barrier {barrier_id} ({state[0]} of {num_threads} "
                                 "threads arrived)", loc)

    def named_barrier_arrive(self, ctx: Context, barrier_id: int, num_threads: int,
                             loc) -> None:
        """``bar.arrive id, n``: count toward ``n`` like ``bar.sync`` but never wait."""
        self._arrive_named(ctx, self._named.setdefault(barrier_id, [0, 0]), num_threads)

    def named_barrier_any(self, ctx: Context, barrier_id: int, num_threads: int,
                          flags: np.ndarray, loc) -> bool:
        """``bar.red.or.pred id, n``: :meth:`named_barrier`, returning whether any arriving
        active thread's flag was set (the same answer for all ``n`` threads)."""
        generation = self._named.setdefault(barrier_id, [0, 0])[1]
        votes = self._named_votes
        key = (barrier_id, generation)
        votes[key] = votes.get(key, False) | bool((flags & ctx.active()).any())
        # Whoever votes in this generation has passed the last one, so every thread has read
        # the answer from two generations back.
        votes.pop((barrier_id, generation - 2), None)
        self.named_barrier(ctx, barrier_id, num_threads, loc)
        return votes[key]

    def _arrive_named(self, ctx: Context, state: list, num_threads: int) -> bool:
        """Count ``ctx``'s active threads into ``state`` ([arrived, generation, rows...]); the
        arrival that completes ``num_threads`` starts the next generation, joins the arrivers'
        PhaseClock knowledge and wakes the waiters."""
        state[0] += int(ctx.active().sum())
        state.append(self.cluster.clock.rows(ctx))
        if state[0] < num_threads:
            return False
        self.cluster.clock.join(np.concatenate(state[2:]))
        del state[2:]
        state[0] = 0
        state[1] += 1
        self.shared.synchronised()
        self.cond.notify_all()
        return True

    def clock_rows(self) -> np.ndarray:
        """PhaseClock rows of all this CTA's threads."""
        per = self.cluster.clock.per_cta
        return np.arange(self.rank * per, (self.rank + 1) * per)

    def _release_barrier(self) -> None:
        self.shared.synchronised()
        self.cluster.clock.join(self.clock_rows())
        self._barrier_arrived = 0
        self._barrier_generation += 1
        self.cond.notify_all()

    def context_finished(self) -> None:
        self.live -= 1
        self.cluster.live -= 1
        if 0 < self.live <= self._barrier_arrived:
            self._release_barrier()
        self.cond.notify_all()


class ContextAborted(Exception):
    """Raised in the other contexts of a CTA once one of them failed."""
