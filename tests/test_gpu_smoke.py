"""The Hopper TMA + mbarrier + WGMMA smoke kernel (examples/hopper_tma_wgmma_smoke.py):
traced and compiled for sm_90a everywhere, run against numpy on an H100 when one is present."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from gemm_reference import assert_matmul_close
from source_modules import load_example as load_example_module

import kiln
from kiln.runtime.cuda import cuda_available

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hopper_tma_wgmma_smoke.py"


def load_example():
    return load_example_module("hopper_tma_wgmma_smoke")


smoke = load_example()
INPUTS = smoke.reference_inputs(seed=1)


def on_hopper() -> bool:
    """True when device 0 has compute capability 9.x (sm_90a code runs only there)."""
    if not cuda_available():
        return False
    driver = ctypes.CDLL("libcuda.so.1")
    major = ctypes.c_int()
    compute_capability_major = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    driver.cuInit(0)
    driver.cuDeviceGetAttribute(ctypes.byref(major), compute_capability_major, 0)
    return major.value == 9


@pytest.mark.lit
def test_smoke_kernel_traces_to_nvgpu_and_nvvm_ops():
    text = smoke.tma_wgmma_smoke.trace(*INPUTS, target="sm_90a").module_asm
    assert "nvgpu.mbarrier.create" in text
    assert re.search(r"nvgpu.mbarrier.arrive.expect_tx .*%c16384", text)
    assert len(re.findall(r"nvgpu.tma.async.load .*swizzle_128b", text)) == 2
    # four k16 steps, A K-major ("row") and B MN-major ("row"), then one commit and wait
    issues = re.findall(r"nvvm.wgmma.mma_async .*A\[<bf16>, <one>, <row>\], "
                        r"B\[<bf16>, <one>, <row>\].* loc\((#loc\d+)\)", text)
    assert len(issues) == 4
    assert text.count("nvvm.wgmma.commit.group.sync.aligned") == 1
    assert "nvvm.wgmma.wait.group.sync.aligned 0" in text
    assert "nvgpu.warpgroup" not in text
    assert re.search(r"memref.global .*memref<64x64xbf16, 3>.*alignment = 1024", text)
    # the wrappers' ops carry the user's source line: the WGMMA op points at `wgmma.mma_async(`
    line = int(re.search(rf'^{issues[0]} = loc\("[^"]*hopper_tma_wgmma_smoke.py":(\d+):', text,
                         re.M).group(1))
    assert "wgmma.mma_async(" in EXAMPLE.read_text().splitlines()[line - 1]


@pytest.mark.lower
def test_smoke_kernel_ptx_has_tma_mbarrier_and_wgmma():
    compiled = smoke.tma_wgmma_smoke.compile(*INPUTS, target="sm_90a")
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    # K = 64 in m64n64k16 steps, both operands from shared-memory descriptors.
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", ptx)) == 4
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier", ptx)) == 2
    assert "mbarrier.arrive.expect_tx.shared.b64" in ptx
    assert re.search(r"mbarrier\.try_wait\.parity\.shared\.b64\s+\w+,\s*\[%r\d+\],\s*0,", ptx)
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)
    if "cubin" in compiled.asm:  # ptxas present: it accepted the PTX
        assert compiled.metadata["spill_bytes"] == 0
        assert compiled.metadata["shared_bytes"] >= 2 * 64 * 64 * 2  # both bf16 tiles


@pytest.mark.lower
@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_smoke_kernel_refuses_targets_without_wgmma(target):
    with pytest.raises(kiln.TargetError, match="sm_90"):
        smoke.tma_wgmma_smoke.trace(*INPUTS, target=target)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 (H100/H200) GPU and driver")
def test_smoke_kernel_matches_numpy():
    a, b, c = smoke.reference_inputs(seed=2)  # c is NaN-poisoned
    smoke.tma_wgmma_smoke[(1, 1, 1)](a, b, c, target="sm_90a", num_warps=4)
    assert not np.isnan(c).any(), "some outputs were never written"
    assert_matmul_close(c, a, b)
