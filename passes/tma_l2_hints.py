"""``kiln-tma-l2-hints``: TMA loads that asked for an L2 eviction priority get it (NVIDIA).

``kiln.tma.load(..., eviction_policy="evict_first")`` emits an ordinary
``nvgpu.tma.async.load``: that op has no cache-hint operand, and ``convert-nvgpu-to-nvvm``
builds its ``nvvm.cp.async.bulk.tensor.shared.cluster.global`` without one. The conversion
keeps the op's location, though, so the front end names a hinted load's location
``kiln.l2.<policy>`` (:data:`kiln.tma.L2_HINT_LOCATION`). Run right after that conversion,
this pass rebuilds each such nvvm op with an ``l2CacheHint`` operand made by
``createpolicy.fractional.L2::<policy>.b64`` (:func:`kiln.nvidia_asm.l2_cache_policy`) and
drops the name from the location. PTX then reads ``cp.async.bulk.tensor... .L2::cache_hint``.

Example (``kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-tma-l2-hints)'``)::

    nvvm.cp.async.bulk.tensor.shared.cluster.global %dst, %map, %bar, box[%x, %y]
        : !llvm.ptr<7>, !llvm.ptr loc("kiln.l2.evict_first"("k.py":12:5))
    // becomes
    %policy = llvm.inline_asm "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l"
    nvvm.cp.async.bulk.tensor.shared.cluster.global %dst, %map, %bar, box[%x, %y]
        l2_cache_hint = %policy : !llvm.ptr<7>, !llvm.ptr loc("k.py":12:5)
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import nvvm

from kiln.core.errors import InternalError
from kiln.nvidia.sync import l2_cache_policy
from kiln.passes import register_pass
from kiln.nvidia.tma import L2_HINT_LOCATION

NAME = "kiln-tma-l2-hints"
TMA_LOAD = "nvvm.cp.async.bulk.tensor.shared.cluster.global"
# Attributes the rebuilt op copies from the converted one (its operands are passed apart).
COPIED_ATTRIBUTES = ("mode", "isCTAOnly", "group")


def hinted_policy(location: ir.Location) -> str | None:
    """The eviction policy a ``kiln.l2.<policy>`` location names (checked by
    :func:`~kiln.nvidia_asm.l2_cache_policy`), else None."""
    if not location.is_a_name() or not location.name_str.startswith(L2_HINT_LOCATION):
        return None
    return location.name_str[len(L2_HINT_LOCATION):]


def add_tma_l2_hints(op: ir.Operation, pass_=None) -> None:
    """Give every TMA load whose location names a policy that policy's ``l2CacheHint``."""
    hinted = []

    def collect(candidate: ir.Operation):
        if candidate.name == TMA_LOAD:
            policy = hinted_policy(candidate.location)
            if policy is not None:
                hinted.append((candidate, policy))
        return ir.WalkResult.ADVANCE

    op.walk(collect, ir.WalkOrder.PRE_ORDER)
    for load, policy in hinted:
        view = load.opview
        if view.l2CacheHint is not None:
            raise InternalError(f"{TMA_LOAD} already carries an L2 cache hint")
        attributes = {name: load.attributes[name] for name in COPIED_ATTRIBUTES
                      if name in load.attributes}
        with ir.InsertionPoint(load), load.location.child_loc:
            nvvm.CpAsyncBulkTensorGlobalToSharedClusterOp(
                view.dstMem, view.tmaDescriptor, list(view.coordinates), view.mbar,
                list(view.im2colOffsets), multicastMask=view.multicastMask,
                l2CacheHint=l2_cache_policy(policy), predicate=view.predicate, **attributes)
        load.erase()


register_pass(NAME, add_tma_l2_hints,
              "TMA loads get the L2 cache hint their kiln.l2.<policy> location names")
