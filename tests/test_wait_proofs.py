"""Every wait of every shipped kernel is needed, and the proofs know why: deleting it from the
kernel's Kiln IR makes ``kiln-verify-waits`` reject the program naming the async op it covered,
and ``kiln-insert-waits`` on the stripped program gives back a program the verifier accepts.

One kind of wait is exempt from the rejection, recognised by its shape, so that any other
wait the verifier lets go fails here: drains (gfx950), an ``s_waitcnt lgkmcnt(0)`` that covers
only plain LDS reads, which the analysis does not count because LLVM places their waits
itself; the kernel compiled without it must still pass the proof on its final assembly
(``isa_amdgpu.verify_waits``). Producers' waits on the empty mbarrier are all proven
(passes/mbarrier_protocol.py): warp-specialised ones (prefill, GEMM) and the decode kernels',
whose producer and consumers share one path and whose first loads sit in the main loop under
``it == 0``; so is the ``wgmma.wait_group`` before a release arrive (the arrive declares
``wgmma_pending=N``: the analysis counts the WGMMA groups in flight).

``kiln-insert-waits`` restores every deleted wait, mbarrier waits whose phase the program
computes included (pipelined rings, passes/mbarrier_rings.py): consumers' full waits,
producers' empty waits (the decode kernels' look-ahead ones too, counted by
passes/ring_guards.py) and constant-slot waits (Q tiles, prologues). The gfx950 drains stay
exempt: the plain LDS reads they cover are ``memref``/``vector`` loads that LLVM may merge,
split or scalarise into any number of ``ds_read`` instructions, so no declaration can give
their lgkmcnt count in the Kiln IR. Counting them as events of unknown size would leave only
``lgkmcnt(0)`` to retire them, before every consumer of their registers, where LLVM now places
its own finer ``lgkmcnt(N)``: the assembly would change. The drain is a schedule choice (the
MFMA cluster starts with the LDS reads done); without it LLVM's own waits keep the program
correct, which the final-assembly proof (``isa_amdgpu.verify_waits``) checks.

Mutating a shipped kernel's wait parity or slot (flipped, off by one stage) is rejected too.
"""

from __future__ import annotations

import math
import re

import pytest
from mlir import ir

import kiln  # noqa: F401 - declares the ops
from kiln.core.ops import effects_of
from kiln.core.errors import WaitError
from kiln.kernels.attention.decode import compile_decode
from kiln.kernels.attention.decode_config import DecodeConfig
from kiln.kernels.attention.prefill import compile_prefill
from kiln.kernels.gemm import compile_matmul
from kiln.lowering import isa_amdgpu
from kiln.lowering.compiler import compile_kernel
from kiln.core.options import CompileOptions
from kiln.passes import build_pass_manager
from kiln.passes.insert_waits import gpu_funcs
from kiln.passes.op_queries import is_mbarrier_wait, op_label, wait_limits

KERNELS = {
    "prefill_sm90": lambda: compile_prefill("bf16", target="sm_90a", head_dim=128, causal=True),
    "decode_mma_sync": lambda: compile_decode("bf16", target="sm_90a", head_dim=128, group=8,
                                              config=DecodeConfig(consumer="mma_sync")),
    "decode_wgmma": lambda: compile_decode("bf16", target="sm_90a", head_dim=128, group=8,
                                           config=DecodeConfig(consumer="wgmma", num_warps=4)),
    "gemm_sm90": lambda: compile_matmul("bf16", target="sm_90a"),
    "prefill_gfx950": lambda: compile_prefill("bf16", target="gfx950", head_dim=128,
                                              causal=True),
    "gemm_gfx950": lambda: compile_matmul("bf16", target="gfx950"),
}
_GEMM_TEXT: dict = {}  # the Hopper GEMM's Kiln IR, compiled once for the mutation cases
_NAMED = re.compile(r"before the (?:async )?(\S+) at|the result of the (\S+) at|"
                    r"this (\S+) may overwrite")


def _walk(module) -> list:
    ops = []
    module.operation.walk(lambda op: ops.append(op.operation) or ir.WalkResult.ADVANCE)
    return ops


def _is_wait(op) -> bool:
    return bool(wait_limits(op)) or is_mbarrier_wait(op)


def _stripped(text: str, index: int):
    """The module with its ``index``-th wait deleted (and kiln.manual_waits dropped, so the
    insertion pass works on it); returns (module, description of the wait)."""
    module = ir.Module.parse(text)
    wait = [op for op in _walk(module) if _is_wait(op)][index]
    described = (op_label(wait), str(wait.location))
    for func in gpu_funcs(module.operation):
        if "kiln.manual_waits" in func.attributes:
            del func.attributes["kiln.manual_waits"]
    wait.erase()
    return module, described


def _verify(module) -> WaitError | None:
    try:
        build_pass_manager(["kiln-verify-waits"]).run(module.operation)
    except WaitError as err:
        return err
    return None


def _async_labels(module) -> set[str]:
    return {op_label(op) for op in _walk(module) if effects_of(op).counter is not None}


def _exempt(ck, index: int) -> str | None:
    """Why the ``index``-th wait may be deleted unnoticed (module docstring), else None."""
    module = ir.Module.parse(ck.asm["kiln"])
    ops = _walk(module)
    wait = [op for op in ops if _is_wait(op)][index]
    if ck.target.is_amd and set(wait_limits(wait)) == {"lgkmcnt"}:
        wait.erase()  # the rest of the program, its hand-placed waits included, as it is
        warps = math.prod(ck.signature.block) // ck.target.warp_size
        lowered = compile_kernel(str(module), ck.signature,
                                 CompileOptions(ck.target.name, num_warps=warps))
        isa_amdgpu.verify_waits(isa_amdgpu.parse(lowered.asm["amdgcn"], ck.name), ck.name)
        return "drain of plain LDS reads: the final assembly is still proven"
    return None


def _check_kernel(name: str, only=None) -> tuple[list[str], list[str]]:
    """Delete each wait of kernel ``name`` in turn (``only``: a predicate on the wait's label);
    returns the problems found and the async ops the rejections named."""
    ck = KERNELS[name]()
    text = ck.asm["kiln"]
    problems, named = [], []
    with ir.Context():
        parsed = ir.Module.parse(text)  # held: its ops die with it
        count = len([op for op in _walk(parsed) if _is_wait(op)])
    for index in range(count):
        with ir.Context():
            module, (label, loc) = _stripped(text, index)
            if only is not None and not only(label):
                continue
            err = _verify(module)
            if err is None:
                if _exempt(ck, index) is None:
                    problems.append(f"{name}: deleting the {label} at {loc} is not rejected")
                continue
            match = _NAMED.search(str(err))
            event = match and next(g for g in match.groups() if g)
            named.append(event)
            if event not in _async_labels(module):
                problems.append(f"{name}: deleting the {label} at {loc}: the error names no "
                                f"async op: {err}")
            try:
                build_pass_manager(["kiln-insert-waits"]).run(module.operation)
            except WaitError as refused:
                problems.append(f"{name}: kiln-insert-waits refused the {label} at {loc}: "
                                f"{refused}")
                continue
            if _verify(module) is not None:
                problems.append(f"{name}: kiln-insert-waits left a gap after deleting the "
                                f"{label} at {loc}")
    return problems, named


# 4-5 s: in the slow tier (CI runs it); test_passes_kernels proves the same kernel's waits.
@pytest.mark.slow
@pytest.mark.lower
def test_prefill_wgmma_waits_are_required():
    """The issue's example: each WGMMA wait of the causal D128 Hopper prefill is needed and
    restored, the two after its register-A P.V WGMMAs (inline PTX) included."""
    problems, named = _check_kernel("prefill_sm90", only=lambda label: "wgmma" in label)
    assert problems == []
    assert named.count("nvidia.wgmma.mma_async.rs") >= 2


@pytest.mark.slow
@pytest.mark.lower
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_wait_is_required(name):
    assert _check_kernel(name)[0] == []


def _gemm_ring_wait(module, which: str):
    """The GEMM producer's empty wait (``empty.try_wait(use % 4, (use // 4) % 2 ^ 1)``) or its
    consumer's full wait (``full.try_wait(use % 4, (use // 4) % 2)``), both in K loops."""
    waits = [op for op in _walk(module) if is_mbarrier_wait(op)]
    return waits[0] if which == "empty" else waits[-1]


@pytest.mark.lower
@pytest.mark.parametrize("which", ["full", "empty"])
@pytest.mark.parametrize("mutation", ["flip_parity", "next_slot", "next_use"])
def test_wrong_ring_phase_is_rejected(mutation, which):
    """A wait on the wrong slot or parity of a ring is rejected naming the wait: a flipped
    parity, a slot one stage ahead, and slot and parity both one use ahead (the count, or
    for the empty wait the arm after it)."""
    from mlir.dialects import arith
    text = _GEMM_TEXT.get("text") or _GEMM_TEXT.setdefault("text",
                                                           KERNELS["gemm_sm90"]().asm["kiln"])
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        assert _verify(module) is None
        wait = _gemm_ring_wait(module, which)
        with ir.InsertionPoint(wait):
            i1, index = ir.IntegerType.get_signless(1), ir.IndexType.get()
            if mutation == "flip_parity":
                wait.operands[1] = arith.xori(wait.operands[1], arith.constant(i1, 1))
            elif mutation == "next_slot":
                one = arith.constant(index, 1)
                wait.operands[3] = arith.remui(arith.addi(wait.operands[3], one),
                                               arith.constant(index, 4))
            else:  # use + 1 in both: consistent, but not the use this wait acquires
                use = wait.operands[3].owner.operands[0].owner.operands[0]
                nxt = arith.addi(use, arith.constant(use.type, 1))
                four = arith.constant(use.type, 4)
                wait.operands[3] = arith.index_cast(index, arith.remsi(nxt, four))
                wraps = arith.remsi(arith.divsi(nxt, four), arith.constant(use.type, 2))
                if which == "empty":
                    wraps = arith.xori(wraps, arith.constant(use.type, 1))
                wait.operands[1] = arith.trunci(i1, wraps)
        err = _verify(module)
    assert err is not None and "try_wait" in str(err) and "wrong phase" in str(err), err


@pytest.mark.lower
def test_decode_ring_waits_are_required_and_restored():
    """The decode kernel's two mbarrier waits: the consumer's full wait (use ``it``) and the
    look-ahead producer's empty wait, whose arm's use ``it + S - 1 - lag`` is counted under its
    conditions (passes/ring_guards.py); each is rejected when deleted and restored."""
    problems, named = _check_kernel("decode_mma_sync", only=lambda label: "mbarrier" in label)
    assert problems == []
    assert named == ["nvgpu.tma.async.load"] * 2
