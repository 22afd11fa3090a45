"""kiln.cp_async: the nvgpu async-copy ops it emits, zero fill for masked rows, PTX, errors."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
import kiln.cp_async as cp_async
import kiln.tiles as tiles


def ragged_copy_kernel(width):
    @kiln.kernel
    def k(x: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16], rows: kiln.i32):
        s = tiles.SharedTile((16, 64), kiln.bf16)
        src = tiles.GlobalTile(x, (16, 64), (kiln.block_id(0) * 16, 0), row_end=rows)
        r = kiln.thread_id(0) % 16
        group = cp_async.commit([cp_async.copy(s, (r, 0), src, (r, 0), width=width)])
        cp_async.wait(group)
        kiln.barrier()
        out.store(0, s.load(r, 0, width=8))

    return k


ARGS = (np.ones((40, 64), kiln.bf16.numpy), np.zeros(8, kiln.bf16.numpy), 40)


def test_copy_emits_async_copy_with_zero_fill():
    text = ragged_copy_kernel(8).trace(*ARGS, target="sm_80").module_asm
    assert "nvgpu.device_async_copy" in text and "bypassL1" in text
    assert "nvgpu.device_async_create_group" in text
    assert "numGroups = 0 : i32" in text
    # masked rows copy 0 source elements (zero fill); their address is left as is (cp.async
    # with src-size 0 reads nothing), so one select: the source size
    assert text.count("arith.select") == 1


def test_small_copies_do_not_bypass_l1():
    text = ragged_copy_kernel(4).trace(*ARGS, target="sm_80").module_asm
    assert "nvgpu.device_async_copy" in text and "bypassL1" not in text


@pytest.mark.lower
def test_copy_ptx():
    ptx = ragged_copy_kernel(8).compile(*ARGS, target="sm_80").asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx
    assert "cp.async.commit_group" in ptx and "cp.async.wait_group" in ptx


def test_copy_errors():
    with pytest.raises(kiln.KilnValueError, match="4, 8 or 16 bytes"):
        ragged_copy_kernel(3).trace(*ARGS, target="sm_80")
    with pytest.raises(kiln.TargetError, match="sm_80 or newer"):
        ragged_copy_kernel(8).trace(*ARGS, target="gfx950")


def chunked_copy_kernel(col_multiple):
    @kiln.kernel
    def k(x: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16, 2], rows: kiln.i32,
          cols: kiln.i32):
        """Thread t copies row t of a (32, 32) tile in 8-element chunks: masked rows and
        columns (past ``rows``, ``cols``) land as zeros."""
        t = kiln.thread_id(0)
        s = tiles.SharedTile((32, 32), kiln.bf16)
        g = tiles.GlobalTile(x, (32, 32), (0, 0), row_end=rows, col_end=cols,
                             col_multiple=col_multiple)
        group = cp_async.commit([cp_async.copy(s, (t, c), g, (t, c), width=8)
                                 for c in range(0, 32, 8)])
        cp_async.wait(group)
        for c in range(0, 32, 8):
            out.store(t, c, s.load(t, c, width=8))

    return k


def test_whole_chunks_copy_a_constant_source_size():
    """col_multiple=8: the source size is 0 or 8 elements (no min/max of the remaining
    columns), which ptxas issues as a predicated cp.async instead of a partial zero fill."""
    args = (np.ones((20, 24), kiln.bf16.numpy), np.zeros((32, 32), kiln.bf16.numpy), 20, 24)
    whole = chunked_copy_kernel(8).trace(*args, target="sm_80").module_asm
    partial = chunked_copy_kernel(1).trace(*args, target="sm_80").module_asm
    assert "arith.minsi" not in whole and "arith.minsi" in partial


@pytest.mark.parametrize("col_multiple", [1, 8])
def test_masked_chunks_zero_fill_in_the_interpreter(col_multiple):
    rng = np.random.default_rng()
    rows, cols = 19, 16 if col_multiple == 8 else 21
    x = rng.standard_normal((rows, 24)).astype(kiln.bf16.numpy)
    out = np.full((32, 32), np.nan, np.float32).astype(kiln.bf16.numpy)
    chunked_copy_kernel(col_multiple).interpret[(1,)](x, out, rows, cols, num_warps=1,
                                                      target="sm_80")
    want = np.zeros((32, 32), np.float32)
    want[:rows, :cols] = x[:, :cols].astype(np.float32)
    np.testing.assert_array_equal(out.astype(np.float32), want)


def test_col_multiple_errors():
    with pytest.raises(kiln.KilnValueError, match="col_multiple must be a positive int"):
        chunked_copy_kernel(0).trace(np.ones((20, 24), kiln.bf16.numpy),
                                     np.zeros((32, 32), kiln.bf16.numpy), 20, 24, target="sm_80")
