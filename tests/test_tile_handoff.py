"""``kiln.release`` and ``kiln.Turns`` (kiln.tile_handoff): a ring of shared tiles refilled
without a block barrier a step. A ragged GEMM whose stages are handed back by ``kiln.release``
(right after the WGMMA that reads them is issued: the wait analysis must retire it first) runs
in the interpreter on every target against float64; on sm_90a its empty-mbarrier waits and
WGMMA waits are each required by kiln-verify-waits; elsewhere the release is a block barrier."""

from __future__ import annotations

import contextlib
import re

import ml_dtypes
import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import bf16, f32
from kiln.core.errors import WaitError
from kiln.passes import build_pass_manager
from kiln.passes.op_queries import op_label

from ir_ops import ops_where


@kiln.kernel(num_threads="THREADS")
def ring_gemm(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2],
              BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
              STAGES: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr,
              TURNS: kiln.constexpr):
    (m, k), (kb, n) = a.shape, b.shape
    row0, col0 = kiln.block_id(0) * BM, kiln.block_id(1) * BN
    a_s = [kiln.tiles.operand_tile((BM, BK), bf16, "a") for _ in range(STAGES)]
    b_s = [kiln.tiles.operand_tile((BK, BN), bf16, "b") for _ in range(STAGES)]

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=m, col_end=k, align=ALIGN),
                  a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=kb, col_end=n, align=ALIGN),
                  b_s[s])

    for s in range(STAGES - 1):
        fetch(s * BK, s)
    kiln.barrier()
    acc = kiln.accumulator(a_s[0], b_s[0])
    turns = kiln.Turns() if TURNS else contextlib.nullcontext()
    for g in kiln.range(0, kiln.max((k + STAGES * BK - 1) // (STAGES * BK), 1)):
        for st in range(STAGES):
            with turns:
                acc = kiln.gemm(a_s[st], b_s[st], acc)
            kiln.release(a_s[st], b_s[st])   # the group just issued reads them: retired first
            fetch((g * STAGES + st + STAGES - 1) * BK, st - 1)
    if TURNS:
        turns.close()
    mc, nc = c.shape
    kiln.copy(acc, kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=mc, col_end=nc))


CONFIG = dict(BM=128, BN=64, BK=64, STAGES=3, THREADS=256)


def _run(target, align, turns, m=130, n=72, k=328):
    rng = np.random.default_rng()
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    grid = (-(-m // CONFIG["BM"]), -(-n // CONFIG["BN"]))
    ring_gemm.interpret[grid](a, b, c, **CONFIG, ALIGN=align, TURNS=turns, target=target)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("target,align,turns", [("sm_90a", 16, True), ("sm_90a", 16, False),
                                                ("sm_90a", 2, True), ("sm_80", 16, True),
                                                ("gfx950", 16, True)])
def test_ring_handed_back_by_release_in_the_interpreter(target, align, turns):
    """sm_90a, align 16: K tiles by TMA, handed back on their empty mbarriers (a TMA refill
    overwriting a tile a WGMMA in flight reads is a RaceError here); align 2 and the other
    targets: cp.async / DMA copies, each release a block barrier. Ragged M, N and K."""
    _run(target, align, turns)


def _compile(target="sm_90a", align=16, turns=True, **cfg):
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    params = dict(CONFIG, ALIGN=align, TURNS=turns)
    params.update(cfg)
    return ring_gemm.compile(a, a, np.zeros((256, 256), np.float32), **params, target=target)


@pytest.mark.lower
def test_release_compiles_to_mbarrier_arrives_and_turns_to_named_barriers():
    """TMA tiles: no block barrier in the loop; each release retires the group just issued
    (wgmma.wait_group 0 before its arrives); two warpgroups take turns (a bar.sync per step
    and at close, a bar.arrive per step and the first hand-over)."""
    ck = _compile()
    ptx = ck.asm["ptx"]
    steps = CONFIG["STAGES"]
    assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 2   # mbarrier init, the prologue
    assert ptx.count("bar.sync") == 2 + steps + 1 and ptx.count("bar.arrive") == steps + 1
    release = r"wgmma\.wait_group\.sync\.aligned \t0;\n\s*mbarrier\.arrive\.shared\.b64"
    assert len(re.findall(release, ptx)) == steps
    one = _compile(THREADS=128, BM=64).asm["ptx"]   # one warpgroup: no turns to take
    assert "bar.arrive" not in one and ptx.count("mbarrier.arrive.shared.b64") == 2 * steps


@pytest.mark.lower
def test_release_of_tiles_not_tma_loaded_is_a_block_barrier():
    ptx = _compile(align=2).asm["ptx"]
    assert "mbarrier.arrive.shared" not in ptx
    assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 1 + CONFIG["STAGES"]


def _waits(module):
    return ops_where(module, lambda op: op.name in ("nvgpu.mbarrier.try_wait.parity",
                                                    "nvvm.wgmma.wait.group.sync.aligned"))


@pytest.mark.lower
def test_deleting_a_placed_wait_fails_verify_waits():
    """The full waits before each step's WGMMA, the wgmma.wait_group before each release and
    the empty waits before each refill are all required by kiln-verify-waits."""
    text = _compile().asm["gpu"]
    with ir.Context():
        parsed = ir.Module.parse(text)  # held: its ops die with it
        labels = [op_label(w) for w in _waits(parsed)]
    steps = CONFIG["STAGES"]
    assert sum("try_wait" in label for label in labels) == 2 * steps + 2 * steps
    assert sum("wait.group" in label for label in labels) == steps
    for index in range(len(labels)):
        with ir.Context():
            module = ir.Module.parse(text)
            _waits(module)[index].erase()
            with pytest.raises(WaitError, match="tma|mbarrier|wgmma"):
                build_pass_manager(["kiln-verify-waits"]).run(module.operation)


@kiln.kernel(num_threads=128)
def mixed_fill(x: kiln.Tensor[bf16, 2]):
    t = kiln.tiles.operand_tile((64, 64), bf16, "a")
    kiln.copy(kiln.GlobalTile(x, (64, 64), (0, 0), row_end=x.shape[0], align=16), t)
    kiln.release(t)
    kiln.copy(kiln.GlobalTile(x, (64, 64), (0, 0), row_end=x.shape[0], align=2), t)


@kiln.kernel(num_threads=256)
def turns_misuse(x: kiln.Tensor[f32]):
    turns = kiln.Turns()
    turns.close()
    with turns:
        x[0] = 1.0


def test_release_and_turns_refuse_misuse():
    x = np.zeros((64, 64), ml_dtypes.bfloat16)
    with pytest.raises(kiln.KilnValueError, match="both TMA and other copies"):
        mixed_fill.compile(x, target="sm_90a")
    with pytest.raises(kiln.KilnValueError, match="after close"):
        turns_misuse.compile(np.zeros(4, np.float32), target="sm_90a")
    with pytest.raises(kiln.KilnTypeError, match="shared tiles"):
        kiln.release(x)
