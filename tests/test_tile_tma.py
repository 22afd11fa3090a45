"""``kiln.copy`` through TMA on sm_90a (kiln.tile_tma): derived tensor-map parameters, ragged
edges by TMA's zero fill, the mbarrier waits kiln-insert-waits places (and kiln-verify-waits
rejecting the program when one is deleted), staged TMA stores, and the pipelined WGMMA GEMM on
them in the interpreter and (gpu marker) on a Hopper GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mlir import ir

import kiln
from kiln import bf16, f32
from kiln.core.errors import WaitError
from kiln.passes import build_pass_manager
from kiln.passes.op_queries import op_label
from kiln.signature import TensorMapParam

from ir_ops import ops_where


@kiln.kernel(num_threads="THREADS")
def tma_gemm(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2],
             BM: kiln.constexpr, BN: kiln.constexpr, BK: kiln.constexpr,
             STAGES: kiln.constexpr, THREADS: kiln.constexpr, EARLY: kiln.constexpr,
             HANDOFF: kiln.constexpr = False):
    (m, k), (kb, n) = a.shape, b.shape
    row0, col0 = kiln.block_id(0) * BM, kiln.block_id(1) * BN
    a_s = [kiln.tiles.operand_tile((BM, BK), bf16, "a") for _ in range(STAGES)]
    b_s = [kiln.tiles.operand_tile((BK, BN), bf16, "b") for _ in range(STAGES)]

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (BM, BK), (row0, k0), row_end=m, col_end=k, align=16),
                  a_s[s])
        kiln.copy(kiln.GlobalTile(b, (BK, BN), (k0, col0), row_end=kb, col_end=n, align=16),
                  b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, BK, stages=STAGES, fetch=fetch, barrier_before_fetch=EARLY,
                            handoff=HANDOFF):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    mc, nc = c.shape
    kiln.copy(acc, kiln.GlobalTile(c, (BM, BN), (row0, col0), row_end=mc, col_end=nc, align=16),
              staged=True)


@kiln.kernel(num_threads=128)
def tma_window(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], r0: kiln.i32, c0: kiln.i32,
               ROWS: kiln.constexpr, COLS: kiln.constexpr):
    """A ``ROWS x COLS`` window of ``x`` at ``(r0, c0)`` into a row-major shared tile (TMA,
    zeros past the edges), then through registers into ``y`` (the whole tile, unmasked)."""
    rows, cols = x.shape
    flat = kiln.dynamic_shared((ROWS * COLS,), f32, align=128)
    s = kiln.tiles.SharedTile.view(flat, (ROWS, COLS))
    kiln.copy(kiln.GlobalTile(x, (ROWS, COLS), (r0, c0), row_end=rows, col_end=cols, align=16),
              s)
    kiln.barrier()
    t = kiln.load(s, kiln.layout.blocked((ROWS, COLS), 128, vec=4))
    kiln.copy(t, kiln.GlobalTile(y, (ROWS, COLS), (0, 0)))


@kiln.kernel(num_threads=128)
def tma_column_sums(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2]):
    """``y = sum_j x[:32, 64j:64j+64]``: a hand-written loop of step 64 refilling one shared
    tile by TMA (the ring proof counts its uses by ``(c0 - 64) // 64``)."""
    rows, cols = x.shape
    flat = kiln.dynamic_shared((32 * 64,), f32, align=128)
    s = kiln.tiles.SharedTile.view(flat, (32, 64))
    tv = kiln.layout.blocked((32, 64), 128, vec=4)
    acc = kiln.load(kiln.GlobalTile(x, (32, 64), (0, 0), row_end=rows, col_end=cols), tv)
    for c0 in kiln.range(64, cols, 64):
        kiln.copy(kiln.GlobalTile(x, (32, 64), (0, c0), row_end=rows, col_end=cols, align=16), s)
        kiln.barrier()
        acc = acc + kiln.load(s, tv)
        kiln.barrier()
    kiln.copy(acc, kiln.GlobalTile(y, (32, 64), (0, 0)))


@kiln.kernel(num_threads=128)
def tma_block_sums(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], MAXED: kiln.constexpr):
    """``y = sum_j x[:32, 64j:64j+64]``: block 0 by plain loads, the middle blocks by TMA in a
    unit-step loop, the last block by TMA after it (its wait counts the loop's trips, which
    the ring proof needs to know are >= 0: ``kiln.max(.., 0)`` with ``MAXED``)."""
    rows, cols = x.shape
    flat = kiln.dynamic_shared((32 * 64,), f32, align=128)
    s = kiln.tiles.SharedTile.view(flat, (32, 64))
    tv = kiln.layout.blocked((32, 64), 128, vec=4)

    def block(c0):
        return kiln.GlobalTile(x, (32, 64), (0, c0), row_end=rows, col_end=cols, align=16)

    acc = kiln.load(block(0), tv)
    middle = (cols + 63) // 64 - 2
    if MAXED:
        middle = kiln.max(middle, 0)
    for j in kiln.range(0, middle):
        kiln.copy(block(j * 64 + 64), s)
        kiln.barrier()
        acc = acc + kiln.load(s, tv)
        kiln.barrier()
    kiln.copy(block(middle * 64 + 64), s)   # past the edge (one block): TMA reads zeros
    kiln.barrier()
    kiln.copy(acc + kiln.load(s, tv), kiln.GlobalTile(y, (32, 64), (0, 0)))


def _column_sums(x):
    padded = np.zeros((32, -(-x.shape[1] // 64) * 64), np.float64)
    padded[:x.shape[0], :x.shape[1]] = x
    return padded.reshape(32, -1, 64).sum(axis=1)


@kiln.kernel(num_threads=128)
def tma_shared_round_trip(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], r0: kiln.i32,
                          c0: kiln.i32):
    """A 32 x 64 window of ``x`` through a shared tile, doubled in registers, written back to
    the shared tile and stored into ``y`` at the same place by TMA (clipped at the edges)."""
    rows, cols = x.shape
    my, ny = y.shape
    flat = kiln.dynamic_shared((32 * 64,), f32, align=128)
    s = kiln.tiles.SharedTile.view(flat, (32, 64))
    kiln.copy(kiln.GlobalTile(x, (32, 64), (r0, c0), row_end=rows, col_end=cols, align=16), s)
    kiln.barrier()
    t = kiln.load(s, kiln.layout.blocked((32, 64), 128, vec=4))
    kiln.barrier()
    kiln.copy(t * 2.0, s)
    kiln.copy(s, kiln.GlobalTile(y, (32, 64), (r0, c0), row_end=my, col_end=ny, align=16))


GEMM = dict(BM=128, BN=128, BK=64, THREADS=256)


def _operands(rng, m, n, k):
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    return a, b, a.astype(np.float64) @ b.astype(np.float64)


def _grid(m, n):
    return (-(-m // GEMM["BM"]), -(-n // GEMM["BN"]))


@pytest.mark.parametrize("stages,early", [(2, False), (3, False), (4, False), (3, True)])
def test_tma_pipeline_ragged_in_the_interpreter(stages, early):
    """Ragged M, N, K (K not a multiple of BK nor of the stages' span): the boxes past the
    tensors' edges read zeros, and the staged TMA store drops C's elements past them."""
    m, n, k = 130, 200, 328
    a, b, want = _operands(np.random.default_rng(), m, n, k)
    c = np.full((m, n), np.nan, np.float32)
    tma_gemm.interpret[_grid(m, n)](a, b, c, **GEMM, STAGES=stages, EARLY=early,
                                    target="sm_90a")
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("stages", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_tma_pipeline_handed_back_by_mbarriers_in_the_interpreter(stages):
    """``handoff=True``: no block barrier a step; the refill waits on the tiles' empty
    mbarriers, which every thread arrives on once the WGMMA group reading them retired."""
    m, n, k = 130, 200, 1000
    a, b, want = _operands(np.random.default_rng(), m, n, k)
    c = np.full((m, n), np.nan, np.float32)
    tma_gemm.interpret[_grid(m, n)](a, b, c, **GEMM, STAGES=stages, EARLY=False, HANDOFF=True,
                                    target="sm_90a")
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3)


def test_handoff_keeps_the_barriers_where_copies_are_not_tma():
    """The copies below are synchronous (no ``align``): ``handoff=True`` keeps the block
    barrier a step, as on targets without WGMMA, so a portable kernel may pass it anywhere."""
    @kiln.kernel(num_threads=128)
    def synchronous(a: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2], k: kiln.i32):
        a_s = [kiln.tiles.operand_tile((64, 64), bf16, "a") for _ in range(3)]
        b_s = [kiln.tiles.operand_tile((64, 64), bf16, "b") for _ in range(3)]

        def fetch(k0, s):
            kiln.copy(kiln.GlobalTile(a, (64, 64), (0, k0), col_end=k), a_s[s])
            kiln.copy(kiln.GlobalTile(a, (64, 64), (k0, 0), row_end=k), b_s[s])

        acc = kiln.accumulator(a_s[0], b_s[0])
        for it in kiln.pipeline(0, k, 64, stages=3, fetch=fetch, handoff=True):
            acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
        kiln.copy(acc, kiln.GlobalTile(c, (64, 64), (0, 0)))

    x = np.zeros((64, 64), ml_dtypes.bfloat16)
    asm = synchronous.trace(x, np.zeros((64, 64), np.float32), 64, target="sm_90a").module_asm
    loop = asm[asm.index("scf.for"):]
    assert loop.count("gpu.barrier") >= 3 and "nvgpu.mbarrier" not in asm
    with pytest.raises(kiln.KilnValueError, match="handoff"):
        kiln.pipeline(0, 64, 64, stages=3, fetch=lambda k, s: None, handoff=True,
                      barrier_before_fetch=True)


def test_tma_copy_derives_tensor_map_parameters():
    """One derived map per (tensor, box, swizzle) after the declared parameters; the caller
    passes only the declared ones (the launcher and interpreter take each map's source)."""
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    traced = tma_gemm.trace(a, a, np.zeros((256, 256), np.float32), **GEMM, STAGES=3,
                            EARLY=False, target="sm_90a")
    sig = traced.signature
    derived = [p for p in sig.params if isinstance(p, TensorMapParam)]
    assert [(p.source, p.box, p.swizzle) for p in derived] == [
        ("a", (128, 64), 128), ("b", (64, 64), 128), ("c", (128, 32), 128)]
    assert sig.declared == 3 and sig.sources() == (0, 1, 2)
    assert sig.expand(["A", "B", "C"]) == ["A", "B", "C", "A", "B", "C"]
    asm = traced.module_asm
    # a prologue fetch and one per step of the 3 (A: one box, B: two 64-column boxes)
    assert asm.count("nvgpu.tma.async.load") == (1 + 3) * (1 + 2)
    assert "nvgpu.tma.async.store" in asm
    assert "nvgpu.device_async_copy" not in asm


@pytest.mark.parametrize("r0,c0", [(0, 0), (50, 36), (-3, 60)])
def test_tma_window_zero_fills_past_the_edges(r0, c0):
    x = np.random.default_rng().standard_normal((60, 100)).astype(np.float32)
    y = np.full((32, 64), np.nan, np.float32)
    tma_window.interpret[(1,)](x, y, r0, c0, ROWS=32, COLS=64, target="sm_90a")
    want = np.zeros_like(y)
    rows = slice(max(r0, 0), min(r0 + 32, 60))
    cols = slice(max(c0, 0), min(c0 + 64, 100))
    want[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0] = x[rows, cols]
    np.testing.assert_array_equal(y, want)


def test_tma_in_a_hand_written_loop():
    x = np.random.default_rng().standard_normal((30, 300)).astype(np.float32)
    y = np.full((32, 64), np.nan, np.float32)
    tma_column_sums.interpret[(1,)](x, y, target="sm_90a")
    np.testing.assert_allclose(y, _column_sums(x), rtol=1e-5, atol=1e-5)
    assert "nvgpu.tma.async.load" in tma_column_sums.trace(x, y, target="sm_90a").module_asm


@pytest.mark.parametrize("cols", [40, 300])
def test_tma_read_after_a_loop_of_max_trips(cols):
    """The read after the loop waits for the use the loop's ``kiln.max(n, 0)`` trips leave
    next (none with one block); with the bare count ``n`` (maybe negative) the pass refuses."""
    x = np.random.default_rng().standard_normal((30, cols)).astype(np.float32)
    y = np.full((32, 64), np.nan, np.float32)
    tma_block_sums.interpret[(1,)](x, y, MAXED=True, target="sm_90a")
    np.testing.assert_allclose(y, _column_sums(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(WaitError, match="not counted"):
        tma_block_sums.interpret[(1,)](x, y, MAXED=False, target="sm_90a")


@pytest.mark.parametrize("r0,c0", [(0, 0), (50, 36)])
def test_shared_to_global_by_tma_store(r0, c0):
    x = np.random.default_rng().standard_normal((60, 100)).astype(np.float32)
    y = np.full_like(x, np.nan)
    tma_shared_round_trip.interpret[(1,)](x, y, r0, c0, target="sm_90a")
    want = np.full_like(x, np.nan)
    want[r0:r0 + 32, c0:c0 + 64] = 2 * x[r0:r0 + 32, c0:c0 + 64]
    np.testing.assert_array_equal(y, want)
    asm = tma_shared_round_trip.trace(x, y, 0, 0, target="sm_90a").module_asm
    assert "nvgpu.tma.async.store" in asm


def test_masks_other_than_the_extents_keep_cp_async():
    """A mask at a scalar argument (not provably the tensor's extent) is not TMA's clipping."""
    @kiln.kernel(num_threads=128)
    def masked(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], n: kiln.i32):
        flat = kiln.dynamic_shared((32 * 64,), f32, align=128)
        s = kiln.tiles.SharedTile.view(flat, (32, 64))
        kiln.copy(kiln.GlobalTile(x, (32, 64), (0, 0), col_end=n, align=16), s)
        kiln.barrier()
        kiln.copy(kiln.load(s, kiln.layout.blocked((32, 64), 128, vec=4)),
                  kiln.GlobalTile(y, (32, 64), (0, 0)))

    x = np.zeros((32, 64), np.float32)
    traced = masked.trace(x, x, 64, target="sm_90a")
    assert "nvgpu.tma" not in traced.module_asm and "nvgpu.device_async_copy" in traced.module_asm
    assert len(traced.signature.params) == 3


def _waits(module):
    return ops_where(module, lambda op: op.name in ("nvgpu.mbarrier.try_wait.parity",
                                                    "nvvm.wgmma.wait.group.sync.aligned"))


@pytest.mark.lower
@pytest.mark.parametrize("handoff", [False, True])
def test_deleting_a_placed_wait_fails_verify_waits(handoff):
    """The mbarrier waits before each step's WGMMAs, the wgmma.wait_group before each refill's
    barrier (or, handed back by mbarriers, before each release) and the empty waits before
    each refill are all required: without one kiln-verify-waits raises a WaitError."""
    a = np.zeros((256, 256), ml_dtypes.bfloat16)
    ck = tma_gemm.compile(a, a, np.zeros((256, 256), np.float32), **GEMM, STAGES=4,
                          EARLY=False, HANDOFF=handoff, target="sm_90a")
    assert ck.metadata["wgmma_serialized"] is None
    text = ck.asm["gpu"]
    with ir.Context():
        parsed = ir.Module.parse(text)  # held: its ops die with it
        labels = [op_label(w) for w in _waits(parsed)]
    # full waits: 2 tiles x 4 steps; handed back: empty waits before the 2 x 4 arms in the loop
    assert sum("try_wait" in label for label in labels) == 2 * 4 + (8 if handoff else 0)
    with ir.Context():
        # a wait_group 2 (a no-op: at most 2 groups are in flight) is left where the first
        # walk placed it, before the releases' wait_group 1 existed; the others are needed
        parsed = ir.Module.parse(text)
        kept = [i for i, w in enumerate(_waits(parsed))
                if "wait.group" not in w.name or ir.IntegerAttr(w.attributes["group"]).value < 2]
    assert len(kept) >= len(labels) - 1
    for index in kept:
        with ir.Context():
            module = ir.Module.parse(text)
            _waits(module)[index].erase()
            with pytest.raises(WaitError, match="tma|mbarrier|wgmma"):
                build_pass_manager(["kiln-verify-waits"]).run(module.operation)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 520, 336), (256, 512, 4096), (130, 200, 328)])
def test_tma_gemm_on_gpu(shape):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda").to(torch.bfloat16)
    for stages, early, handoff in ((4, False, False), (3, True, False), (4, False, True)):
        c = torch.full((m, n), float("nan"), device="cuda")
        tma_gemm[_grid(m, n)](a, b, c, **GEMM, STAGES=stages, EARLY=early, HANDOFF=handoff)
        want = a.double() @ b.double()
        torch.testing.assert_close(c.double(), want, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("r0,c0", [(0, 0), (50, 36), (-3, 60)])
def test_tma_window_on_gpu(r0, c0):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    x = torch.randn(60, 100, device="cuda")
    y = torch.full((32, 64), float("nan"), device="cuda")
    tma_window[(1,)](x, y, r0, c0, ROWS=32, COLS=64)
    want = np.zeros((32, 64), np.float32)
    host = x.cpu().numpy()
    rows = slice(max(r0, 0), min(r0 + 32, 60))
    cols = slice(max(c0, 0), min(c0 + 64, 100))
    want[rows.start - r0:rows.stop - r0, cols.start - c0:cols.stop - c0] = host[rows, cols]
    np.testing.assert_array_equal(y.cpu().numpy(), want)


@pytest.mark.gpu
def test_tma_in_a_hand_written_loop_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    x = torch.randn(30, 300, device="cuda")
    y = torch.full((32, 64), float("nan"), device="cuda")
    tma_column_sums[(1,)](x, y)
    np.testing.assert_allclose(y.cpu().numpy(), _column_sums(x.cpu().numpy()), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.gpu
def test_shared_to_global_by_tma_store_on_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    x = torch.randn(60, 100, device="cuda")
    y = torch.full_like(x, float("nan"))
    tma_shared_round_trip[(1,)](x, y, 50, 36)
    want = np.full((60, 100), np.nan, np.float32)
    want[50:, 36:] = 2 * x.cpu().numpy()[50:, 36:]
    np.testing.assert_array_equal(y.cpu().numpy(), want)
