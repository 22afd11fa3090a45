"""AMD-only building blocks: wait counters, barriers, priorities, scheduling hints, async tokens.

The one place for thin wrappers over ``rocdl`` intrinsics (each is one upstream op, no inline
assembly). Example (inside a ``@kiln.kernel`` for gfx950)::

    token = kiln.amd_buffer.copy_to_lds(src, (row, col), tile, (0, 0), width=4)
    kiln.amd_asm.s_waitcnt(vmcnt=0, waits_for=[token])   # s_waitcnt vmcnt(0)
    kiln.amd_asm.s_barrier()                             # s_barrier
    kiln.amd_asm.s_setprio(1)                            # s_setprio 1 while MFMAs issue

Async tracking contract (read by the ``kiln-insert-waits``/``kiln-verify-waits`` passes and the
interpreter): an op whose effect completes later carries the discardable attributes
``kiln.async = "vmcnt" | "lgkmcnt"`` (the counter that tracks it) and ``kiln.token = <i64 id>``
(unique within the kernel, in program order); a wait that the DSL knows to cover some tokens
carries ``kiln.waits_for = [ids]``. :class:`AsyncToken` is the Python side of such an op.

Per-lane semantics, for the interpreter: ``rocdl.s.waitcnt`` blocks until the wave has at most
``vmcnt`` outstanding vector-memory ops (global/buffer loads, global->LDS DMA), ``lgkmcnt`` LDS/
scalar-memory ops and ``expcnt`` exports (counters decrement in issue order for vmcnt, out of
order for lgkmcnt when scalar loads are mixed in); ``rocdl.s.barrier`` is a workgroup barrier
without a memory fence; ``s.setprio``, ``sched.barrier``, ``sched.group.barrier`` and
``iglp.opt`` only steer issue priority or LLVM's scheduler and have no effect on results.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mlir import ir
from mlir.dialects import rocdl

from ..core.ops import LGKMCNT, Effects, declare
from ..core.errors import KilnTypeError, KilnValueError
from ..nvidia.sync import current_target
from .. import builder

ASYNC_ATTR = "kiln.async"
TOKEN_ATTR = "kiln.token"
WAITS_FOR_ATTR = "kiln.waits_for"
COUNTERS = ("vmcnt", "lgkmcnt", "expcnt")

# GFX9 (gfx942, gfx950) s_waitcnt SIMM16 fields: (name, max value, [(value bit, width, imm bit)]).
# vmcnt is 6 bits split into imm[3:0] and imm[15:14]; expcnt imm[6:4]; lgkmcnt imm[11:8].
GFX9_WAITCNT_FIELDS = (
    ("vmcnt", 63, ((0, 4, 0), (4, 2, 14))),
    ("expcnt", 7, ((0, 3, 4),)),
    ("lgkmcnt", 15, ((0, 4, 8),)),
)


class SchedMask(enum.IntFlag):
    """Instruction classes for ``sched_barrier``/``sched_group_barrier`` masks (LLVM's
    ``llvm.amdgcn.sched.group.barrier`` encoding)."""
    NONE = 0x0
    ALU = 0x1
    VALU = 0x2
    SALU = 0x4
    MFMA = 0x8
    VMEM = 0x10
    VMEM_READ = 0x20
    VMEM_WRITE = 0x40
    DS = 0x80
    DS_READ = 0x100
    DS_WRITE = 0x200
    TRANS = 0x400


def require_amd(what: str):
    """The current target if it is a GFX9 AMD chip, else TargetError."""
    return current_target().require("gfx9", what)


# ------------------------------------------------------------------------------- async tokens


@dataclass(frozen=True)
class AsyncToken:
    """An asynchronous operation in flight: ``op`` completes when ``counter`` drains past it.

    Pass tokens to :func:`s_waitcnt` (``waits_for=``) so passes and the interpreter know which
    copies a wait covers. Example: ``t = kiln.amd_buffer.copy_to_lds(...); t.counter == "vmcnt"``.
    """
    op: ir.Operation
    counter: str
    id: int


class _TokenIds:
    """Per-kernel token numbering: restarts at 0 for each trace so the IR is deterministic."""
    def __init__(self):
        self.trace = None
        self.next = 0

    def take(self) -> int:

        state = builder.current() if builder.is_tracing() else None
        if state is not self.trace:
            self.trace, self.next = state, 0
        self.next += 1
        return self.next - 1


_token_ids = _TokenIds()


def mark_async(op, counter: str) -> AsyncToken:
    """Tag ``op`` (an ``ir.Operation`` or OpView) as asynchronous on ``counter``; returns its
    :class:`AsyncToken`. Example: ``mark_async(op, "lgkmcnt")``."""
    if counter not in COUNTERS:
        raise KilnValueError(f"unknown wait counter {counter!r}", fix=f"use one of {COUNTERS}")
    operation = getattr(op, "operation", op)
    token_id = _token_ids.take()
    operation.attributes[ASYNC_ATTR] = ir.StringAttr.get(counter)
    operation.attributes[TOKEN_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                          token_id)
    return AsyncToken(operation, counter, token_id)


# ------------------------------------------------------------------------------- waits


def encode_waitcnt(vmcnt: int | None = None, lgkmcnt: int | None = None,
                   expcnt: int | None = None) -> int:
    """The GFX9 ``s_waitcnt`` immediate; a counter left as None is not waited on (its maximum).

    Bit layout: ``vmcnt`` in bits 3:0 (low) and 15:14 (high), ``expcnt`` in 6:4, ``lgkmcnt`` in
    11:8 (AMD "Vega"/CDNA3/CDNA4 ISA, S_WAITCNT). Example::

        >>> encode_waitcnt(vmcnt=0), hex(encode_waitcnt(lgkmcnt=0))
        (3952, '0xc07f')
    """
    counts = {"vmcnt": vmcnt, "expcnt": expcnt, "lgkmcnt": lgkmcnt}
    imm = 0
    for name, limit, pieces in GFX9_WAITCNT_FIELDS:
        value = counts[name]
        value = limit if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
            raise KilnValueError(f"s_waitcnt {name}={counts[name]!r} is out of range",
                                 fix=f"use an int in 0..{limit} (or leave it out to not wait)")
        for value_bit, width, imm_bit in pieces:
            imm |= ((value >> value_bit) & ((1 << width) - 1)) << imm_bit
    return imm


def decode_waitcnt(imm: int) -> dict[str, int]:
    """Inverse of :func:`encode_waitcnt`: every counter's N (its maximum when not waited on)."""
    out = {}
    for name, _, pieces in GFX9_WAITCNT_FIELDS:
        out[name] = sum(((imm >> imm_bit) & ((1 << width) - 1)) << value_bit
                        for value_bit, width, imm_bit in pieces)
    return out


def _waitcnt_limits(op) -> dict[str, int]:
    decoded = decode_waitcnt(ir.IntegerAttr(op.attributes["bitfield"]).value)
    return {name: decoded[name] for name, limit, _ in GFX9_WAITCNT_FIELDS if decoded[name] < limit}


WAITCNT = declare("amd.sched.s_waitcnt", feature="gfx9", mlir_names=("rocdl.s.waitcnt",),
                  effects=Effects(waits=_waitcnt_limits))
S_BARRIER = declare("amd.sched.s_barrier", feature="gfx9", mlir_names=("rocdl.s.barrier",),
                    effects=Effects(barrier=True))
# amdgpu.lds_barrier lowers to s_waitcnt lgkmcnt(0) + s_barrier.
LDS_BARRIER = declare("amd.sched.lds_barrier", feature="gfx9", mlir_names=("amdgpu.lds_barrier",),
                      effects=Effects(barrier=True, waits=lambda op: {LGKMCNT: 0}))
SETPRIO = declare("amd.sched.s_setprio", feature="gfx9", mlir_names=("rocdl.s.setprio",))
SCHED_BARRIER = declare("amd.sched.sched_barrier", feature="gfx9",
                        mlir_names=("rocdl.sched.barrier", "rocdl.sched.group.barrier",
                                    "rocdl.iglp.opt"))


def s_waitcnt(vmcnt: int | None = None, lgkmcnt: int | None = None, expcnt: int | None = None,
              *, waits_for=()) -> ir.Operation:
    """``s_waitcnt``: wait until at most ``vmcnt``/``lgkmcnt``/``expcnt`` operations are
    outstanding (``rocdl.s.waitcnt``). ``waits_for`` lists the :class:`AsyncToken` s this wait
    is meant to cover (recorded as ``kiln.waits_for``).

    Example: ``kiln.amd_asm.s_waitcnt(vmcnt=0, lgkmcnt=0)``.
    """
    WAITCNT.require(current_target(), "s_waitcnt")
    op = rocdl.s_waitcnt(encode_waitcnt(vmcnt, lgkmcnt, expcnt))
    tokens = list(waits_for)
    for token in tokens:
        if not isinstance(token, AsyncToken):
            raise KilnTypeError(f"waits_for must hold AsyncTokens, got {type(token).__name__}",
                                fix="pass the tokens returned by kiln.amd_buffer copies")
    if tokens:
        i64 = ir.IntegerType.get_signless(64)
        op.operation.attributes[WAITS_FOR_ATTR] = ir.ArrayAttr.get(
            [ir.IntegerAttr.get(i64, t.id) for t in tokens])
    return op.operation


def s_barrier() -> None:
    """``s_barrier``: every wave of the workgroup waits here (no memory fence; pair it with
    :func:`s_waitcnt` when LDS writes must be visible). Example: ``kiln.amd_asm.s_barrier()``."""
    S_BARRIER.require(current_target(), "s_barrier")
    rocdl.s_barrier()


def s_setprio(priority: int) -> None:
    """``s_setprio priority`` (0..3): raise this wave's issue priority, e.g. around an MFMA
    burst so it is not starved by waves issuing memory ops. Example: ``s_setprio(1)``."""
    SETPRIO.require(current_target(), "s_setprio")
    _check_range("s_setprio priority", priority, 0, 3)
    rocdl.s_setprio(priority)


def sched_barrier(mask: int = SchedMask.NONE) -> None:
    """``llvm.amdgcn.sched.barrier``: LLVM's scheduler may move only the instruction classes
    in ``mask`` across this point (``SchedMask.NONE``: nothing crosses)."""
    SCHED_BARRIER.require(current_target(), "sched_barrier")
    _check_range("sched_barrier mask", int(mask), 0, 0x7FF)
    rocdl.sched_barrier(int(mask))


def sched_group_barrier(mask: int, size: int, sync_id: int = 0) -> None:
    """``llvm.amdgcn.sched.group.barrier``: ask the scheduler for a group of ``size``
    instructions of class ``mask`` here; consecutive calls with one ``sync_id`` form a pipeline.

    Example (interleave 1 MFMA with 2 LDS reads)::

        sched_group_barrier(SchedMask.MFMA, 1); sched_group_barrier(SchedMask.DS_READ, 2)
    """
    SCHED_BARRIER.require(current_target(), "sched_group_barrier")
    _check_range("sched_group_barrier mask", int(mask), 0, 0x7FF)
    _check_range("sched_group_barrier size", size, 0, 2**31 - 1)
    _check_range("sched_group_barrier sync_id", sync_id, 0, 2**31 - 1)
    rocdl.sched_group_barrier(int(mask), size, sync_id)


def iglp_opt(variant: int) -> None:
    """``llvm.amdgcn.iglp.opt variant``: one of LLVM's canned MFMA/DS interleavings (0..3)."""
    SCHED_BARRIER.require(current_target(), "iglp_opt")
    _check_range("iglp_opt variant", variant, 0, 3)
    rocdl.iglp_opt(variant)


def _check_range(what: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise KilnValueError(f"{what} must be a Python int in {low}..{high}, got {value!r}",
                             fix="pass a compile-time constant (a kiln.constexpr or literal)")
