"""Small kernels shared by the compile, GPU and interpreter tests (one definition each)."""

import kiln
from kiln import bf16, f32, i32


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
