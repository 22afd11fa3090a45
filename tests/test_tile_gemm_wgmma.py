"""kiln.gemm on sm_90a (WGMMA from operand_tile shared tiles) and kiln.pipeline: the derived
accumulator layout, the operand layouts WGMMA's descriptors read, ragged GEMMs with 2, 3 and 4
stages in the interpreter on every target (float64 references, NaN-poisoned outputs), the
emitted waits, and kiln-verify-waits rejecting the program when one is deleted."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import bf16, f32, i32
from kiln.core.errors import KilnTypeError, KilnValueError, WaitError
from kiln.layout import wgmma_m64_accumulator
from kiln.passes import build_pass_manager
from kiln.passes.op_queries import op_label, wait_limits
from kiln.core.targets import get_target
from kiln.shared_tile import SharedTile
from kiln.operand_tiles import operand_layout
from kiln.tile_gemm_wgmma import accumulator_layout

from ir_ops import ops_where


def test_accumulator_layout_stamps_the_warpgroup_layout_down_the_rows():
    """Thread t holds what wgmma_m64_accumulator gives thread t % 128, 64 * (t // 128) rows
    down (the docstring's example: thread 165, value 5 is (81, 11))."""
    tv = accumulator_layout(128, 256)
    one = wgmma_m64_accumulator(256)
    rows, cols = tv.coords()
    r1, c1 = one.coords()
    assert tv.tile == (128, 256) and tv.num_threads == 256 and tv.num_values == 128
    for t in range(256):
        np.testing.assert_array_equal(rows[t], r1[t % 128] + 64 * (t // 128))
        np.testing.assert_array_equal(cols[t], c1[t % 128])
    assert tv(165, 5) == (81, 11)


def _offsets(shape, operand, target):
    layout, swizzle, is_wgmma = operand_layout(shape, bf16, operand, get_target(target))
    tile = SharedTile.__new__(SharedTile)
    return tile._describe(shape, bf16, layout, swizzle), is_wgmma


def _wgmma_offset(r, c, rows: int):
    """Element offset of (r, c) in 64-column chunks of ``rows`` 128-byte rows, 128B swizzle:
    what the descriptors of dsl/tile_gemm_wgmma.py address."""
    byte = (c // 64) * rows * 128 + r * 128 + (((c % 64) * 2) ^ ((r % 8) * 16))
    return byte // 2


@pytest.mark.parametrize("bm,bn,bk", [(128, 256, 64), (64, 128, 128)])
def test_operand_tiles_are_the_layouts_the_descriptors_address(bm, bn, bk):
    a_off, a_wgmma = _offsets((bm, bk), "a", "sm_90a")
    b_off, b_wgmma = _offsets((bk, bn), "b", "sm_90a")
    assert a_wgmma and b_wgmma
    r, c = np.meshgrid(np.arange(bm), np.arange(bk), indexing="ij")
    np.testing.assert_array_equal(a_off, _wgmma_offset(r, c, bm))
    r, c = np.meshgrid(np.arange(bk), np.arange(bn), indexing="ij")
    np.testing.assert_array_equal(b_off, _wgmma_offset(r, c, bk))


@pytest.mark.parametrize("target,shape", [("sm_80", (64, 64)), ("gfx950", (64, 64)),
                                          ("sm_90a", (64, 320)), ("sm_90a", (64, 32))])
def test_operand_tiles_elsewhere_keep_the_mma_sync_swizzle(target, shape):
    """Not WGMMA (another target, B wider than one instruction, rows under 128 bytes):
    row-major with operand_swizzle, so kiln.gemm takes the mma.sync/MFMA path."""
    offsets, is_wgmma = _offsets(shape, "b", target)
    assert not is_wgmma
    swizzle = kiln.tiles.operand_swizzle(shape, bf16)
    r, c = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    np.testing.assert_array_equal(offsets, swizzle(r * shape[1] + c) if swizzle else
                                  r * shape[1] + c)


@kiln.kernel(num_threads="THREADS")
def pipelined_gemm(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2],
                   m: i32, n: i32, k: i32, BM: kiln.constexpr, BN: kiln.constexpr,
                   BK: kiln.constexpr, STAGES: kiln.constexpr, THREADS: kiln.constexpr,
                   ALIGN: kiln.constexpr, IN_FLIGHT: kiln.constexpr = None,
                   EARLY: kiln.constexpr = False):
    row0 = kiln.block_id(0) * BM
    col0 = kiln.block_id(1) * BN
    a_s = [kiln.tiles.operand_tile((BM, BK), bf16, "a") for _ in range(STAGES)]
    b_s = [kiln.tiles.operand_tile((BK, BN), bf16, "b") for _ in range(STAGES)]

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=m, col_end=k, align=ALIGN),
                  a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=k, col_end=n, align=ALIGN),
                  b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, BK, stages=STAGES, fetch=fetch, mma_in_flight=IN_FLIGHT,
                            barrier_before_fetch=EARLY):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    # a row reduction on the derived layout: the max of the row's columns in the last column
    # tile goes to column n - 1 of C
    cols = kiln.tiles.coords(acc.layout)[1]
    row_max = kiln.reduce(kiln.where(cols < n - col0, acc, -float("inf")), "max", 1)
    out = kiln.where(cols >= n - 1 - col0, 0.0 * acc + row_max, acc)   # past n: masked
    kiln.copy(out, kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=m, col_end=n))


def _reference(a, b, bn):
    want = a.astype(np.float64) @ b.astype(np.float64)
    n = want.shape[1]
    want[:, -1] = want[:, (n - 1) // bn * bn:].max(axis=1)
    return want


def _run(target, shape, cfg, align):
    rng = np.random.default_rng()
    m, n, k = shape
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    c = np.full((m, n), np.nan, np.float32)
    grid = (-(-m // cfg["BM"]), -(-n // cfg["BN"]))
    pipelined_gemm.interpret[grid](a, b, c, m, n, k, **cfg, ALIGN=align, target=target)
    np.testing.assert_allclose(c, _reference(a, b, cfg["BN"]), rtol=1e-4, atol=1e-3)


WGMMA_CONFIGS = [dict(BM=64, BN=64, BK=64, THREADS=128), dict(BM=128, BN=128, BK=64, THREADS=256),
                 dict(BM=64, BN=192, BK=64, THREADS=128), dict(BM=64, BN=64, BK=128, THREADS=128)]


@pytest.mark.parametrize("stages,cfg", [
    (2, WGMMA_CONFIGS[1]), (3, WGMMA_CONFIGS[1]),
    # the slow tier, which CI also runs: 4 stages, and BK 128
    pytest.param(4, WGMMA_CONFIGS[1], marks=pytest.mark.slow),
    (3, WGMMA_CONFIGS[0]), (3, WGMMA_CONFIGS[2]),
    pytest.param(3, WGMMA_CONFIGS[3], marks=pytest.mark.slow)])
def test_wgmma_pipeline_ragged_in_the_interpreter(stages, cfg):
    """Ragged M, N, K (K not a multiple of BK, nor of the stages' span); cp.async copies."""
    _run("sm_90a", (130, 200, 328), dict(cfg, STAGES=stages), 16)


def test_wgmma_with_synchronous_copies():
    """Rows not 16-byte aligned: vector loads and st.shared into the WGMMA layout, each copy
    ending with a proxy fence (generic-proxy writes, async-proxy reads)."""
    _run("sm_90a", (70, 90, 99), dict(BM=64, BN=128, BK=64, STAGES=3, THREADS=128), 2)
    ptx = _compile(3, BM=64, BN=128, THREADS=128, ALIGN=2).asm["ptx"]
    assert ptx.count("fence.proxy.async.shared::cta") == 2 * 4  # A and B, prologue + 3 steps


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("target", ["sm_80", "gfx950"])
def test_pipeline_on_mma_sync_and_mfma(target, stages):
    _run(target, (100, 72, 136), dict(BM=64, BN=64, BK=32, STAGES=stages, THREADS=128), 16)


@kiln.kernel(num_threads=128)
def hand_loop_gemm(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2],
                   m: i32, n: i32, k: i32):
    a_s = kiln.tiles.operand_tile((64, 64), bf16, "a")
    b_s = kiln.tiles.operand_tile((64, 64), bf16, "b")
    row0, col0 = kiln.block_id(0) * 64, kiln.block_id(1) * 64
    acc = kiln.accumulator(a_s, b_s)
    for k0 in kiln.range(0, k, 64):
        kiln.copy(kiln.GlobalTile(a, (64, 64), (row0, k0), row_end=m, col_end=k), a_s)
        kiln.copy(kiln.GlobalTile(b, (64, 64), (k0, col0), row_end=k, col_end=n), b_s)
        kiln.barrier()
        acc = kiln.gemm(a_s, b_s, acc)
        kiln.barrier()
    kiln.copy(acc, kiln.GlobalTile(c, (64, 64), (row0, col0), row_end=m, col_end=n))


def test_wgmma_gemm_in_a_hand_written_loop():
    """A hand-written loop refills the operand tiles after kiln.gemm: kiln-insert-waits
    retires the WGMMA before the barrier ahead of the refill (wait_group 0), and the product
    is right."""
    rng = np.random.default_rng()
    a = rng.standard_normal((70, 150)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((150, 90)).astype(ml_dtypes.bfloat16)
    c = np.full((70, 90), np.nan, np.float32)
    hand_loop_gemm.interpret[(2, 2)](a, b, c, 70, 90, 150, target="sm_90a")
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4,
                               atol=1e-3)
    gpu = hand_loop_gemm.compile(a, b, c, 70, 90, 150, target="sm_90a").asm["gpu"]
    assert re.search(r"wgmma.commit.group.sync.aligned[^\n]*\n\s*nvvm.wgmma.wait.group.sync"
                     r".aligned 0\n\s*gpu.barrier", gpu)


def _compile(stages=4, target="sm_90a", **cfg):
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    params = dict(BM=128, BN=128, BK=64, THREADS=256, STAGES=stages, ALIGN=16)
    params.update(cfg)
    return pipelined_gemm.compile(a, a, np.zeros((256, 256), np.float32), 256, 256, 256,
                                  **params, target=target)


@pytest.mark.lower
@pytest.mark.parametrize("stages", [3, 4])
def test_wgmma_pipeline_waits(stages):
    """Per step, before its barrier: cp.async.wait_group 2 * (stages - 3) (the A and B groups
    of the stages still in flight) and wgmma.wait_group 1 (the group that read the stage the
    step refills; the previous step's stays in flight); wait_group 0 after the loop; nothing
    serialised."""
    ck = _compile(stages)
    ptx = ck.asm["ptx"]
    assert ck.metadata["wgmma_serialized"] is None and ck.metadata["spill_bytes"] == 0
    cp_waits = re.findall(r"cp\.async\.wait_group \t(\d+);", ptx)
    assert cp_waits == [str(2 * (stages - 3))] * stages
    assert re.findall(r"wgmma\.wait_group\.sync\.aligned \t(\d+);", ptx) == ["1"] * stages + ["0"]
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 4 * stages
    assert "fence.proxy.async" not in ptx  # cp.async copies need no proxy fence (as Triton)
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned \t1;\n\s*bar\.sync", ptx)) == stages


@pytest.mark.parametrize("stages", [2, 3])
def test_wgmma_pipeline_with_no_group_in_flight_in_the_interpreter(stages):
    """mma_in_flight=0: the fetch runs stages - 1 ahead, the wait analysis retires each
    step's WGMMA group before the next barrier; ragged M, N, K."""
    _run("sm_90a", (130, 200, 328), dict(WGMMA_CONFIGS[1], STAGES=stages, IN_FLIGHT=0), 16)


@pytest.mark.lower
def test_wgmma_pipeline_with_no_group_in_flight_waits():
    """mma_in_flight=0 on 4 stages: 3 steps of copies ahead (cp.async.wait_group 4: two
    steps' A and B groups stay in flight) and wgmma.wait_group 0 before each barrier."""
    ptx = _compile(4, IN_FLIGHT=0).asm["ptx"]
    assert re.findall(r"cp\.async\.wait_group \t(\d+);", ptx) == ["4"] * 4
    assert re.findall(r"wgmma\.wait_group\.sync\.aligned \t(\d+);", ptx) == ["0"] * 5
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned \t0;\n\s*bar\.sync", ptx)) == 4


@pytest.mark.parametrize("stages", [3, 4])
def test_wgmma_pipeline_with_a_barrier_before_the_fetch_in_the_interpreter(stages):
    _run("sm_90a", (130, 200, 328), dict(WGMMA_CONFIGS[1], STAGES=stages, EARLY=True), 16)


@pytest.mark.lower
@pytest.mark.parametrize("stages", [3, 4])
def test_wgmma_pipeline_with_a_barrier_before_the_fetch_waits(stages):
    """barrier_before_fetch: per step, cp.async.wait_group for N - 1 steps ahead before the
    first barrier; after the step's WGMMA group, wgmma.wait_group 1 (the previous step's group,
    whose stage the fetch refills) before the second barrier; then the copies."""
    ptx = _compile(stages, EARLY=True).asm["ptx"]
    assert re.findall(r"cp\.async\.wait_group \t(\d+);", ptx) == [str(2 * (stages - 2))] * stages
    step = (r"wgmma\.commit_group\.sync\.aligned;\n\s*wgmma\.wait_group\.sync\.aligned \t1;"
            r"\n\s*bar\.sync")
    assert len(re.findall(step, ptx)) == stages


def _waits(module):
    return ops_where(module, lambda op: wait_limits(op.operation))


@pytest.mark.lower
def test_deleting_a_placed_wait_fails_verify_waits():
    """Each wait of the pipelined WGMMA loop is required: without it kiln-verify-waits raises
    a WaitError naming the async op (the cp.async waits: a read before the copies land; the
    wgmma.wait_group 1: a refill of a stage an in-flight WGMMA reads; the last: the epilogue's
    read of the accumulator)."""
    text = _compile(4).asm["gpu"]
    with ir.Context():
        parsed = ir.Module.parse(text)  # held: its ops die with it
        labels = [op_label(w) for w in _waits(parsed)]
    assert sum("wgmma" in label for label in labels) == 5 and len(labels) == 9
    for index in range(len(labels)):
        with ir.Context():
            module = ir.Module.parse(text)
            _waits(module)[index].erase()
            with pytest.raises(WaitError, match="cp.async|device_async|wgmma"):
                build_pass_manager(["kiln-verify-waits"]).run(module.operation)


def test_pipeline_rejects_bad_arguments():
    with pytest.raises(KilnValueError, match="stages"):
        _compile(1)
    for stages, target, in_flight in ((2, "sm_90a", 1), (4, "sm_90a", 2), (3, "sm_80", 1)):
        with pytest.raises(KilnValueError, match="mma_in_flight"):
            _compile(stages, target, BK=32, IN_FLIGHT=in_flight)
    for stages, target, in_flight in ((2, "sm_90a", None), (4, "sm_90a", 0), (3, "sm_80", None)):
        with pytest.raises(KilnValueError, match="barrier_before_fetch"):
            _compile(stages, target, BK=32, IN_FLIGHT=in_flight, EARLY=True)
    with pytest.raises(KilnTypeError, match="fetch"):
        _bad_fetch.interpret[(1,)](np.zeros(4, np.float32), target="sm_90a")


@kiln.kernel(num_threads=128)
def _bad_fetch(x: kiln.Tensor[f32]):
    for it in kiln.pipeline(0, 4, 1, stages=2, fetch=None):
        x[it.k] = 1.0


@pytest.mark.lower
def test_wait_analysis_runs_each_pipeline_loop_a_few_rounds(monkeypatch):
    """The events reaching a value flow forward over the op tree, each loop body run again
    only until its iter_args stop growing: a 4-stage mma.sync pipeline interleaves many
    loop-carried cycles, which a walk per cycle re-entered millions of times (41 s to
    compile)."""
    from kiln.passes.reaching_events import ReachingEvents

    monkeypatch.setenv("KILN_NO_CACHE", "1")  # an earlier test's compile would be reused
    monkeypatch.setattr(pipelined_gemm, "_compiled", {})
    rounds = []
    init = ReachingEvents.__init__

    def counting(self, *args):
        init(self, *args)
        rounds.append(self.rounds)

    monkeypatch.setattr(ReachingEvents, "__init__", counting)
    _compile(4, "sm_80", BM=64, BN=64, BK=32, THREADS=128)
    assert rounds and 0 < max(rounds) < 50, rounds  # a round per nested body and back-edge hop
