"""Distributed shared memory (sm_90+): a thread stores into the shared memory of another CTA of
its thread-block cluster.

:func:`store_remote` writes one 32-bit element of a ``kiln.shared`` buffer in the CTA of rank
``rank`` (``mapa.shared::cluster`` maps this CTA's address of the element to that CTA's, then
``st.shared::cluster.b32``). The peer reads it after a cluster barrier
(``kiln.nvidia_asm.cluster_sync`` or ``barrier.cluster.arrive`` + ``wait``): the arrive
releases the store and the wait acquires it. A CTA must not exit while a peer may still store
into its shared memory.

Example (every CTA of a pair sends its partial sum to both)::

    buf = kiln.shared((2,), kiln.f32)
    if kiln.thread_id(0) < 2:
        store_remote(buf, rank, partial, kiln.thread_id(0))
    kiln.nvidia_asm.cluster_sync()
    total = buf[0] + buf[1]
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import arith

from .. import builder
from ..core import dtypes as dt
from ..core.errors import KilnTypeError, UnsupportedError
from ..core.ops import Effects, declare
from ..shared import SharedTensor
from ..values import cast, to_value

# writer ids the interpreter records for a peer's stores: never a thread id of this CTA, so a
# read before the cluster barrier is a race
_PEER_WRITER = 4096


def _store_remote_semantics(op, plan):
    """Interpreter semantics of :data:`STORE_REMOTE`: each active thread writes its 4 bytes at
    its byte address in the shared memory of the CTA of its rank."""
    address, rank, value = plan.operands(op)
    loc = plan.location(op)

    def run(env, ctx):
        active = ctx.active()
        n = ctx.size
        addrs = np.broadcast_to(env[address], (n,)).astype(np.int64)[active]
        ranks = np.broadcast_to(env[rank], (n,)).astype(np.int64)[active]
        words = np.ascontiguousarray(np.broadcast_to(env[value], (n,))).view(np.uint32)[active]
        threads = ctx.thread_ids[active]
        ctas = ctx.cta.cluster.ctas
        if ((ranks < 0) | (ranks >= len(ctas))).any():
            bad = int(ranks[(ranks < 0) | (ranks >= len(ctas))][0])
            raise UnsupportedError(f"a remote shared store to CTA rank {bad}, but the cluster "
                                   f"has {len(ctas)} CTAs", fix=f"use a rank in 0..{len(ctas) - 1}",
                                   loc=loc)
        for r in np.unique(ranks):
            mine = ranks == r
            shared = ctas[int(r)].shared
            byte_addrs = addrs[mine][:, None] + np.arange(4)
            if (byte_addrs < 0).any() or (byte_addrs >= shared.arena.size).any():
                raise UnsupportedError("a remote shared store past the end of the peer's shared "
                                       "memory", fix="index inside the kiln.shared buffer",
                                       loc=loc)
            shared.check(byte_addrs.reshape(-1), True, "this remote shared store", loc)
            shared.view(np.uint32)[addrs[mine] // 4] = words[mine]
            shared.record_store(byte_addrs, threads[mine] + _PEER_WRITER * (ctx.cta.rank + 1),
                                loc, "stored (from a peer CTA)")

    return run


# A plain store into a peer's shared memory, ordered by the cluster barrier like any store.
STORE_REMOTE = declare("nvidia.dsmem.store_remote", feature="sm90",
                       effects=Effects(indirect_shared=True), interpret=_store_remote_semantics,
                       doc="store 32 bits into another cluster CTA's shared memory")


def store_remote(buffer: SharedTensor, index: tuple | Any, value: Any, rank: Any) -> None:
    """Store the 32-bit scalar ``value`` into element ``index`` of ``buffer`` in the shared
    memory of the CTA of cluster rank ``rank`` (this CTA's rank included).

    Example: ``store_remote(partials, (0, my_rank), total, peer)``.
    """
    STORE_REMOTE.require(builder.current_target(), "kiln.nvidia.dsmem.store_remote")
    if not isinstance(buffer, SharedTensor):
        raise KilnTypeError(f"store_remote stores into a kiln.shared buffer, got "
                            f"{type(buffer).__name__}", fix="allocate it with kiln.shared(...)")
    value = to_value(value, buffer.dtype)
    if value.dtype.itemsize != 4 or value.shape:
        raise KilnTypeError(f"store_remote stores a 32-bit scalar, got {value.dtype} "
                            f"{value.shape}", fix="cast to kiln.f32 or kiln.i32 first")
    index = index if isinstance(index, tuple) else (index,)
    i32 = ir.IntegerType.get_signless(32)
    peer = cast(to_value(rank, dt.i32), dt.i32).ir
    word = value.ir if value.dtype is dt.i32 else arith.bitcast(i32, value.ir)
    asm = ("{ .reg .b64 %remote; mapa.shared::cluster.u64 %remote, $0, $1; "
           "st.shared::cluster.b32 [%remote], $2; }")
    STORE_REMOTE.inline_asm(ir.Type.parse("!llvm.void"),
                            [buffer.element_address(*index), peer, word], asm, "l,r,r")

