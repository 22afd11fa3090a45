"""Persistent variants of the softmax and layer-norm tutorials for bench/tutorials_rows.py's A/B:
block ``b`` of a ``grid``-block grid walks rows ``b, b + grid, ...``; the next row streams
into shared tiles (``kiln.copy`` global -> shared: cp.async / LDS DMA) while this row's
reductions and stores run from registers. ``layernorm_rows_masked`` loads ``w``/``b`` and
stores ``y`` with per-element masks at the ragged edge (no ``col_multiple`` promise).
``softmax_one_row`` / ``layernorm_one_row`` are the tutorials' earlier design (one block a row,
the row loaded straight into registers), the baseline.

Usage: ``python bench/tutorials_rows.py`` (it imports this module).
"""

from __future__ import annotations

import kiln
from kiln import f32, i32


@kiln.kernel(num_threads="THREADS")
def softmax_rows(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], m: i32, n: i32, grid: i32,
                   BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr):
    tv = kiln.layout.blocked((1, BLOCK), THREADS, vec=4)
    _, cols = kiln.tiles.coords(tv)
    row_s = kiln.SharedTile((1, BLOCK), f32)

    def fetch(row):   # asynchronous: cp.async / LDS DMA, waited for before row_s is read
        kiln.copy(kiln.GlobalTile(x, (1, BLOCK), (row, 0), col_end=n, align=ALIGN,
                                  col_multiple=ALIGN // 4), row_s)

    fetch(kiln.block_id(0))
    for row in kiln.range(kiln.block_id(0), m, grid):
        kiln.barrier()
        t = kiln.where(cols < n, kiln.load(row_s, tv), -float("inf"))
        kiln.barrier()   # every thread holds its part of the row: fetch the next one
        if row + grid < m:
            fetch(row + grid)
        p = kiln.exp(t - kiln.reduce(t, "max", axis=1))
        p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1))
        kiln.copy(p, kiln.GlobalTile(y, (1, BLOCK), (row, 0), col_end=n, align=ALIGN,
                                     col_multiple=ALIGN // 4))


@kiln.kernel(num_threads="THREADS")
def layernorm_rows(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                     y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                     rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                     BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                     ALIGN: kiln.constexpr):
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(BLOCK // CHUNK)]
    inv_n = 1.0 / kiln.cast(n, f32)

    def fetch(row):   # asynchronous: cp.async / LDS DMA, waited for before row_s is read
        for c in range(BLOCK // CHUNK):
            kiln.copy(kiln.GlobalTile(x, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN,
                                      col_multiple=ALIGN // 4), row_s[c])

    fetch(kiln.block_id(0))
    for row in kiln.range(kiln.block_id(0), m, grid):
        kiln.barrier()
        xs = [kiln.load(s, tv) for s in row_s]
        kiln.barrier()   # every thread holds its part of the row: fetch the next one
        if row + grid < m:
            fetch(row + grid)
        mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
        _, cols = kiln.tiles.coords(tv)
        xcs = [kiln.where(cols + c * CHUNK < n, t - mean, 0.0) for c, t in enumerate(xs)]
        rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                      axis=1) * inv_n + eps)
        for c, xc in enumerate(xcs):   # w and b a chunk at a time: fewer live registers
            gamma, beta = (kiln.load(kiln.GlobalTile(t, (1, CHUNK), (0, c * CHUNK), col_end=n,
                                                     align=ALIGN, col_multiple=ALIGN // 4), tv)
                           for t in (w, b))
            kiln.copy(xc * rstd * gamma + beta, kiln.GlobalTile(
                y, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN, col_multiple=ALIGN // 4))
        if kiln.thread_id(0) == 0:
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()


@kiln.kernel(num_threads="THREADS")
def layernorm_rows_masked(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                     y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                     rstd_out: kiln.Tensor[f32], m: i32, n: i32, grid: i32, eps: f32,
                     BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                     ALIGN: kiln.constexpr):
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    row_s = [kiln.SharedTile((1, CHUNK), f32) for _ in range(BLOCK // CHUNK)]
    inv_n = 1.0 / kiln.cast(n, f32)

    def fetch(row):   # asynchronous: cp.async / LDS DMA, waited for before row_s is read
        for c in range(BLOCK // CHUNK):
            kiln.copy(kiln.GlobalTile(x, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN,
                                      col_multiple=ALIGN // 4), row_s[c])

    fetch(kiln.block_id(0))
    for row in kiln.range(kiln.block_id(0), m, grid):
        kiln.barrier()
        xs = [kiln.load(s, tv) for s in row_s]
        kiln.barrier()   # every thread holds its part of the row: fetch the next one
        if row + grid < m:
            fetch(row + grid)
        mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
        _, cols = kiln.tiles.coords(tv)
        xcs = [kiln.where(cols + c * CHUNK < n, t - mean, 0.0) for c, t in enumerate(xs)]
        rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                      axis=1) * inv_n + eps)
        for c, xc in enumerate(xcs):   # w and b a chunk at a time: fewer live registers
            gamma, beta = (kiln.load(kiln.GlobalTile(t, (1, CHUNK), (0, c * CHUNK), col_end=n,
                                                     align=ALIGN), tv)
                           for t in (w, b))
            kiln.copy(xc * rstd * gamma + beta, kiln.GlobalTile(
                y, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN))
        if kiln.thread_id(0) == 0:
            mean_out[row] = mean.item()
            rstd_out[row] = rstd.item()


@kiln.kernel(num_threads="THREADS")
def softmax_one_row(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], n: i32,
                   BLOCK: kiln.constexpr, THREADS: kiln.constexpr, ALIGN: kiln.constexpr):
    row = kiln.block_id(0)
    tv = kiln.layout.blocked((1, BLOCK), THREADS, vec=4)
    t = kiln.load(kiln.GlobalTile(x, (1, BLOCK), (row, 0), col_end=n, fill=-float("inf"),
                                  align=ALIGN), tv)
    p = kiln.exp(t - kiln.reduce(t, "max", axis=1))
    p = p * kiln.rcp(kiln.reduce(p, "sum", axis=1))
    kiln.copy(p, kiln.GlobalTile(y, (1, BLOCK), (row, 0), col_end=n, align=ALIGN))


@kiln.kernel(num_threads="THREADS")
def layernorm_one_row(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32], b: kiln.Tensor[f32],
                     y: kiln.Tensor[f32, 2], mean_out: kiln.Tensor[f32],
                     rstd_out: kiln.Tensor[f32], n: i32, eps: f32,
                     BLOCK: kiln.constexpr, CHUNK: kiln.constexpr, THREADS: kiln.constexpr,
                     ALIGN: kiln.constexpr):
    row = kiln.block_id(0)
    tv = kiln.layout.blocked((1, CHUNK), THREADS, vec=4)
    _, cols = kiln.tiles.coords(tv)
    xs = [kiln.load(kiln.GlobalTile(x, (1, CHUNK), (row, c * CHUNK), col_end=n, align=ALIGN), tv)
          for c in range(BLOCK // CHUNK)]
    inv_n = 1.0 / kiln.cast(n, f32)
    mean = kiln.reduce(sum(xs[1:], xs[0]), "sum", axis=1) * inv_n
    xcs = [kiln.where(cols + c * CHUNK < n, t - mean, 0.0) for c, t in enumerate(xs)]
    rstd = kiln.rsqrt(kiln.reduce(sum((t * t for t in xcs[1:]), xcs[0] * xcs[0]), "sum",
                                  axis=1) * inv_n + eps)
    for c, xc in enumerate(xcs):   # w and b a chunk at a time: fewer live registers
        gamma = kiln.load(kiln.GlobalTile(w, (1, CHUNK), (0, c * CHUNK), col_end=n,
                                          align=ALIGN), tv)
        beta = kiln.load(kiln.GlobalTile(b, (1, CHUNK), (0, c * CHUNK), col_end=n,
                                         align=ALIGN), tv)
        kiln.copy(xc * rstd * gamma + beta, kiln.GlobalTile(y, (1, CHUNK), (row, c * CHUNK),
                                                            col_end=n, align=ALIGN))
    if kiln.thread_id(0) == 0:
        mean_out[row] = mean.item()
        rstd_out[row] = rstd.item()
