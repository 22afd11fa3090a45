"""Which Hopper feature breaks Kiln kernels under ``compute-sanitizer --tool synccheck``?

Result on an H200 (driver 580, 2026-11-21, see bench/RESULTS.md): every rung passes when run
plainly; under synccheck rungs 1a/1b (one TMA box per mbarrier) pass, rung 2 (a two-stage TMA
ring whose mbarriers are reused) reads data that never arrived, and rung 3a ends in
"unspecified launch failure" -- while synccheck reports 0 errors. So synccheck cannot check
kernels whose TMA mbarriers go through more than one phase (every pipelined Hopper kernel).

A ladder of small kernels, simple to complex; each checks its own output against torch and
prints one line ``NAME PASS|FAIL|ERROR (detail)``. Run on an H100, plainly and under synccheck:

    python bench/synccheck_ladder.py
    compute-sanitizer --tool synccheck python bench/synccheck_ladder.py
    python bench/synccheck_ladder.py --only 5 6a       # rungs 5a/5b/5c and 6a
    python bench/synccheck_ladder.py --compile-only     # no GPU: trace + ptxas every rung

A hung mbarrier wait hangs the kernel: run under ``timeout`` and read the last printed line.
After an error the script checks that the CUDA context still works and stops if it does not.

Rungs (8 CTAs each; X is bf16 [rows, 64], TMA boxes are 128B-swizzled, so a raw smem->global
copy must equal X with 16-byte chunk c of row r moved to c ^ (r % 8)):
  1a  static smem, one TMA box 128x64, thread 0 arrive_expect_tx + load, all try_wait, copy
  1b  same with kiln.dynamic_shared (runtime-aligned base, as in the GEMM / prefill)
  2   one warp group, 2-stage ring, 4 boxes (64x64) per barrier, 8 tiles: phase flips, barrier
      reuse; stage refilled by thread 0 after a block barrier
  3a  warp-specialised copy: WG0 producer (tid 0, full/empty ring), WG1 consumer copies,
      all 128 consumer threads arrive on empty (count 128)
  3b  same, consumer does named_barrier(1, 128) then only its first thread arrives (GEMM style:
      arrive inside a divergent branch)
  4   3b + setmaxnreg 24 (producer) / 240 (consumer)
  5a  warp-specialised WGMMA K loop (the GEMM's inner loop): 8 K tiles, A box 64x64 + B in two
      32x64 boxes per stage, 4 x wgmma m64n64k16 (mma_async, hand-built descriptors) per stage,
      wait_group(1), release the previous stage from the first thread; fragment -> global f32
  5b  5a with all 128 consumer threads arriving on empty (no divergent branch near WGMMA)
  5c  5a + setmaxnreg 24/240 (the GEMM's combination)
  6a  two consumer warp groups (A box 128x64, each its 64 rows) with prefill_hopper's named-
      barrier ping-pong (bar.sync my turn / bar.arrive other turn around the WGMMA issue)
  6b  6a + setmaxnreg 24/240 (prefill_hopper's combination)
  7a  5a with the producer elected by elect_sync (warp 0) instead of tid == 0
  7b  3b with elect_sync issue
  8   5c + epilogue: store_fragment_swizzled (bf16) -> fence_proxy_async -> named barrier ->
      TMA store -> commit_group / wait_group (the GEMM's epilogue)
  9   5c with ~190 KB of extra dynamic shared memory (the GEMM's footprint near 227 KB)
  10  8 as 2-CTA clusters: cluster_sync, B halves TMA-multicast to both CTAs, empty released
      with mapa + remote mbarrier.arrive (the GEMM's cluster_m=2 configs, which autotune runs)
"""

from __future__ import annotations

import argparse
import sys
import traceback

import numpy as np

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.shared import dynamic_shared

CTAS = 8
COLS = 64  # one 128-byte swizzled bf16 row
SW = 128
ALIGN = 1024
WG = 128
TILES = 8  # ring iterations per CTA
STAGES = 2
BOX_ROWS = 64  # ring rungs: 4 boxes of 64 x 64 per stage
BOXES = 4
STAGE_ROWS = BOX_ROWS * BOXES
BOX_BYTES = BOX_ROWS * COLS * 2
K_TILES = 8  # WGMMA rungs: K = 512
# Rung 9: dynamic (1024 alignment slack + 5 tiles + PAD) + mbarriers end ~250 bytes below the
# 227 KB opt-in limit, like the GEMM (SHARED_BUDGET in kernels/gemm/hopper.py).
PAD_BYTES = 227 * 1024 - 256 - 1024 - 5 * 8192 - 48


def _copy_rows(tile, rows, out, row0, ltid):
    """Raw copy of a ``rows x 64`` bf16 shared tile to ``out[row0:row0+rows]`` by 128 threads
    (16-byte vectors, no un-swizzling: the host expects the swizzled image)."""
    for i in range(rows * COLS // 8 // WG):
        idx = i * WG + ltid
        r = idx // 8
        c = (idx % 8) * 8
        out.store(row0 + r, c, tile.load(r, c, width=8, align=16), align=16)


def _issue_stage(x_map, tiles, full, stage, row0):
    """expect_tx + 4 TMA boxes of 64 rows (rows row0 ..) into ring stage ``stage``."""
    full.arrive_expect_tx(stage, BOXES * BOX_BYTES)
    for j in range(BOXES):
        tma.load(x_map, tiles.tile(stage * BOXES + j), (0, row0 + j * BOX_ROWS), full, stage)


def _copy_stage(tiles, stage, out, row0, ltid):
    for j in range(BOXES):
        _copy_rows(tiles.tile(stage * BOXES + j), BOX_ROWS, out, row0 + j * BOX_ROWS, ltid)


def _store_fragment(acc, out, row0, ltid):
    """Fragment element i of thread t -> D[16w + l/4 + 8((i/2)%2), 8(i/4) + 2(l%4) + i%2]."""
    w, lane = ltid // 32, ltid % 32
    for i in range(acc.n // 2):
        row = 16 * w + lane // 4 + 8 * ((i // 2) % 2)
        col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
        out[row0 + row, col] = acc.element(i)


# ---------------------------------------------------------------------------------------------
# Rung 1: one box, one barrier
# ---------------------------------------------------------------------------------------------


def _producer_issuer(tid, setmaxnreg, elect):
    """The producer warp group's register give-back (optional) and its issuing thread: lane
    ``elect_sync`` picks in warp 0, or thread 0. Plain Python: runs while the kernel traces."""
    if setmaxnreg:
        nvidia_asm.setmaxnreg(24, increase=False)
    if elect:
        return (tid // 32 == 0) & nvidia_asm.elect_sync()
    return tid == 0

@kiln.kernel
def one_box(x_map: kiln.TensorMap[kiln.bf16, (128, COLS), SW], out: kiln.Tensor[kiln.bf16, 2],
            DYNAMIC: kiln.constexpr):
    if DYNAMIC:
        smem = dynamic_shared((1, 128, COLS), kiln.bf16, align=ALIGN).tile(0)
    else:
        smem = kiln.shared((128, COLS), kiln.bf16, align=ALIGN)
    tid = kiln.thread_id(0)
    leader = tid == 0
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=1, predicate=leader)
    nvidia_asm.fence_mbarrier_init()
    kiln.barrier()
    row0 = kiln.block_id(0) * 128
    bars.arrive_expect_tx(0, tma.box_bytes(x_map), predicate=leader)
    tma.load(x_map, smem, (0, row0), bars, 0, predicate=leader)
    bars.try_wait(0, phase=0)
    _copy_rows(smem, 128, out, row0, tid)


# ---------------------------------------------------------------------------------------------
# Rung 2: single warp group, 2-stage ring, phase flips
# ---------------------------------------------------------------------------------------------

@kiln.kernel
def ring_one_group(x_map: kiln.TensorMap[kiln.bf16, (BOX_ROWS, COLS), SW],
                   out: kiln.Tensor[kiln.bf16, 2]):
    tiles = dynamic_shared((STAGES * BOXES, BOX_ROWS, COLS), kiln.bf16, align=ALIGN)
    full = mbarrier.group(num_barriers=STAGES)
    tid = kiln.thread_id(0)
    for s in kiln.static_range(STAGES):
        full.init(s, count=1, predicate=tid == 0)
    nvidia_asm.fence_mbarrier_init()
    kiln.barrier()
    base = kiln.block_id(0) * (TILES * STAGE_ROWS)
    if tid == 0:
        for s in kiln.static_range(STAGES):
            _issue_stage(x_map, tiles, full, s, base + s * STAGE_ROWS)
    for t in kiln.range(0, TILES):
        stage = t % STAGES
        full.try_wait(stage, (t // STAGES) % 2)
        _copy_stage(tiles, stage, out, base + t * STAGE_ROWS, tid)
        kiln.barrier()  # every thread has read the stage before it is refilled
        if (tid == 0) & (t + STAGES < TILES):
            _issue_stage(x_map, tiles, full, stage, base + (t + STAGES) * STAGE_ROWS)


# ---------------------------------------------------------------------------------------------
# Rungs 3, 4, 7b: warp-specialised copy ring
# ---------------------------------------------------------------------------------------------

@kiln.kernel
def ring_specialised(x_map: kiln.TensorMap[kiln.bf16, (BOX_ROWS, COLS), SW],
                     out: kiln.Tensor[kiln.bf16, 2], RELEASE_ALL: kiln.constexpr,
                     SETMAXNREG: kiln.constexpr, ELECT: kiln.constexpr):
    tiles = dynamic_shared((STAGES * BOXES, BOX_ROWS, COLS), kiln.bf16, align=ALIGN)
    full = mbarrier.group(num_barriers=STAGES)
    empty = mbarrier.group(num_barriers=STAGES)
    tid = kiln.thread_id(0)
    for s in kiln.static_range(STAGES):
        full.init(s, count=1, predicate=tid == 0)
        empty.init(s, count=WG if RELEASE_ALL else 1, predicate=tid == 0)
    nvidia_asm.fence_mbarrier_init()
    kiln.barrier()
    base = kiln.block_id(0) * (TILES * STAGE_ROWS)
    warp_group = tid // WG
    if warp_group == 0:
        issuer = _producer_issuer(tid, SETMAXNREG, ELECT)
        if issuer:
            for t in kiln.range(0, TILES):
                stage = t % STAGES
                empty.try_wait(stage, (t // STAGES) % 2 ^ 1)
                _issue_stage(x_map, tiles, full, stage, base + t * STAGE_ROWS)
    else:
        if SETMAXNREG:
            nvidia_asm.setmaxnreg(240, increase=True)
        ltid = tid - WG
        for t in kiln.range(0, TILES):
            stage = t % STAGES
            full.try_wait(stage, (t // STAGES) % 2)
            _copy_stage(tiles, stage, out, base + t * STAGE_ROWS, ltid)
            if RELEASE_ALL:
                empty.arrive(stage)
            else:
                nvidia_asm.named_barrier(1, WG)
                if ltid == 0:
                    empty.arrive(stage)


# ---------------------------------------------------------------------------------------------
# Rungs 5, 7a, 8, 9, 10: warp-specialised WGMMA K loop (one consumer group)
# ---------------------------------------------------------------------------------------------

@kiln.kernel
def ws_wgmma(a_map: kiln.TensorMap[kiln.bf16, (64, COLS), SW],
             b_map: kiln.TensorMap[kiln.bf16, (32, COLS), SW],
             c_map: kiln.TensorMap[kiln.bf16, (64, COLS), SW],
             out: kiln.Tensor[kiln.f32, 2],
             RELEASE_ALL: kiln.constexpr, SETMAXNREG: kiln.constexpr, ELECT: kiln.constexpr,
             TMA_STORE: kiln.constexpr, PAD: kiln.constexpr, CLUSTER: kiln.constexpr):
    if CLUSTER > 1:
        nvidia_asm.cluster_dims(CLUSTER)
    a_tiles = dynamic_shared((STAGES, 64, COLS), kiln.bf16, align=ALIGN)
    b_tiles = dynamic_shared((STAGES * 2, 32, COLS), kiln.bf16, align=ALIGN)  # two halves
    c_tiles = dynamic_shared((1, 64, COLS), kiln.bf16, align=ALIGN)
    if PAD:
        dynamic_shared((PAD // 2,), kiln.bf16)  # unused: only grows the launch's footprint
    full = mbarrier.group(num_barriers=STAGES)
    empty = mbarrier.group(num_barriers=STAGES)
    tid = kiln.thread_id(0)
    for s in kiln.static_range(STAGES):
        full.init(s, count=1, predicate=tid == 0)
        empty.init(s, count=WG * CLUSTER if RELEASE_ALL else CLUSTER, predicate=tid == 0)
    nvidia_asm.fence_mbarrier_init()
    if CLUSTER > 1:
        nvidia_asm.cluster_sync()
        rank = nvidia_asm.cluster_ctarank()
    else:
        kiln.barrier()
        rank = 0
    row0 = kiln.block_id(0) * 64
    warp_group = tid // WG
    if warp_group == 0:
        issuer = _producer_issuer(tid, SETMAXNREG, ELECT)
        if issuer:
            for kt in kiln.range(0, K_TILES):
                stage = kt % STAGES
                empty.try_wait(stage, (kt // STAGES) % 2 ^ 1)
                full.arrive_expect_tx(stage, 2 * 64 * COLS * 2)
                tma.load(a_map, a_tiles.tile(stage), (kt * COLS, row0), full, stage)
                for h in kiln.static_range(2):
                    if CLUSTER > 1:
                        tma.load(b_map, b_tiles.tile(stage * 2 + h), (kt * COLS, 32 * h), full,
                                 stage, multicast_mask=(1 << CLUSTER) - 1, predicate=rank == h)
                    else:
                        tma.load(b_map, b_tiles.tile(stage * 2 + h), (kt * COLS, 32 * h), full,
                                 stage)
    else:
        if SETMAXNREG:
            nvidia_asm.setmaxnreg(240, increase=True)
        ltid = tid - WG
        first_thread = ltid == 0
        a_base = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16, stride_bytes=1024)
        b_base = wgmma.smem_descriptor(b_tiles.tile(0), leading_bytes=16, stride_bytes=1024)
        stage_units = 64 * COLS * 2 // 16
        acc = wgmma.fragment_zeros(64)
        for kt in kiln.range(0, K_TILES):
            stage = kt % STAGES
            full.try_wait(stage, (kt // STAGES) % 2)
            offset = kiln.cast(stage, kiln.i64) * stage_units
            wgmma.fence()
            for ks in kiln.static_range(COLS // 16):
                acc = wgmma.mma_async(acc, a_base + offset + ks * 2, b_base + offset + ks * 2,
                                      dtype=kiln.bf16)
            wgmma.commit()
            wgmma.wait_group(1)  # the previous stage's WGMMAs are done: release it
            previous = (kt + STAGES - 1) % STAGES
            if RELEASE_ALL:
                if kt > 0:
                    empty.arrive(previous)
            else:
                if (kt > 0) & first_thread:
                    if CLUSTER > 1:
                        for r in kiln.static_range(CLUSTER):
                            empty.arrive_cluster(previous, r)
                    else:
                        empty.arrive(previous)
        wgmma.wait_group(0)
        if TMA_STORE:
            wgmma.store_fragment_swizzled(acc, c_tiles, 0)
            nvidia_asm.fence_proxy_async()  # generic-proxy writes before the TMA (async) read
            nvidia_asm.named_barrier(1, WG)
            if first_thread:
                tma.store(c_tiles.tile(0), c_map, (0, row0))
                tma.commit_group()
                tma.wait_group(0)
        else:
            _store_fragment(acc, out, row0, ltid)
    if CLUSTER > 1:
        nvidia_asm.cluster_sync()  # the peer may still multicast into / arrive on this CTA


# ---------------------------------------------------------------------------------------------
# Rung 6: two consumer groups, prefill_hopper's named-barrier ping-pong
# ---------------------------------------------------------------------------------------------

PINGPONG = 3  # named barriers 3, 4 as in prefill_hopper.py


@kiln.kernel
def pingpong_wgmma(a_map: kiln.TensorMap[kiln.bf16, (128, COLS), SW],
                   b_map: kiln.TensorMap[kiln.bf16, (32, COLS), SW],
                   out: kiln.Tensor[kiln.f32, 2], SETMAXNREG: kiln.constexpr):
    a_tiles = dynamic_shared((STAGES, 128, COLS), kiln.bf16, align=ALIGN)
    b_tiles = dynamic_shared((STAGES * 2, 32, COLS), kiln.bf16, align=ALIGN)
    full = mbarrier.group(num_barriers=STAGES)
    empty = mbarrier.group(num_barriers=STAGES)
    tid = kiln.thread_id(0)
    for s in kiln.static_range(STAGES):
        full.init(s, count=1, predicate=tid == 0)
        empty.init(s, count=2, predicate=tid == 0)
    nvidia_asm.fence_mbarrier_init()
    kiln.barrier()
    row0 = kiln.block_id(0) * 128
    warp_group = tid // WG
    if warp_group == 0:
        if SETMAXNREG:
            nvidia_asm.setmaxnreg(24, increase=False)
        if tid == 0:
            for kt in kiln.range(0, K_TILES):
                stage = kt % STAGES
                empty.try_wait(stage, (kt // STAGES) % 2 ^ 1)
                full.arrive_expect_tx(stage, (128 + 64) * COLS * 2)
                tma.load(a_map, a_tiles.tile(stage), (kt * COLS, row0), full, stage)
                for h in kiln.static_range(2):
                    tma.load(b_map, b_tiles.tile(stage * 2 + h), (kt * COLS, 32 * h), full,
                             stage)
    else:
        if SETMAXNREG:
            nvidia_asm.setmaxnreg(240, increase=True)
        consumer = warp_group - 1
        ltid = tid % WG
        first_thread = ltid == 0
        a_base = wgmma.smem_descriptor(a_tiles.tile(0), leading_bytes=16, stride_bytes=1024,
                                       byte_offset=consumer * 64 * 128)
        b_base = wgmma.smem_descriptor(b_tiles.tile(0), leading_bytes=16, stride_bytes=1024)
        my_turn = PINGPONG + consumer
        other_turn = PINGPONG + 1 - consumer
        if consumer == 1:  # consumer 0 issues first
            nvidia_asm.named_barrier_arrive(PINGPONG, 2 * WG)
        acc = wgmma.fragment_zeros(64)
        for kt in kiln.range(0, K_TILES):
            stage = kt % STAGES
            full.try_wait(stage, (kt // STAGES) % 2)
            stage64 = kiln.cast(stage, kiln.i64)
            a_desc = a_base + stage64 * (128 * COLS * 2 // 16)
            b_desc = b_base + stage64 * (64 * COLS * 2 // 16)
            nvidia_asm.named_barrier(my_turn, 2 * WG)
            wgmma.fence()
            for ks in kiln.static_range(COLS // 16):
                acc = wgmma.mma_async(acc, a_desc + ks * 2, b_desc + ks * 2, dtype=kiln.bf16)
            wgmma.commit()
            nvidia_asm.named_barrier_arrive(other_turn, 2 * WG)
            wgmma.wait_group(0)
            if first_thread:
                empty.arrive(stage)
        if consumer == 0:  # absorb consumer 1's last hand-over
            nvidia_asm.named_barrier(PINGPONG, 2 * WG)
        _store_fragment(acc, out, row0 + consumer * 64, ltid)


# ---------------------------------------------------------------------------------------------
# The ladder
# ---------------------------------------------------------------------------------------------

WS = dict(RELEASE_ALL=0, SETMAXNREG=0, ELECT=0, TMA_STORE=0, PAD=0, CLUSTER=1)
RUNGS = [  # name, kernel, num_warps, constexprs, inputs
    ("1a_tma_one_box_static", one_box, 4, dict(DYNAMIC=0), "one_box"),
    ("1b_tma_one_box_dynamic", one_box, 4, dict(DYNAMIC=1), "one_box"),
    ("2_ring_one_group", ring_one_group, 4, {}, "ring"),
    ("3a_ws_copy_release_all", ring_specialised, 8,
     dict(RELEASE_ALL=1, SETMAXNREG=0, ELECT=0), "ring"),
    ("3b_ws_copy_release_first", ring_specialised, 8,
     dict(RELEASE_ALL=0, SETMAXNREG=0, ELECT=0), "ring"),
    ("4_ws_copy_setmaxnreg", ring_specialised, 8,
     dict(RELEASE_ALL=0, SETMAXNREG=1, ELECT=0), "ring"),
    ("5a_ws_wgmma", ws_wgmma, 8, WS, "gemm"),
    ("5b_ws_wgmma_release_all", ws_wgmma, 8, {**WS, "RELEASE_ALL": 1}, "gemm"),
    ("5c_ws_wgmma_setmaxnreg", ws_wgmma, 8, {**WS, "SETMAXNREG": 1}, "gemm"),
    ("6a_pingpong_2_consumers", pingpong_wgmma, 12, dict(SETMAXNREG=0), "pingpong"),
    ("6b_pingpong_setmaxnreg", pingpong_wgmma, 12, dict(SETMAXNREG=1), "pingpong"),
    ("7a_ws_wgmma_elect_sync", ws_wgmma, 8, {**WS, "ELECT": 1}, "gemm"),
    ("7b_ws_copy_elect_sync", ring_specialised, 8,
     dict(RELEASE_ALL=0, SETMAXNREG=0, ELECT=1), "ring"),
    ("8_ws_wgmma_tma_store", ws_wgmma, 8, {**WS, "SETMAXNREG": 1, "TMA_STORE": 1}, "gemm_tma"),
    ("9_ws_wgmma_big_smem", ws_wgmma, 8, {**WS, "SETMAXNREG": 1, "PAD": PAD_BYTES}, "gemm"),
    ("10_cluster2_multicast", ws_wgmma, 8,
     {**WS, "SETMAXNREG": 1, "TMA_STORE": 1, "CLUSTER": 2}, "gemm_tma"),
]


def _shapes(kind):
    """Host arrays per input kind: (inputs, output, rows of the copy image)."""
    if kind == "one_box":
        return [(CTAS * 128, COLS)], (CTAS * 128, COLS)
    if kind == "ring":
        rows = CTAS * TILES * STAGE_ROWS
        return [(rows, COLS)], (rows, COLS)
    k = K_TILES * COLS
    if kind == "pingpong":
        return [(CTAS * 128, k), (64, k)], (CTAS * 128, 64)
    return [(CTAS * 64, k), (64, k)], (CTAS * 64, 64)


def _selected(name: str, wanted: str) -> bool:
    """``--only 5`` picks 5a/5b/5c, ``--only 5a`` only 5a (and ``1`` does not pick ``10``)."""
    rung = name.split("_")[0]
    return wanted in (rung, rung.rstrip("abc"))


def compile_only() -> int:
    import ml_dtypes

    failures = 0
    for name, kernel, warps, constexprs, kind in RUNGS:
        ins, out_shape = _shapes(kind)
        bf16 = ml_dtypes.bfloat16
        args = [np.empty(s, bf16) for s in ins]
        if kind in ("gemm", "gemm_tma"):
            args += [np.empty(out_shape, bf16), np.empty(out_shape, np.float32)]
        elif kind == "pingpong":
            args += [np.empty(out_shape, np.float32)]
        else:
            args += [np.empty(out_shape, bf16)]
        try:
            ck = kernel.compile(*args, target="sm_90a", num_warps=warps, **constexprs)
            meta = ck.metadata
            print(f"{name} COMPILED (registers {meta.get('registers')}, static shared "
                  f"{meta.get('shared_bytes')} B, dynamic shared "
                  f"{ck.signature.dynamic_shared_bytes} B, cluster {ck.signature.cluster}, "
                  f"cubin {len(ck.asm['cubin'])} B)", flush=True)
        except Exception as exc:  # report every rung, not just the first failure
            failures += 1
            print(f"{name} COMPILE-ERROR ({type(exc).__name__}: {exc})", flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true",
                        help="trace and compile every rung for sm_90a (no GPU, no torch)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="rung ids to run: 5 (= 5a, 5b, 5c) or 5a")
    opts = parser.parse_args()
    if opts.compile_only:
        return 1 if compile_only() else 0

    import torch

    def swizzled(x):
        """The image of 128B-swizzled TMA boxes (rows multiple of 8 apart): 16-byte chunk c of
        row r lands at chunk c ^ (r % 8)."""
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        cols = torch.arange(COLS, device=x.device)[None, :]
        source = 8 * ((cols // 8) ^ (rows % 8)) + cols % 8
        return torch.gather(x, 1, source)

    def check_copy(x, out):
        expected = swizzled(x)
        if torch.equal(out, expected):
            return True, "exact"
        if torch.equal(out, x):
            return False, "unswizzled image"
        bad = (out != expected).reshape(-1, 8 * COLS)  # per 8-row group
        nan = torch.isnan(out.float()).sum().item()
        return False, (f"{int((out != expected).sum())} of {out.numel()} differ, {nan} NaN "
                       f"(poison = unwritten), first bad 8-row group "
                       f"{int(bad.any(1).nonzero()[0])}")

    def check_matmul(a, b, out, a_rows_per_cta):
        ref = (a.float() @ b.float().T)
        out = out.float()
        nan = torch.isnan(out).sum().item()
        err = ((out - ref).norm() / ref.norm()).item()
        if nan == 0 and err < 1e-2:
            return True, f"rel err {err:.1e}"
        close = (out - ref).abs() <= 1e-1 * ref.abs().max()  # NaN is never close
        wrong_ctas = sorted({int(i) // a_rows_per_cta for i in (~close).any(1).nonzero()})
        return False, f"rel err {err:.2e}, {nan} NaN, bad CTAs {wrong_ctas}"

    def context_alive():
        try:
            torch.cuda.synchronize()
            (torch.ones(4, device="cuda") + 1).sum().item()
            return True
        except Exception:
            return False

    torch.manual_seed(0)
    for name, kernel, warps, constexprs, kind in RUNGS:
        if opts.only is not None and not any(_selected(name, p) for p in opts.only):
            continue
        ins, out_shape = _shapes(kind)
        inputs = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in ins]
        grid = (CTAS, 1, 1)
        try:
            if kind in ("one_box", "ring"):
                out = torch.full(out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
                kernel[grid](inputs[0], out, target="sm_90a", num_warps=warps, **constexprs)
                torch.cuda.synchronize()
                ok, detail = check_copy(inputs[0], out)
            elif kind == "pingpong":
                out = torch.full(out_shape, float("nan"), device="cuda")
                kernel[grid](*inputs, out, target="sm_90a", num_warps=warps, **constexprs)
                torch.cuda.synchronize()
                ok, detail = check_matmul(*inputs, out, 128)
            else:
                c_bf16 = torch.full(out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
                out = torch.full(out_shape, float("nan"), device="cuda")
                kernel[grid](*inputs, c_bf16, out, target="sm_90a", num_warps=warps,
                             **constexprs)
                torch.cuda.synchronize()
                ok, detail = check_matmul(*inputs, c_bf16 if kind == "gemm_tma" else out, 64)
            print(f"{name} {'PASS' if ok else 'FAIL'} ({detail})", flush=True)
        except Exception as exc:
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            print(f"{name} ERROR ({last})", flush=True)
            if not context_alive():
                print(f"{name}: CUDA context unusable after the error (sticky); stopping",
                      flush=True)
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
