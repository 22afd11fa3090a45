"""Shared-memory mbarriers (sm_90+): the completion signal of TMA loads and producer/consumer rings.

A thin layer over upstream ``nvgpu.mbarrier.*``. An mbarrier completes a *phase* when its
expected arrivals and expected transaction bytes have all arrived; waiters name the phase by its
parity (0, 1, 0, 1, ...). :class:`PhaseTracker` computes that parity so kernels never do.

Example (one CTA, one elected thread issues a TMA load, everyone waits)::

    bars = kiln.mbarrier.group(num_barriers=1)
    leader = tid == 0
    bars.init(0, count=1, predicate=leader)
    bars.arrive_expect_tx(0, kiln.tma.box_bytes(a_map), predicate=leader)
    kiln.tma.load(a_map, a_smem, (0, 0), bars, 0, predicate=leader)
    bars.try_wait(0, phase=0)
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, nvgpu, nvvm

from ..core.errors import KilnValueError
from ..core.ops import WGMMA, Effects, constant_int, declare
from .sync import as_index, as_predicate, current_target, ir_value

# Spin budget per try_wait poll before the hardware suspends the thread; upstream's default.
DEFAULT_TICKS = 10_000_000
SHARED_MEMORY_SPACE = 3
SHARED_CLUSTER_SPACE = 7  # NVPTX address space of another CTA's shared memory (shared::cluster)
MAX_BARRIERS = 1024  # nvgpu.mbarrier.group is a static shared array; keep it a sane size


# try_wait retires the TMA loads of the phase it waits for (operands: group, parity, ticks, index).
# mbarrier ops touch only the barrier words, no shared data (data=False).
TRY_WAIT = declare("nvidia.mbarrier.try_wait", feature="sm90",
                   mlir_names=("nvgpu.mbarrier.try_wait.parity",),
                   effects=Effects(mbarrier=lambda op: (op.operands[0],
                                                        constant_int(op.operands[3])),
                                   ring=lambda op: ("wait", op.operands[0], op.operands[3],
                                                    op.operands[1]),
                                   blocks=True, data=False))
TEST_WAIT = declare("nvidia.mbarrier.test_wait", feature="sm90",
                    mlir_names=("nvgpu.mbarrier.test.wait",),
                    effects=Effects(blocks=True, data=False))
CREATE = declare("nvidia.mbarrier.create", feature="sm90",
                 mlir_names=("nvgpu.mbarrier.create", "nvgpu.mbarrier.init", "nvgpu.mbarrier.get"),
                 effects=Effects(data=False))
# A release arrive declares the WGMMA groups still allowed to read what it hands back.
WGMMA_PENDING_ATTR = "kiln.wgmma_pending"
# A plain arrive that completes a use of a full ring its threads' stores filled (fills=True).
FILLS_ATTR = "kiln.ring_fill"


def _releases(op) -> dict:
    """``{wgmma: N}`` for an arrive declared with ``wgmma_pending=N``, else no release."""
    if WGMMA_PENDING_ATTR not in op.attributes:
        return {}
    return {WGMMA: ir.IntegerAttr(op.attributes[WGMMA_PENDING_ATTR]).value}


def _ring_arrive(op) -> tuple:
    """An arrive with expect_tx opens a use of its ring (an "arm"); a plain one releases,
    unless declared ``fills=True`` (thread stores filled the buffer: a "fill", like a load's)."""
    view = op.opview
    role = "arm" if op.name == "nvgpu.mbarrier.arrive.expect_tx" else \
        "fill" if FILLS_ATTR in op.attributes else "release"
    return role, view.barriers, view.mbarId, None


ARRIVE = declare("nvidia.mbarrier.arrive", feature="sm90",
                 mlir_names=("nvgpu.mbarrier.arrive", "nvgpu.mbarrier.arrive.expect_tx"),
                 effects=Effects(arrives=lambda op: op.operands[0], releases=_releases,
                                 ring=_ring_arrive, data=False))
# The stage count a PhaseTracker gives its group's ring (default: the group's size), on the
# nvgpu.mbarrier.create op; the passes read it to derive each wait's use (mbarrier_rings).
RING_STAGES_ATTR = "kiln.ring_stages"
# The same id on a full and an empty group's create: kiln-insert-waits waits on that empty ring
# before the full ring's arms (kiln.tile_tma's tiles handed back without a block barrier).
RING_PAIR_ATTR = "kiln.ring_pair"
def _remote_group(op):
    """The group an ``arrive_cluster`` arrives on: its address comes from ``mbarrier.get``
    through casts and ``mapa`` (None for the ``mapa`` itself)."""
    if op.name != "nvvm.mbarrier.arrive":
        return None
    value = op.operands[0]
    for _ in range(8):  # get -> inttoptr -> mapa -> arrive, a few casts at most
        owner = value.owner
        if isinstance(owner, ir.Block) or not owner.operation.operands:
            return None
        if owner.operation.name == "nvgpu.mbarrier.get":
            return owner.operation.operands[0]
        value = owner.operation.operands[0]
    return None


ARRIVE_CLUSTER = declare("nvidia.mbarrier.arrive_cluster", feature="sm90",
                         mlir_names=("nvvm.mapa", "nvvm.mbarrier.arrive"),
                         effects=Effects(arrives=_remote_group, releases=_releases,
                                         data=False))


def group_type(num_barriers: int) -> ir.Type:
    """``!nvgpu.mbarrier.group`` with ``num_barriers`` barriers in shared memory."""
    # The Python bindings have no typed getter for this nvgpu type, so it is parsed.
    return ir.Type.parse("!nvgpu.mbarrier.group<memorySpace = #gpu.address_space<workgroup>, "
                         f"num_barriers = {num_barriers}>")


class MBarrierGroup:
    """``num_barriers`` mbarriers in shared memory, addressed by index (int or traced).

    Flows through ``if``/``for`` like any Kiln handle (``__kiln_flatten__`` protocol).
    """

    def __init__(self, value: ir.Value, num_barriers: int):
        self.ir = value
        self.num_barriers = num_barriers

    def __kiln_flatten__(self):
        return [self.ir], self.num_barriers

    @classmethod
    def __kiln_unflatten__(cls, aux, values):
        return cls(values[0], aux)

    def _index(self, i) -> ir.Value:
        if isinstance(i, int) and not isinstance(i, bool) and not 0 <= i < self.num_barriers:
            raise KilnValueError(f"mbarrier index {i} is out of range for a group of "
                                 f"{self.num_barriers}",
                                 fix=f"use an index in 0..{self.num_barriers - 1} or a larger "
                                     "kiln.mbarrier.group(num_barriers=...)")
        return as_index(i, "mbarrier index")

    def init(self, i, count, *, predicate=None) -> None:
        """Initialise barrier ``i`` to expect ``count`` arrivals per phase (one thread does it)."""
        if isinstance(count, int) and count < 1:
            raise KilnValueError(f"mbarrier arrival count must be >= 1, got {count}",
                                 fix="count the threads (or elected threads) that will arrive")
        nvgpu.mbarrier_init(self.ir, as_index(count, "arrival count"), self._index(i),
                            predicate=as_predicate(predicate))

    def arrive(self, i, *, wgmma_pending: int | None = None, fills: bool = False) -> None:
        """Arrive on barrier ``i`` (counts toward the expected arrivals).

        ``fills=True`` declares that the arrive completes a use of a *full* ring whose buffer
        the arriving threads filled with ordinary stores (then ``fence_proxy_async`` when a
        WGMMA or TMA reads it): the ring passes are told it is filled like a TMA-loaded one,
        so its waits are a full ring's. Example (FP8 attention's V transpose):
        ``store ...; kiln.nvidia_asm.fence_proxy_async(); vt_full.arrive(stage, fills=True)``.

        ``wgmma_pending=N`` declares a release: the buffer handed back was read by WGMMA groups
        older than the newest ``N``, so ``kiln-verify-waits`` requires those retired here (a
        missing ``kiln.wgmma.wait_group(N)`` is then an error naming the WGMMA).
        Example: ``wgmma.wait_group(1); empty.arrive(previous, wgmma_pending=1)``.
        """
        token_type = ir.Type.parse("!nvgpu.mbarrier.token")  # no typed getter in the bindings
        token = nvgpu.mbarrier_arrive(self.ir, self._index(i), results=[token_type])
        _declare_release(token.owner, wgmma_pending)
        if fills:
            token.owner.attributes[FILLS_ATTR] = ir.UnitAttr.get()

    def arrive_cluster(self, i, cta_rank, *, wgmma_pending: int | None = None) -> None:
        """Arrive on barrier ``i`` of the CTA of rank ``cta_rank`` in this cluster (this CTA's
        rank included): ``mapa`` to the peer's address of the barrier, then
        ``mbarrier.arrive.release.cta.shared::cluster``. This is how a consumer tells every
        producer that multicasts into its shared memory that a stage is free.
        ``wgmma_pending`` declares a release, as in :meth:`arrive`.
        Example: ``empty.arrive_cluster(stage, 1 - kiln.nvidia_asm.cluster_ctarank())``.
        """
        ARRIVE_CLUSTER.require(current_target(), "MBarrierGroup.arrive_cluster")
        i32 = ir.IntegerType.get_signless(32)
        address = nvgpu.mbarrier_get(i32, self.ir, self._index(i))  # 32-bit shared address
        local = llvm.inttoptr(llvm.PointerType.get(SHARED_MEMORY_SPACE), address)
        rank = arith.constant(i32, cta_rank) if isinstance(cta_rank, int) else \
            arith.index_cast(i32, as_index(cta_rank, "CTA rank"))
        remote = nvvm.mapa(llvm.PointerType.get(SHARED_CLUSTER_SPACE), local, rank)
        # Release at CTA scope, as CUTLASS's cluster barrier does: the WGMMA reads of the stage
        # have completed (wgmma.wait_group) and the peer's TMA write is ordered by the barrier.
        _declare_release(nvvm.MBarrierArriveOp(None, remote), wgmma_pending)

    def arrive_expect_tx(self, i, nbytes, *, predicate=None) -> None:
        """Arrive on barrier ``i`` and expect ``nbytes`` more bytes of async (TMA) transactions.

        ``nbytes`` is the sum of the boxes loaded on this barrier, e.g. from
        :func:`kiln.tma.box_bytes`.
        """
        if isinstance(nbytes, int) and not 0 < nbytes < 2**20:
            raise KilnValueError(f"mbarrier transaction count must be in 1..2^20-1 bytes, got "
                                 f"{nbytes}", fix="split the loads over several barriers")
        nvgpu.mbarrier_arrive_expect_tx(self.ir, as_index(nbytes, "transaction bytes"),
                                        self._index(i), predicate=as_predicate(predicate))

    def try_wait(self, i, phase, *, ticks: int = DEFAULT_TICKS) -> None:
        """Block until barrier ``i`` completes the phase of parity ``phase`` (0/1, or traced).

        Lowers to a ``mbarrier.try_wait.parity`` retry loop. Prefer :class:`PhaseTracker` over
        hand-computed parities in loops.
        """
        nvgpu.mbarrier_try_wait_parity(self.ir, _as_parity(phase),
                                       as_index(ticks, "ticks"), self._index(i))


def _declare_release(op, wgmma_pending) -> None:
    """Stamp ``kiln.wgmma_pending`` on a release arrive (none when ``wgmma_pending`` is None)."""
    if wgmma_pending is None:
        return
    if isinstance(wgmma_pending, bool) or not isinstance(wgmma_pending, int) \
            or not 0 <= wgmma_pending <= 7:
        raise KilnValueError(f"wgmma_pending must be an int in 0..7, got {wgmma_pending!r}",
                             fix="pass the N of the kiln.wgmma.wait_group(N) before the arrive")
    op.operation.attributes[WGMMA_PENDING_ATTR] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), wgmma_pending)


def _record_stages(barriers: MBarrierGroup, stages: int) -> None:
    """Stamp the ring's stage count on the group's ``nvgpu.mbarrier.create`` (kept out of the
    lowered code), so the wait passes derive slot and parity with it; a second tracker on the
    same group must agree."""
    owner = barriers.ir.owner
    if isinstance(owner, ir.Block) or owner.operation.name != "nvgpu.mbarrier.create":
        return  # a group passed in from elsewhere: the passes use its size
    attrs = owner.operation.attributes
    if RING_STAGES_ATTR in attrs and ir.IntegerAttr(attrs[RING_STAGES_ATTR]).value != stages:
        raise KilnValueError(f"PhaseTracker stages={stages} disagrees with another tracker of "
                             f"the same mbarrier group "
                             f"(stages={ir.IntegerAttr(attrs[RING_STAGES_ATTR]).value})",
                             fix="use one stage count per ring")
    attrs[RING_STAGES_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), stages)


def group(num_barriers: int = 1) -> MBarrierGroup:
    """Allocate ``num_barriers`` mbarriers in shared memory (``nvgpu.mbarrier.create``).

    Example: ``bars = kiln.mbarrier.group(num_barriers=stages)``.
    """
    CREATE.require(current_target(), "kiln.mbarrier.group")
    if not isinstance(num_barriers, int) or not 1 <= num_barriers <= MAX_BARRIERS:
        raise KilnValueError(f"num_barriers must be an int in 1..{MAX_BARRIERS}, got "
                             f"{num_barriers!r}", fix="pass the pipeline depth, e.g. 2 or 3")
    return MBarrierGroup(nvgpu.mbarrier_create(group_type(num_barriers)), num_barriers)


def _as_parity(phase) -> ir.Value:
    i1 = ir.IntegerType.get_signless(1)
    if isinstance(phase, (bool, int)):
        if phase not in (0, 1):
            raise KilnValueError(f"mbarrier phase parity must be 0 or 1, got {phase}",
                                 fix="use kiln.mbarrier.PhaseTracker to compute parities")
        return arith.constant(i1, int(phase))
    value = ir_value(phase, "phase")
    if value.type == i1:
        return value
    # Only the low bit matters: parity of a traced phase counter.
    as_i64 = arith.index_cast(ir.IntegerType.get_signless(64), as_index(phase, "phase"))
    return arith.trunci(i1, as_i64)


class PhaseTracker:
    """Which barrier of a ring of ``stages`` and which parity the ``n``-th use waits on.

    Use ``n`` = the loop iteration (int or traced). Barrier ``n % stages`` is reused every
    ``stages`` iterations, and each reuse is the next phase, so its parity is
    ``(n // stages) % 2``::

        ring = kiln.mbarrier.PhaseTracker(bars)       # stages = bars.num_barriers
        for k in range(num_k_tiles):
            ring.wait(k)                              # waits bars[k % S] at the right parity

    The stage count is recorded on the group (``kiln.ring_stages``): the wait passes derive
    each wait's use from it and prove it by counting (:mod:`kiln.passes.mbarrier_rings`).
    """

    def __init__(self, barriers: MBarrierGroup, stages: int | None = None):
        self.barriers = barriers
        self.stages = barriers.num_barriers if stages is None else stages
        if not 1 <= self.stages <= barriers.num_barriers:
            raise KilnValueError(f"PhaseTracker stages={self.stages} must be in 1.."
                                 f"{barriers.num_barriers} (the group's size)",
                                 fix="allocate one barrier per pipeline stage")
        _record_stages(barriers, self.stages)

    def slot(self, n):
        """``(barrier index, parity)`` for use ``n``: Python ints for an int ``n``, else traced
        ``index`` / ``i1`` values."""
        if isinstance(n, int) and not isinstance(n, bool):
            return n % self.stages, (n // self.stages) % 2
        n_index = as_index(n, "iteration")
        stages = arith.constant(ir.IndexType.get(), self.stages)
        index = arith.remui(n_index, stages)
        wraps = arith.divui(n_index, stages)
        parity = arith.trunci(ir.IntegerType.get_signless(1),
                              arith.index_cast(ir.IntegerType.get_signless(64), wraps))
        return index, parity

    def wait(self, n, *, ticks: int = DEFAULT_TICKS) -> None:
        """Wait until use ``n``'s barrier completes its phase."""
        index, parity = self.slot(n)
        self.barriers.try_wait(index, parity, ticks=ticks)
