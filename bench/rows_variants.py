"""Variants of the softmax and layer-norm tutorials for bench/tutorials_rows.py's A/B.

- ``softmax_rows`` / ``layernorm_rows``: rows in registers over a persistent grid (``ROWS``
  rows a step; layer norm with ``WBS`` tiles of ``w``/``b`` copied into shared memory once).
- ``softmax_split`` / ``layernorm_split``: each row split over a thread-block cluster of
  ``SPLIT`` blocks, reduced through distributed shared memory (``kiln.reduce(...,
  cluster=True)``); layer norm with ``w``/``b`` loaded before or after the reductions, kept in
  shared memory (``WBS``), or shifted one-pass statistics (``ONEPASS``: one reduction of a tuple).

Measured on an H200 (2^24-element float32 matrices, same run): every split variant was slower
than the tutorials' streamed rows (softmax 512 x 32768: 0.60-0.72 of copy bandwidth against
0.84; layer norm 0.37-0.50 against 0.70), and the register rows slower than the tutorials at
4k and 8k columns (softmax 0.87 / 0.83 against 0.94 / 0.92).

Usage: ``python bench/tutorials_rows.py`` (it imports this module).
"""

from __future__ import annotations

import kiln
from kiln import f32, i32


@kiln.kernel(num_threads="THREADS")
def softmax_rows(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                 BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ROWS: kiln.constexpr,
                 ALIGN: kiln.constexpr):
    """Register rows, no shared stream: ``ROWS`` rows a step loaded with ``fill=-inf`` (no
    ``kiln.where``, no per-element column registers) over a persistent grid."""
    tv = kiln.layout.blocked((ROWS, BLOCK), THREADS, vec=4)
    for r0 in kiln.range(kiln.block_id(0) * ROWS, m, grid * ROWS):
        t = kiln.load(kiln.GlobalTile(x, (ROWS, BLOCK), (r0, 0), row_end=m, col_end=n,
                                      fill=-float("inf"), align=ALIGN,
                                      col_multiple=ALIGN // 4), tv)
        p = kiln.exp(t - kiln.reduce(t, "max", axis=1))
        p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1))
        kiln.copy(p, kiln.GlobalTile(y, (ROWS, BLOCK), (r0, 0), row_end=m, col_end=n,
                                     align=ALIGN, col_multiple=ALIGN // 4))


@kiln.kernel(num_threads="THREADS")
def layernorm_rows(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                   y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                   rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                   BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                   WBS: kiln.constexpr, ALIGN: kiln.constexpr):
    """Register rows over a persistent grid; the first ``WBS`` CHUNK-column tiles of ``w``
    and ``b`` are copied into shared memory once per block (the rest are read per row); the
    padding mask is taken per 16-byte chunk (``cols & ~3``: 1 register per chunk)."""
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    tiles = BLOCK // CHUNK
    inv_n = 1.0 / kiln.cast(n, f32)

    def row_tiles(t, row):
        return [kiln.GlobalTile(t, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN,
                                col_multiple=ALIGN // 4) for c in range(tiles)]

    wb_s = [[kiln.SharedTile((1, CHUNK), f32) for _ in range(WBS)] for _ in range(2)]
    for k, t in enumerate((w, b)):
        for c in range(WBS):
            kiln.copy(row_tiles(t, 0)[c], wb_s[k][c])
    kiln.barrier()
    _, cols = kiln.tiles.coords(tv)
    chunk_cols = cols.map(lambda c: c & -4) if ALIGN == 16 else cols
    for row in kiln.range(kiln.block_id(0), m, grid):
        xs = [kiln.load(g, tv) for g in row_tiles(x, row)]
        mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
        xcs = [kiln.where(chunk_cols + c * CHUNK < n, t - mean, 0.0) for c, t in enumerate(xs)]
        rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                      axis=1) * inv_n + eps)
        for c, xc in enumerate(xcs):
            if c < WBS:
                gamma, beta = kiln.load(wb_s[0][c], tv), kiln.load(wb_s[1][c], tv)
            else:
                gamma, beta = (kiln.load(t[c], tv) for t in (row_tiles(w, 0), row_tiles(b, 0)))
            kiln.copy(xc * rstd * gamma + beta, row_tiles(y, row)[c])
        if kiln.thread_id(0) == 0:
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()


@kiln.kernel(num_threads="THREADS")
def softmax_split(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                  BLOCK: kiln.constexpr, THREADS: kiln.constexpr, SPLIT: kiln.constexpr,
                  ALIGN: kiln.constexpr):
    """Each row split over a cluster of ``SPLIT`` CTAs (``BLOCK // SPLIT`` columns each, in
    registers, ``fill=-inf``), reduced across the cluster through distributed shared memory;
    clusters walk rows ``cluster, cluster + grid // SPLIT, ...``."""
    part = BLOCK // SPLIT
    first = kiln.cluster_rank(SPLIT) * part
    tv = kiln.layout.blocked((1, part), THREADS, vec=4)
    for row in kiln.range(kiln.block_id(0) // SPLIT, m, grid // SPLIT):
        t = kiln.load(kiln.GlobalTile(x, (1, part), (row, first), col_end=n,
                                      fill=-float("inf"), align=ALIGN,
                                      col_multiple=ALIGN // 4), tv)
        p = kiln.exp(t - kiln.reduce(t, "max", axis=1, cluster=True))
        p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1, cluster=True))
        kiln.copy(p, kiln.GlobalTile(y, (1, part), (row, first), col_end=n, align=ALIGN,
                                     col_multiple=ALIGN // 4))


@kiln.kernel(num_threads="THREADS")
def layernorm_split(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                    y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                    rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                    BLOCK: kiln.constexpr, THREADS: kiln.constexpr, SPLIT: kiln.constexpr,
                    WB_EARLY: kiln.constexpr, ALIGN: kiln.constexpr, WBS: kiln.constexpr = 0,
                    ONEPASS: kiln.constexpr = 0):
    """Each row split over a cluster of ``SPLIT`` CTAs (``BLOCK // SPLIT`` columns each, in
    registers), mean and variance reduced across the cluster; ``w``/``b`` loaded before the
    reductions (``WB_EARLY``) or after them, from shared memory where ``WBS`` (each block's
    slices copied there once: for persistent grids). ``ONEPASS``: the sums of ``d = x - x[row, 0]``
    and ``d * d`` in one reduction (one shared stage, one cluster exchange; shifted by the
    row's first element, so the variance ``E[d^2] - E[d]^2`` cancels little)."""
    part = BLOCK // SPLIT
    rank = kiln.cluster_rank(SPLIT)
    first = rank * part
    tv = kiln.layout.blocked((1, part), THREADS, vec=4)
    inv_n = 1.0 / kiln.cast(n, f32)

    def tile(t, row):
        return kiln.GlobalTile(t, (1, part), (row, first), col_end=n, align=ALIGN,
                               col_multiple=ALIGN // 4)

    wb_s = [kiln.SharedTile((1, part), f32) for _ in range(2)] if WBS else []
    for t, s in zip((w, b), wb_s):
        kiln.copy(tile(t, 0), s)
    if WBS:
        kiln.barrier()

    def weights():
        if WBS:
            return kiln.load(wb_s[0], tv), kiln.load(wb_s[1], tv)
        return kiln.load(tile(w, 0), tv), kiln.load(tile(b, 0), tv)

    for row in kiln.range(kiln.block_id(0) // SPLIT, m, grid // SPLIT):
        xt = kiln.load(tile(x, row), tv)
        if WB_EARLY:
            gamma, beta = weights()
        if ONEPASS:
            shift = x[row, 0]
            xc = kiln.where(kiln.tiles.mask(tile(x, row), tv), xt - shift, 0.0)
            s1, s2 = kiln.reduce((xc, xc * xc), "sum", axis=1, cluster=True)
            mean_d = s1 * inv_n
            rstd = kiln.rsqrt(s2 * inv_n - mean_d * mean_d + eps)
            mean = mean_d + shift
            xc = xc - mean_d
        else:
            mean = kiln.reduce(xt, "sum", axis=1, cluster=True) * inv_n
            xc = kiln.where(kiln.tiles.mask(tile(x, row), tv), xt - mean, 0.0)
            rstd = kiln.rsqrt(kiln.reduce(xc * xc, "sum", axis=1, cluster=True) * inv_n + eps)
        if not WB_EARLY:
            gamma, beta = weights()
        kiln.copy(xc * rstd * gamma + beta, tile(y, row))
        if (kiln.thread_id(0) == 0) & (rank == 0):
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()
