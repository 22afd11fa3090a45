"""``kiln.release`` and ``kiln.Turns``: a ring of shared tiles without a block barrier a step.

A loop that refills shared tiles (K and V of attention, A and B of a GEMM) needs every thread
done reading a tile before the next copy overwrites it. A ``kiln.barrier()`` a step says so
and also holds every warp to the slowest one. ``kiln.release(*tiles)`` says it per tile:

=========================  ==================================================================
tiles TMA loaded (sm_90a)  every thread arrives on each tile's *empty* mbarrier (arrival count:
                           the block's threads); the next TMA copy into the tile waits for all
                           those arrivals (``kiln-insert-waits`` places that wait before the
                           copy's ``arrive.expect_tx``, ``kiln-verify-waits`` proves its phase).
                           Before the arrive, every WGMMA group that reads the tiles is retired
                           (``wgmma.wait_group``, placed and proven by the same passes); the
                           newest group may stay in flight when it reads none of them
otherwise                  one ``kiln.barrier()``: correct for any copy, as a barrier a step is
=========================  ==================================================================

Release a tile once per fill: a release of a tile never filled lets a later copy pass one
use early. A tile TMA fills takes no other copies (refused when the kernel is traced).

``kiln.Turns()`` orders the warpgroups of a block (sm_90a, 256+ threads): ``with turns:``
around a step's MMA issues lets one warpgroup in at a time, in turn (warpgroup ``g`` waits on
named barrier ``1 + g`` and hands the turn to ``g + 1`` with ``bar.arrive``), so one
warpgroup's softmax runs beside the other's GEMMs (FlashAttention-3's ping-pong). Every
warpgroup must take the same number of turns; ``turns.close()`` after the loop takes the last
hand-over. Elsewhere (one warpgroup, ``mma.sync``, MFMA) it is a no-op. It uses named
barriers ``1 .. G`` (G warpgroups). Opt-in: the attention tutorial ran slower with it (H200:
547 against 599 TFLOP/s; without a block barrier its warpgroups drift apart by themselves).

Example (the attention tutorial's step, here with turns: K_j and V_j-1 handed back; the
stages of K_j-1 and V_j-2, handed back a step ago, refilled)::

    turns = kiln.Turns()
    for ...:
        with turns:
            s = kiln.gemm(q_s, k_s[st].T, s0)
            acc = kiln.gemm(p, v_s[st - 1], acc * alpha)
        ...softmax of s...
        kiln.release(k_s[st], v_s[st - 1])
        kiln.copy(kiln.GlobalTile(k, ...), k_s[st - 1])
        kiln.copy(kiln.GlobalTile(v, ...), v_s[st - 2])
    turns.close()
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, scf

from . import builder, ops, tile_tma
from .core.errors import KilnTypeError, KilnValueError, source_loc_from_mlir
from .nvidia import sync
from .shared_tile import SharedTile
from .values import to_value

WARPGROUP = 128          # threads of a warpgroup (WGMMA's unit)
TURN_THREADS = 2 * WARPGROUP  # a turn's named barrier: the waiting and the handing warpgroup
FIRST_TURN_BARRIER = 1   # named barrier 0 is kiln.barrier()'s


def release(*tiles: SharedTile) -> None:
    """Hand ``tiles`` back to their next copy (see the module table): this thread reads them no
    more. What it compiles to is decided once the kernel is traced (whether TMA fills the
    tiles: a tile's first copy may come after its first release).

    Example: ``kiln.release(k_s[st], v_s[st - 1])``.
    """
    if not tiles or not all(isinstance(t, SharedTile) for t in tiles):
        raise KilnTypeError(f"kiln.release takes shared tiles, got {tiles!r}",
                            fix="kiln.release(k_s[stage]) with tiles of kiln.tiles.operand_tile "
                                "or kiln.SharedTile")
    mark = arith.ConstantOp(ir.IntegerType.get_signless(32), 0)   # where it goes
    builder.current().finishers.append(lambda: _resolve(mark, tiles))


def _resolve(mark, tiles) -> None:
    """Build the release ``mark`` holds the place of: arrives on the empty mbarriers of the
    tiles TMA loads, a block barrier if any other tile remains."""
    by_tma = [t for t in tiles if getattr(t, "_tma_barrier", None) is not None]
    for tile in by_tma:
        if getattr(tile, "_copied_other", False):
            raise KilnValueError(
                "kiln.release of a shared tile that both TMA and other copies fill: the "
                "others would not wait for the release", loc=source_loc_from_mlir(mark.location),
                fix="fill the tile by TMA only (align=16, masks at the tensor's extents), or "
                    "by cp.async only (e.g. align=2)")
    with ir.InsertionPoint(mark), mark.location:
        if by_tma:
            tile_tma.release(by_tma)
        if len(by_tma) < len(tiles):
            ops.barrier()
    mark.operation.erase()


def note_copy(dst: SharedTile) -> None:
    """A copy into ``dst`` that does not go by TMA: refused when ``dst`` is handed back by its
    mbarrier in a kiln.pipeline(handoff=True) (it would not wait for the release); noted for
    :func:`release`."""
    dst._copied_other = True
    if getattr(dst, "_tma_empty", None) is not None:
        raise KilnValueError(
            "kiln.copy into a shared tile that kiln.pipeline(handoff=True) hands back by its "
            "TMA mbarrier, but this copy does not go by TMA",
            fix="copy into it only by TMA (align=16, masks at the tensor's extents)")


class Turns:
    """The warpgroups of a block issue their MMAs in turn (module docs): ``with turns:``.

    Example: ``turns = kiln.Turns()``; in the loop ``with turns: s = kiln.gemm(...)``; after
    it ``turns.close()``.
    """

    def __init__(self):
        threads = builder.current().block[0]
        self.groups = threads // WARPGROUP if builder.current_target().has_wgmma \
            and threads % WARPGROUP == 0 else 1
        self.closed = False
        if self.groups < 2:
            return
        self.group = ops.thread_id(0) // WARPGROUP
        # warpgroup 0 goes first: the last one has handed it the turn
        self._when(self.group == self.groups - 1,
                   lambda: sync.named_barrier_arrive(FIRST_TURN_BARRIER, TURN_THREADS))

    def __enter__(self) -> "Turns":
        if self.closed:
            raise KilnValueError("kiln.Turns used after close()",
                                 fix="close() once, after the loop of turns")
        if self.groups > 1:
            sync.named_barrier(self.group + FIRST_TURN_BARRIER, TURN_THREADS)
        return self

    def __exit__(self, *exc) -> None:
        if self.groups > 1 and exc[0] is None:
            sync.named_barrier_arrive((self.group + 1) % self.groups + FIRST_TURN_BARRIER,
                                      TURN_THREADS)

    def close(self) -> None:
        """Take the last warpgroup's final hand-over (warpgroup 0), so no barrier is left
        half-arrived when the block ends."""
        if self.groups > 1 and not self.closed:
            self._when(self.group == 0,
                       lambda: sync.named_barrier(FIRST_TURN_BARRIER, TURN_THREADS))
        self.closed = True

    @staticmethod
    def _when(condition, emit) -> None:
        branch = scf.IfOp(to_value(condition).ir)
        with ir.InsertionPoint(branch.then_block):
            emit()
            scf.YieldOp([])


__all__ = ["release", "Turns"]
