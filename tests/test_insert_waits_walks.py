"""How many walks ``kiln-insert-waits`` takes on a TMA pipeline, and that what it places is
proven: the attention tutorial (examples/tutorials/attention.py) refills K and V by TMA each
step, each load waiting on its tile's empty mbarrier. Those waits are placed in the walk that
finds them (each as if the ones before it were built), not one per walk: at 4 stages there
are 16 in the loops, past the pass's bound on walks when it placed one a walk."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mlir import ir

import kiln.passes.insert_waits
from kiln.core.errors import WaitError
from kiln.lowering.pipeline import GPU_STAGE_PASSES
from kiln.passes import build_pass_manager

from ir_ops import ops_where
from source_modules import EXAMPLES, load_module

attention = load_module(EXAMPLES / "tutorials" / "attention.py", "kiln_tutorial_attention")
TRY_WAIT = "nvgpu.mbarrier.try_wait.parity"


def _tutorial_ir(d: int, stages: int, causal: bool) -> str:
    """The tutorial's Kiln IR for sm_90a with K and V in ``stages`` stages (no waits yet)."""
    x = np.zeros((256, 2 * d), ml_dtypes.bfloat16)
    cfg = dict(attention.config(d, "sm_90a"), STAGES=stages)
    return attention.attention_kernel.trace(x, x, x, x, np.array([0, 256], np.int32), 1.0,
                                            CAUSAL=causal, ALIGN=16, **cfg,
                                            target="sm_90a").module_asm


@pytest.fixture(scope="module")
def four_stages():
    """The 4-stage causal D 64 tutorial after the gpu stage's passes (text), and the waits
    each kiln-insert-waits walk placed."""
    walks = []

    class CountingAnalysis(kiln.passes.insert_waits.WaitAnalysis):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            walks.append(self.placed)

    text = _tutorial_ir(64, 4, True)
    with pytest.MonkeyPatch.context() as patch, ir.Context():
        patch.setattr(kiln.passes.insert_waits, "WaitAnalysis", CountingAnalysis)
        module = ir.Module.parse(text)
        build_pass_manager(list(GPU_STAGE_PASSES)).run(module.operation)
        return str(module), walks


def _loop_waits(module) -> list:
    """The mbarrier try_waits inside loops, in program order."""
    return ops_where(module, lambda op: op.name == TRY_WAIT
                     and kiln.passes.insert_waits.enclosing_loops(op.operation))


@pytest.mark.lower
def test_the_4_stage_tutorial_converges_in_two_walks_and_is_proven(four_stages):
    """One placing walk and one confirming walk; the full proof (every read covered, every
    ring phase right) accepts the result; each loop step waits for K_j and V_j-1 to land and
    for the stages of K_j-1 and V_j-2 to be released (2 loops of 4 steps)."""
    text, walks = four_stages
    assert len(walks) == 2 and walks[0] > 0 and walks[1] == 0
    with ir.Context():
        module = ir.Module.parse(text)
        build_pass_manager(["kiln-verify-waits"]).run(module.operation)
        assert len(_loop_waits(module)) == 2 * 4 * 4


@pytest.mark.lower
def test_a_deleted_empty_wait_of_the_4_stage_tutorial_is_rejected_and_restored(four_stages):
    """Deleting the last placed empty-ring wait (the refill of a stage before its readers
    released it) is a WaitError naming the TMA load; kiln-insert-waits puts it back."""
    text, _ = four_stages
    with ir.Context():
        module = ir.Module.parse(text)
        _loop_waits(module)[-1].erase()
        with pytest.raises(WaitError, match="may overwrite the buffer"):
            build_pass_manager(["kiln-verify-waits"]).run(module.operation)
        build_pass_manager(["kiln-insert-waits", "kiln-verify-waits", "canonicalize",
                            "cse"]).run(module.operation)
        restored = ir.Module.parse(text)
        build_pass_manager(["canonicalize", "cse"]).run(restored.operation)
        assert str(module) == str(restored)
