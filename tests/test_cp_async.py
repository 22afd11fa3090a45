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
