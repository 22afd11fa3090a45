"""WGMMA (sm_90a warp-group MMA): the op declarations and the inline-PTX emission helpers.

The user-facing API (accumulators, fragments, descriptors, ``mma_async``) is :mod:`kiln.wgmma`;
this module declares the ops it emits and builds the one upstream NVVM cannot express, WGMMA
with A from registers (``wgmma.mma_async ... {a regs}, b_desc``). Every one of them adds to or
drains the WGMMA commit groups, which ``kiln-insert-waits`` / ``kiln-verify-waits`` track:

================================  ========================================  ==================
op                                emitted as                                effect
================================  ========================================  ==================
``nvidia.wgmma.mma_async``        ``nvvm.wgmma.mma_async``                  WGMMA event
``nvidia.wgmma.mma_async.rs``     inline PTX, ``kiln.op`` + ``kiln.op_args``  WGMMA event
``nvidia.wgmma.commit_group``     ``nvvm.wgmma.commit.group.sync.aligned``  commits WGMMA
``nvidia.wgmma.wait_group``       ``nvvm.wgmma.wait.group.sync.aligned``    waits WGMMA(N)
``nvidia.wgmma.fence``            ``nvvm.wgmma.fence.aligned``              --
``nvidia.wgmma.keep_registers_live``  empty inline asm                      --
``nvidia.wgmma.fresh_descriptor``  inline ``mov.b64``                        --
================================  ========================================  ==================
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm

from ..core.ops import WGMMA, Effects, declare, int_attr

_EVENT = Effects(counter=WGMMA, indirect_shared=True, accumulates=True)

MMA_ASYNC = declare("nvidia.wgmma.mma_async", feature="wgmma", effects=_EVENT,
                    mlir_names=("nvvm.wgmma.mma_async",),
                    doc="D = A @ B (+ D), A and B read through shared-memory descriptors "
                        "(f16/bf16 m64nNk16; e4m3/e5m2 m64nNk32, both K-major)")
MMA_ASYNC_RS = declare("nvidia.wgmma.mma_async.rs", feature="wgmma", effects=_EVENT,
                       doc="D = A @ B (+ D), A from four b32 registers per thread")
COMMIT_GROUP = declare("nvidia.wgmma.commit_group", feature="wgmma",
                       effects=Effects(commits=WGMMA),
                       mlir_names=("nvvm.wgmma.commit.group.sync.aligned",))
WAIT_GROUP = declare("nvidia.wgmma.wait_group", feature="wgmma",
                     effects=Effects(waits=lambda op: {WGMMA: int_attr("group")(op)}),
                     mlir_names=("nvvm.wgmma.wait.group.sync.aligned",))
FENCE = declare("nvidia.wgmma.fence", feature="wgmma", mlir_names=("nvvm.wgmma.fence.aligned",))
KEEP_REGISTERS_LIVE = declare("nvidia.wgmma.keep_registers_live", feature="ptx",
                              interpret=lambda op, plan: None,  # no instruction: nothing to run
                              doc="holds registers live for an in-flight WGMMA")


def _fresh_semantics(op, plan):
    """Interpreter semantics of :data:`FRESH_DESCRIPTOR`: the operand, unchanged."""
    (x,) = plan.operands(op)
    out = plan.result(op)

    def run(env, ctx):
        env[out] = env[x]

    return run


FRESH_DESCRIPTOR = declare("nvidia.wgmma.fresh_descriptor", feature="wgmma",
                           interpret=_fresh_semantics,
                           doc="a copy of a matrix descriptor that LLVM cannot hoist out of a "
                               "loop")


FP8_PTX_TYPES = ("e4m3", "e5m2")  # m64nNk32, no transpose immediate


def wgmma_rs_asm(n: int, ptx_type: str, trans_b: int) -> str:
    """The inline PTX of :func:`wgmma_mma_async_regs` for ``m64n{n}k16`` (``m64n{n}k32`` for
    e4m3/e5m2; operands ``$0..``: ``n/2`` accumulator outputs, the same ``n/2`` tied inputs,
    four A registers, the B descriptor, the scale-d flag)."""
    half = n // 2
    d = ", ".join(f"${i}" for i in range(half))
    a = ", ".join(f"${i}" for i in range(n, n + 4))
    # scale-d must be a predicate; imm-scale-a/b = 1 (no negation), imm-trans-b 0/1 (16-bit
    # types only: FP8 B is K-major by definition).
    k, trans = (32, "") if ptx_type in FP8_PTX_TYPES else (16, f", {trans_b}")
    return ("{\n.reg .pred p;\n"
            f"setp.ne.b32 p, ${n + 5}, 0;\n"
            f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx_type}.{ptx_type} "
            f"{{{d}}}, {{{a}}}, ${n + 4}, p, 1, 1{trans};\n}}")


def wgmma_mma_async_regs(accumulators: list[ir.Value], a_registers: list[ir.Value],
                         b_descriptor: ir.Value, scale_d: ir.Value, *, ptx_type: str,
                         trans_b: int) -> ir.Value:
    """``wgmma.mma_async.sync.aligned.m64nNk16.f32.T.T`` (``k32`` for FP8) with A from four b32
    registers
    (PTX ISA "wgmma.mma_async", register A form); returns the ``!llvm.struct`` of the
    ``len(accumulators)`` updated f32 registers. ``scale_d`` (i32) = 0 ignores the old D.

    Low-level: :func:`kiln.wgmma.mma_async_regs` validates operands and is the one to call.
    """
    half = len(accumulators)
    f32 = ir.F32Type.get()
    # LLVM IR has no "+f": outputs "=f", then inputs tied to them by index ("0", "1", ...),
    # which is what clang makes of CUDA's "+f" read-write operands.
    constraints = ",".join(["=f"] * half + [str(i) for i in range(half)]
                           + ["r"] * 4 + ["l", "r"])
    return MMA_ASYNC_RS.inline_asm(llvm.StructType.get_literal([f32] * half),
                                   [*accumulators, *a_registers, b_descriptor, scale_d],
                                   wgmma_rs_asm(2 * half, ptx_type, trans_b), constraints,
                                   args={"n": 2 * half, "dtype": ptx_type, "trans_b": trans_b})


# ``keep_registers_live``: no instruction at all; only the operand list matters (to LLVM).
KEEP_REGISTERS_LIVE_ASM = ""


def keep_registers_live(registers: list[ir.Value]) -> None:
    """An empty inline asm that reads ``registers`` (b32): LLVM keeps them live up to here, so
    it cannot give their PTX registers to new values before this point (an in-flight WGMMA
    may still be reading them). Emits no instruction. It is not ``.aligned`` PTX, so LLVM may
    copy it into both arms of a lane-divergent branch, which an inline ``wgmma.wait_group``
    must never be (a warp reaching an aligned instruction at two addresses hangs).

    Low-level: :func:`kiln.wgmma.wait_group` with ``reads=`` is the one to call.
    """
    KEEP_REGISTERS_LIVE.inline_asm(ir.Type.parse("!llvm.void"), registers,
                                   KEEP_REGISTERS_LIVE_ASM, ",".join(["r"] * len(registers)))


def fresh_descriptor(descriptor: ir.Value) -> ir.Value:
    """``descriptor`` (i64) through a ``mov.b64`` LLVM may neither hoist nor merge: a loop body
    derives its WGMMAs' descriptors from this one by adding constants, instead of LLVM holding
    one hoisted register pair per descriptor across the loop (40 pairs in a 128 x 128
    attention step, which then spills).

    Low-level: :func:`kiln.tile_gemm_wgmma.gemm` calls it once per operand tile and call."""
    i64 = ir.IntegerType.get_signless(64)
    return FRESH_DESCRIPTOR.inline_asm(i64, [descriptor], "mov.b64 $0, $1;", "=l,l")
