"""Variants of the softmax and layer-norm tutorials for bench/tutorials_rows.py's A/B: the
streamed softmax's copy orders and probes (``softmax_ab``) and the three-stage pipelines
(``softmax_pipe``, ``layernorm_pipe``). The other variants below were measured slower and
left out of the A/B; their kernels are in ``git show 430c4ad:bench/rows_variants.py``.

- ``softmax_prefetch`` / ``layernorm_prefetch``: a persistent grid whose blocks hold their row
  in registers and load the next ``DEPTH - 1`` rows into more registers before this one's
  reductions (a software pipeline: DRAM reads row ``i + 1`` while row ``i`` is reduced and
  stored; no shared stream, no wait). Layer norm keeps ``w`` and ``b`` in shared memory,
  copied once per block (``WBS``), instead of reading them from L2 for every row. ``SPLIT > 1``
  splits each row over a thread-block cluster (``kiln.reduce(..., cluster=True)``).
- ``layernorm_stream_wb``: the tutorial's streamed kernel with ``w``/``b`` of ``AHEAD`` tiles
  loaded before the stores of the tiles before them (a tile's loads no longer wait for the
  previous tile's stores, which they may alias). With ``AHEAD = 1`` it was the tutorials'
  streamed path before ``kiln.load(via=, refill=)``.
- ``layernorm_ring``: the tutorial's streamed layer norm (rows through shared tiles, each
  refilled with the next row's once read) with one-pass statistics (``ONEPASS``), ``w``/``b``
  in shared memory (``WBS`` 1), only their first tile (``WBS`` 2: a probe of what their L2
  traffic costs), through a ring of shared tiles (``WBS`` 3), ``AHEAD`` tiles ahead, or the
  row copied by TMA boxes (``TMA``, as ``softmax_tma``).
- ``softmax_ab``: the streamed softmax in 4096-column tiles with the next row's copies issued
  before the reductions (``ISSUE`` 0), after the stores (1) or after each tile's store (2),
  TMA-staged stores (``TSTORE``), and probes (``PROBE``: no loads, no stores, neither, no math).
- ``softmax_pipe`` / ``layernorm_pipe``: a three-stage pipeline: row ``r + grid`` read tile by
  tile between row ``r``'s tile stores, each shared tile refilled with row ``r + 2 grid``.
- ``softmax_tma``: the streamed softmax with each piece of a row copied by one TMA box of ``x``
  viewed as ``(m * n / 256, 256)``: one instruction of one thread a piece, no cp.async
  request slots.

Measured on an H200 (2^24-element float32 matrices, GB/s with the tutorials of the same run;
three batches): the register prefetch was slower than the tutorials at 4k and 8k columns
(softmax 3392-3598 against 3742-3758 at 4k, 3286-3554 against 3723-3740 at 8k; layer norm
3307-3589 against 3494-3680), level or slower for the softmax at 16k (3379-3411 at 1024
threads, 3503-3521 at 512 against 3435-3449 streamed and 3584 for the tutorial's block a row
at 64 registers, two blocks an SM, its default since) and faster only for the layer norm at 16k
(3337-3370 against 3087-3123, as fast as ``stream_wb`` 3308-3344, which needs no extra
kernel). One or two more rows in flight (``DEPTH`` 3) lost 2-4%. Rows split over a cluster
were slower again, even with the next row in flight during the exchanges: softmax 32k
2643-2723 against 3381-3395 (2 or 4 CTAs), layer norm 32k 1417-2775 against 3110-3116
(``stream_wb``), softmax 16k 2899 over pairs of CTAs. ``stream_wb`` with ``AHEAD = 1``: layer
norm 1024 x 16384 3308 / 3344 against 3087 / 3123, 512 x 32768 3116 / 3110 against 2770 / 2813.

Session 37 (batch 1, copy 4211 GB/s): the per-tile refill (one barrier a tile, the next row's
copies issued as this row's tiles are read) level with one shared tile a row: softmax 32k
3355 against 3392, layer norm 32k 3130 / 3122, 16k 3341 / 3332; layer norm one-pass +0 / +1.4%
(32k / 16k), ``w``/``b`` in shared at 16k +2.6%, the ``WBS`` 2 probe +1.5% / +1.6% (their L2
traffic is not what bounds it), ``AHEAD`` 2-3 and the ``w``/``b`` ring slower (spills, one tile
in flight); 2048-column tiles, 1024 threads, two blocks an SM at 64 registers all slower. ncu
at 32k: DRAM 57-64% busy, L2 76-81%, 12-17 cycles a warp per issued instruction. Batch 2
(copy 4193): the refill again level or under (softmax 32k 3332 against 3394: the softmax
tutorial keeps one shared tile a row; layer norm 32k 3108 / 3130, 16k 3364 / 3322: its
tutorial takes the shorter ``kiln.load(via=, refill=)``); rows copied by TMA boxes no faster
(softmax 32k 3361, 16k 3427 / 3501 at 1 / 2 blocks an SM against 3579 a block a row; layer norm
32k 3091, 16k 3135, 3367 with ``w``/``b`` in shared), ncu the same DRAM share (60%): neither
the copy instruction nor the bytes in flight bound these rows. One-pass statistics +2.0% at
16k in both batches (3388 / 3388 against 3332 / 3322), level at 32k. Batch 3 (copy 4222):
layer norm tutorial (refill) 3348 / 3152 at 16k / 32k against 3316 / 3117.

Session 38 (H200, GB/s, the tutorials and Triton in the same run). Batch 1 (copy 4143): the
probes of ``softmax_ab`` at 512 x 32768 give the time a call takes: no stores 20.8 us (6463
GB/s counted as the full traffic), no loads 23.4 us (5735), neither 4.3 us, all of it 39.4 us
(3410): the two sides add up (20.8 + 23.4 - 4.3 = 39.9), a row's loads and stores do not
overlap. Issuing the next row's copies after each tile's store 2876, TMA-staged stores 3013, the
row after next prefetched into L2 (``cp.async.bulk.prefetch``, thread 0, a whole row) 3030 (its
load-only probe 6004 against 6463; layer norm 32k 2675 against 3141, 16k 3197 against 3356):
all slower than the tutorial (3417). Layer norm a block a row at 16k (64 registers, two blocks
an SM) 3300 against 3356; at 8k 40 registers (spilling) 2693, 256 threads at 80 registers 3519
against 3507; streamed at 8k two blocks an SM 3264. Batch 2 (copy 4207): the pipeline as the
tutorials' own streamed path (``kiln.load(via=, refill=, work=)``, since dropped) against
cabd4bb's tutorials: softmax 32k 3440 against 3401 (the same kernel as ``softmax_pipe`` 3391:
level), layer norm 32k 2685 against 3128 (44 bytes spilled; ``w``/``b`` at use instead of a
tile ahead, no spills: 2739), 16k 3308 against 3374 (at use 2981); at 8k / 16k the pipeline with
one or two blocks an SM 0.77-0.80 of copy against the tutorials' 0.83-0.89.
Batch 3 (copy 4189): the same one-block-an-SM stream with no math (``PROBE`` 4: x copied to y
through the shared tiles and registers) 3621 GB/s at 32k (0.86 of copy, 0.93 of the same-size
copy) and 3572 at 16k (0.85 / 0.91), against the softmax tutorial's 3389 / 3587 (``ab i0``
3393 / 3432): the stream itself nearly reaches copy; at 32k the reductions and ``exp``, with no
store in flight while they run, cost the other 6%.

Usage: ``python bench/tutorials_rows.py`` (it imports this module).
"""

from __future__ import annotations

import kiln
from kiln import f32, i32


def _row_tiles(t, row, n, chunk, parts, row_end=None):
    """Row ``row`` of ``t`` (``n`` columns) as ``parts`` tiles of ``1 x chunk``."""
    return [kiln.GlobalTile(t, (1, chunk), (row, c * chunk), row_end=row_end, col_end=n,
                            align=16, col_multiple=4) for c in range(parts)]


def _softmax_row(ts):
    """``exp(t - max)`` of a row's tiles ``ts`` and the reciprocal of their sum."""
    top = ts[0]
    for t in ts[1:]:
        top = kiln.maximum(top, t)
    mx = kiln.reduce(top, "max", axis=1)
    ps = [kiln.exp(t - mx) for t in ts]
    return ps, kiln.rcp(kiln.reduce(sum(ps[1:], ps[0]), "sum", axis=1))


@kiln.kernel(num_threads="THREADS")
def softmax_ab(x: kiln.Tensor[f32, 2], xv: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2],
               yv: kiln.Tensor[f32, 2],
               m: i32, n: i32, grid: i32, BLOCK: kiln.constexpr, CHUNK: kiln.constexpr,
               THREADS: kiln.constexpr, ISSUE: kiln.constexpr, PROBE: kiln.constexpr = 0,
               TSTORE: kiln.constexpr = 0):
    """The streamed softmax (rows through CHUNK-column shared tiles over a persistent grid)
    with the next row's copies issued before the reductions (``ISSUE`` 0, the tutorial's
    order), after the stores (1) or tile by tile after each tile's store (2). ``PROBE`` 1: no
    copies (the row is whatever shared memory holds: the store side alone); 2: no stores (one
    branch the grid never takes keeps the math: the load side alone); 3: neither; 4: the row
    stored as loaded, no math (a copy through the same stream). ``TSTORE``:
    each tile stored through a shared stage by one TMA box of ``yv`` (``y`` viewed as ``(m * n
    / 256, 256)``) instead of from registers. ``xv`` is unused (the A/B's signature)."""
    parts = BLOCK // CHUNK
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(parts)]
    stage = kiln.dynamic_shared((CHUNK,), f32, align=128) if TSTORE else None
    stage_row = kiln.SharedTile.view(stage, (1, CHUNK)) if TSTORE else None
    stage_box = kiln.SharedTile.view(stage, (CHUNK // 256, 256)) if TSTORE else None

    def tiles(t, row):
        return _row_tiles(t, row, n, CHUNK, parts)

    def fetch(row, c):
        if PROBE not in (1, 3):
            kiln.copy(tiles(x, row)[c], row_s[c])

    def put(p, row, c):
        if TSTORE:
            kiln.barrier()   # the stage's last TMA store has read it
            kiln.copy(p, stage_row)
            kiln.copy(stage_box, kiln.GlobalTile(yv, (CHUNK // 256, 256),
                                                 (row * (n // 256) + c * (CHUNK // 256), 0),
                                                 row_end=yv.shape[0], col_end=yv.shape[1],
                                                 align=16))
        else:
            kiln.copy(p, tiles(y, row)[c])

    for c in range(parts):
        fetch(kiln.block_id(0), c)
    for row in kiln.range(kiln.block_id(0), m, grid):
        kiln.barrier()
        ts = [kiln.where(kiln.tiles.mask(g, tv), kiln.load(s, tv), -float("inf"))
              for g, s in zip(tiles(x, row), row_s)]
        kiln.barrier()
        more = row + grid < m
        if ISSUE == 0:
            if more:
                for c in range(parts):
                    fetch(row + grid, c)
        ps, inv = ts, None
        if PROBE != 4:
            ps, inv = _softmax_row(ts)
        for c, p in enumerate(ps):
            if PROBE in (2, 3):
                if n < 0:
                    put(p * inv, row, c)
            elif PROBE == 4:   # the row as loaded, no math
                put(kiln.where(kiln.tiles.mask(tiles(x, row)[c], tv), ts[c], 0.0), row, c)
            else:
                put(p * inv, row, c)
            if ISSUE == 2:
                if more:
                    fetch(row + grid, c)
        if ISSUE == 1:
            if more:
                for c in range(parts):
                    fetch(row + grid, c)


@kiln.kernel(num_threads="THREADS")
def softmax_pipe(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                 BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr):
    """The streamed softmax as a three-stage software pipeline over a persistent grid: while
    row ``r``'s tiles are stored, row ``r + grid`` is read tile by tile from shared memory into
    the registers each store frees, and each shared tile is refilled with its piece of row ``r
    + 2 grid`` (one barrier a tile): the next row's copies are issued between this row's
    stores instead of after all of them, so DRAM has loads queued when the stores drain."""
    parts = BLOCK // CHUNK
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(parts)]

    def tiles(t, row, row_end=None):
        return _row_tiles(t, row, n, CHUNK, parts, row_end)

    def back(g, t):   # -inf past the row's end (the copy wrote zeros there)
        return kiln.where(kiln.tiles.mask(g, tv), t, -float("inf"))

    start = kiln.block_id(0)
    for c, g in enumerate(tiles(x, start)):
        kiln.copy(g, row_s[c])
    xs = [back(g, t) for g, t in zip(tiles(x, start), kiln.load(
        tiles(x, start), tv, via=row_s, refill=tiles(x, start + grid, m)))]
    for row in kiln.range(start, m, grid):
        ps, inv = _softmax_row(xs)
        here, after = tiles(x, row + grid, m), tiles(x, row + 2 * grid, m)
        nxt = []
        for c in range(parts):
            kiln.copy(ps[c] * inv, tiles(y, row)[c])
            kiln.barrier()   # tile c of the next row landed for all; tile c - 1 read by all
            if c:
                kiln.copy(after[c - 1], row_s[c - 1])
            nxt.append(back(here[c], kiln.load(row_s[c], tv)))
        kiln.barrier()
        kiln.copy(after[parts - 1], row_s[parts - 1])
        xs = nxt


@kiln.kernel(num_threads="THREADS")
def layernorm_pipe(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                   y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                   rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                   BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                   AHEAD: kiln.constexpr = 1):
    """The streamed layer norm as softmax_pipe's three-stage pipeline: row ``r + grid`` read
    tile by tile between row ``r``'s tile stores, each shared tile refilled with row ``r + 2
    grid``'s piece; ``w``/``b`` of tile ``c + 1`` loaded before tile ``c``'s store (``AHEAD``
    1) or each tile's just before its use (0: fewer registers)."""
    parts = BLOCK // CHUNK
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(parts)]
    inv_n = 1.0 / kiln.cast(n, f32)

    def tiles(t, row, row_end=None):
        return _row_tiles(t, row, n, CHUNK, parts, row_end)

    def weights(c):
        return [kiln.load(tiles(t, 0)[c], tv) for t in (w, b)] if c < parts else None

    start = kiln.block_id(0)
    for c, g in enumerate(tiles(x, start)):
        kiln.copy(g, row_s[c])
    xs = kiln.load(tiles(x, start), tv, via=row_s, refill=tiles(x, start + grid, m))
    for row in kiln.range(start, m, grid):
        mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
        xcs = [kiln.where(kiln.tiles.mask(g, tv), t - mean, 0.0)
               for g, t in zip(tiles(x, row, m), xs)]
        wb = [weights(0)] if AHEAD else []
        rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                      axis=1) * inv_n + eps)
        after = tiles(x, row + 2 * grid, m)
        nxt = []
        for c, xc in enumerate(xcs):
            wb.append(weights(c + AHEAD))
            gamma, beta = wb[c]
            kiln.copy(xc * rstd * gamma + beta, tiles(y, row)[c])
            kiln.barrier()   # tile c of the next row landed for all; tile c - 1 read by all
            if c:
                kiln.copy(after[c - 1], row_s[c - 1])
            nxt.append(kiln.load(row_s[c], tv))
        kiln.barrier()
        kiln.copy(after[parts - 1], row_s[parts - 1])
        if kiln.thread_id(0) == 0:
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()
        xs = nxt
