"""Small kernels shared by the compile, GPU and interpreter tests (one definition each)."""

import numpy as np

import kiln
from kiln import bf16, f32, i32, i64
from kiln.layout import blocked


@kiln.kernel
def saxpy(x: kiln.Tensor[f32], y: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]


@kiln.struct
class RunningMax:
    m: f32
    total: f32

    def add(self, v):
        self.total = self.total + v
        if v > self.m:  # a traced if inside a struct method, updating a field
            self.m = v


@kiln.kernel
def row_stats(x: kiln.Tensor[f32, 2], out: kiln.Tensor[f32, 2], cols: i32):
    """Thread 0 scans the row into a struct; shared memory + barrier hand it to thread 1."""
    row = kiln.block_id(0)
    stage = kiln.shared((2,), f32)
    if kiln.thread_id(0) == 0:
        state = RunningMax(-float("inf"), 0.0)
        for c in kiln.range(cols):
            state.add(x[row, c])
        stage[0] = state.m
        stage[1] = state.total
    kiln.barrier()
    if kiln.thread_id(0) == 1:
        out[row, 0] = stage[0]
        out[row, 1] = stage[1]


@kiln.kernel
def scale_rows(x: kiln.Tensor[bf16, 2], out: kiln.Tensor[f32, 2], rows: i32, cols: i32):
    """out[r, c] = x[r, c] * (r + 1); x may be a strided (non-contiguous) view."""
    r = kiln.block_id(0)
    for c in kiln.range(kiln.thread_id(0), cols, kiln.block_dim(0)):
        out[r, c] = kiln.cast(x[r, c], f32) * kiln.cast(r + 1, f32)


@kiln.kernel
def split_sum(x: kiln.Tensor[f32, 1], partial: kiln.Tensor[f32, 1], tickets: kiln.Tensor[i32, 1],
              out: kiln.Tensor[f32, 1], n: i32, BLOCK: kiln.constexpr):
    """``out = [sum(x), max(x)]``. Every thread adds its element to its CTA's ``partial``
    (zeroed by the caller) and maxes it into ``out[1]`` (-inf); the last CTA to take a ticket
    adds the partials and resets the ticket counter for the next launch."""
    cta = kiln.block_id(0)
    i = cta * BLOCK + kiln.thread_id(0)
    last = kiln.shared((1,), i32)
    if i < n:
        partial.atomic_add(cta, x[i])
        out.atomic_max(1, x[i])
    kiln.barrier()
    if kiln.thread_id(0) == 0:
        kiln.fence("gpu")
        ticket = tickets.atomic_add(0, 1)
        last[0] = kiln.where(ticket == kiln.num_blocks(0) - 1, 1, 0)
    kiln.barrier()
    if (last[0] == 1) & (kiln.thread_id(0) == 0):
        kiln.fence("gpu")
        total = 0.0
        for c in kiln.range(kiln.num_blocks(0)):
            total = total + partial[c]
        out[0] = total
        tickets[0] = 0


@kiln.kernel
def take_tickets(counter: kiln.Tensor[i32, 1], tickets: kiln.Tensor[i32, 1],
                 swapped: kiln.Tensor[i32, 1], low: kiln.Tensor[f32, 1],
                 x: kiln.Tensor[f32, 1], n: i32, BLOCK: kiln.constexpr):
    """Each thread ``i < n`` takes a ticket (the counter's old value), swaps ``i`` into
    ``counter[1]`` (recording the value it replaced) and mins ``x[i]`` into ``low[0]``."""
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        tickets[i] = counter.atomic_add(0, 1)
        swapped[i] = counter.atomic_exchange(1, i)
        low.atomic_min(0, x[i])


@kiln.kernel
def sum_after_wait(x: kiln.Tensor[f32, 1], stored: kiln.Tensor[f32, 1],
                   counters: kiln.Tensor[i64, 1], out: kiln.Tensor[f32, 1]):
    """CTA ``c`` stores ``2 x[c]``, takes a ticket and waits (``kiln.nvidia_asm.wait_for_count``)
    until every CTA of the launch took one; then ``out[c]`` is the sum of what they all stored.
    The counter is never reset: each launch adds its number of CTAs."""
    cta = kiln.block_id(0)
    ctas = kiln.cast(kiln.num_blocks(0), i64)
    if kiln.thread_id(0) == 0:
        stored[cta] = x[cta] * 2.0
        kiln.fence("gpu")
        ticket = counters.atomic_add(0, 1)
        kiln.nvidia_asm.wait_for_count(counters, 0, target=ticket - ticket % ctas + ctas)  # @wait
        total = 0.0
        for c in kiln.range(kiln.num_blocks(0)):
            total = total + stored[c]
        out[cta] = total


def split_sum_problem(rng, n):
    """``(ctas, args, (sum, max))`` of ``split_sum`` over ``n`` random elements in blocks of
    128: the partials and ticket counter zeroed, ``out`` poisoned / -inf."""
    x = rng.standard_normal(n).astype(np.float32)
    ctas = -(-n // 128)
    args = (x, np.zeros(ctas, np.float32), np.zeros(1, np.int32),
            np.array([np.nan, -np.inf], np.float32))
    return ctas, args, (x.astype(np.float64).sum(), x.max())


def check_split_sum(args, expected):
    x, _, tickets, out = args
    bound = x.size * np.finfo(np.float32).eps * np.abs(x).sum()  # f32 sums, any order
    np.testing.assert_allclose(out[0], expected[0], rtol=0, atol=bound)
    assert out[1] == expected[1]
    assert tickets[0] == 0  # the last CTA reset the counter


def take_tickets_problem(rng, n):
    """Arguments of ``take_tickets`` for ``n`` threads (counter starting at 5, outputs -7)."""
    x = rng.standard_normal(n).astype(np.float32)
    return (np.array([5, -1], np.int32), np.full(n, -7, np.int32), np.full(n, -7, np.int32),
            np.array([np.inf], np.float32), x, n)


def check_take_tickets(args):
    counter, tickets, swapped, low, x, n = args
    np.testing.assert_array_equal(np.sort(tickets), 5 + np.arange(n))
    assert counter[0] == 5 + n
    # Every value swapped in is seen once, by the next swap or as the final value.
    np.testing.assert_array_equal(np.sort(np.append(swapped, counter[1])), np.arange(-1, n))
    assert low[0] == x.min()


@kiln.kernel(num_threads=128)
def two_stage_sum(x: kiln.Tensor[f32, 2], y: kiln.Tensor[f32, 2], rows: i32):
    """Sum of 32-row slabs of x, double-buffered: slab i + 1 is copied while slab i is read."""
    s = [kiln.SharedTile((32, 32), f32) for _ in range(2)]
    tv = blocked((32, 32), 128)

    def fetch(stage, r0):
        kiln.copy(kiln.GlobalTile(x, (32, 32), (r0, 0), row_end=rows, align=16), s[stage])

    acc = kiln.load(kiln.GlobalTile(y, (32, 32)), tv) * 0.0
    fetch(0, 0)
    for r0 in kiln.range(0, rows, 64):
        for stage in kiln.static_range(2):
            fetch(1 - stage, r0 + (stage + 1) * 32)
            kiln.barrier()
            acc = acc + kiln.load(s[stage], tv)
            kiln.barrier()
    kiln.copy(acc, kiln.GlobalTile(y, (32, 32)))
