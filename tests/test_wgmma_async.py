"""Descriptor-level WGMMA, dynamic shared memory and named barriers (the Hopper GEMM's ops)."""

import re

import numpy as np
import pytest

import kiln
from kiln import nvidia_asm, wgmma
from kiln.runtime.cuda import cuda_available, driver
from kiln.shared import DYNAMIC_BASE_ALIGN, dynamic_shared

# Descriptor of a K-major 128B-swizzled tile: LBO 16 B, SBO 1024 B, layout 1 (bits 62-63).
K_MAJOR_FIELDS = (1 << 16) | (64 << 32) | (1 << 62)


@kiln.kernel
def one_mma(out: kiln.Tensor[kiln.f32, 2], B_MAJOR: kiln.constexpr):
    a = dynamic_shared((64, 64), kiln.bf16, align=1024)
    b = dynamic_shared((64, 64), kiln.bf16, align=1024)
    a_desc = wgmma.smem_descriptor(a, leading_bytes=16, stride_bytes=1024)
    b_desc = wgmma.smem_descriptor(b, leading_bytes=8192, stride_bytes=1024, byte_offset=32)
    acc = wgmma.fragment_zeros(64)
    wgmma.fence()
    acc = wgmma.mma_async(acc, a_desc, b_desc, dtype=kiln.bf16, b_major=B_MAJOR)
    wgmma.commit()
    wgmma.wait_group(0)
    out[0, 0] = acc.element(31)


def _compile(b_major="mn"):
    out = np.full((64, 64), np.nan, np.float32)
    return one_mma.compile(out, B_MAJOR=b_major, target="sm_90a")


@pytest.mark.lower
@pytest.mark.parametrize("b_major, tnsp_b", [("mn", 1), ("k", 0)])
def test_mma_async_reaches_ptx_with_the_operand_majors(b_major, tnsp_b):
    ck = _compile(b_major)
    assert str(K_MAJOR_FIELDS) in ck.asm["kiln"]
    assert "nvvm.wgmma.mma_async" in ck.asm["kiln"]
    ptx = ck.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16[^;]*"
                     rf", 1,\s*1, 0,\s*{tnsp_b};", ptx, re.S)
    # Two 8 KB tiles plus the slack that lets the kernel round the base up to 1024 bytes.
    assert ck.signature.dynamic_shared_bytes == 2 * 8192 + DYNAMIC_BASE_ALIGN
    assert ck.metadata["spill_bytes"] == 0


@pytest.mark.lower
def test_dynamic_shared_views_one_region():
    ir_text = one_mma.trace(np.zeros((64, 64), np.float32), B_MAJOR="mn",
                            target="sm_90a").module_asm
    assert ir_text.count("gpu.dynamic_shared_memory") == 1
    assert ir_text.count("memref.view") == 2
    assert "#gpu.address_space<workgroup>" in ir_text


@kiln.kernel
def too_much_shared(out: kiln.Tensor[kiln.f32]):
    dynamic_shared((200 * 1024,), kiln.i8)
    dynamic_shared((64, 512), kiln.f32)  # @too-much


@kiln.kernel
def staged_store(out: kiln.Tensor[kiln.f32]):
    tiles = dynamic_shared((4, 64, 64), kiln.bf16, align=1024)
    acc = wgmma.fragment_zeros(256)
    wgmma.store_fragment_swizzled(acc, tiles, 0)
    nvidia_asm.named_barrier(1, 128)
    out[0] = kiln.cast(tiles[3, 63, 63], kiln.f32)  # a reader keeps the stores alive


@pytest.mark.lower
def test_dynamic_shared_over_the_limit_names_the_line(marker_line):
    with pytest.raises(kiln.ResourceError, match="dynamic_shared") as info:
        too_much_shared.trace(np.zeros(4, np.float32), target="sm_90a")
    assert info.value.loc.line == marker_line("@too-much")


@pytest.mark.lower
def test_swizzled_staging_and_named_barrier_compile():
    ck = staged_store.compile(np.zeros(4, np.float32), target="sm_90a")
    ptx = ck.asm["ptx"]
    assert re.search(r"bar\.sync %r\d+, %r\d+;", ptx)
    # 64 x 256 accumulator, 128 threads: 64 stores of two bf16 per thread.
    assert len(re.findall(r"st\.shared(\.v2)?\.b16|st\.shared\.b32", ptx)) == 64
    assert ck.metadata["spill_bytes"] == 0


@kiln.kernel
def bad_mma(out: kiln.Tensor[kiln.f32], WHAT: kiln.constexpr):
    acc = wgmma.fragment_zeros(64)
    a = dynamic_shared((64, 64), kiln.bf16, align=1024)
    desc = wgmma.smem_descriptor(a, leading_bytes=16, stride_bytes=1024)
    if WHAT == "dtype":
        wgmma.mma_async(acc, desc, desc, dtype=kiln.f32)
    elif WHAT == "major":
        wgmma.mma_async(acc, desc, desc, dtype=kiln.bf16, b_major="n")
    elif WHAT == "stride":
        wgmma.smem_descriptor(a, leading_bytes=8, stride_bytes=1024)
    elif WHAT == "staging":
        wgmma.store_fragment_swizzled(acc, dynamic_shared((2, 32, 64), kiln.bf16), 0)
    elif WHAT == "barrier":
        nvidia_asm.named_barrier(16, 128)


@pytest.mark.lower
@pytest.mark.parametrize("what, error, message", [
    ("dtype", kiln.UnsupportedError, "operand dtype f32"),
    ("major", kiln.KilnValueError, "b_major='n'"),
    ("stride", kiln.KilnValueError, "leading_bytes=8"),
    ("staging", kiln.KilnValueError, "staging tiles must be 64 x 64"),
    ("barrier", kiln.KilnValueError, "named barrier id 16"),
])
def test_bad_operands_raise_at_trace_time(what, error, message):
    with pytest.raises(error, match=re.escape(message)):
        bad_mma.trace(np.zeros(4, np.float32), WHAT=what, target="sm_90a")


@pytest.mark.lower
def test_wgmma_needs_sm90a():
    with pytest.raises(kiln.TargetError, match="WGMMA"):
        one_mma.trace(np.zeros((64, 64), np.float32), B_MAJOR="mn", target="sm_80")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and driver")
def test_multiprocessor_count():
    assert driver().multiprocessor_count() >= 1

