"""Parsers for ptxas -v output and AMD code-object notes, fed recorded tool output."""

import re
import subprocess

import numpy as np
import pytest

import kiln
from kiln.lowering.metadata import AMD_KEYS, parse_amd_notes, parse_ptxas_verbose
from kiln.lowering.tools import llvm_tool

# ptxas 13.0 -v for two kernels; the second spills, uses shared memory and has its WGMMAs
# serialised.
PTXAS_TWO_KERNELS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'saxpy' for 'sm_90a'
ptxas info    : Function properties for saxpy
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compiling entry function 'gemm' for 'sm_90a'
ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to non wgmma instructions defining input registers of a wgmma between start and end of the \
pipeline stage in the function 'gemm'
ptxas info    : Function properties for gemm
    48 bytes stack frame, 40 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 49152 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 2.711 ms
"""


def test_ptxas_kernel_without_shared_memory():
    assert parse_ptxas_verbose(PTXAS_TWO_KERNELS, "saxpy") == {
        "registers": 10, "spill_bytes": 0, "shared_bytes": 0, "stack_bytes": 0,
        "wgmma_serialized": None}


def test_ptxas_spills_add_stores_and_loads():
    assert parse_ptxas_verbose(PTXAS_TWO_KERNELS, "gemm") == {
        "registers": 255, "spill_bytes": 64, "shared_bytes": 49152, "stack_bytes": 48,
        "wgmma_serialized": "non wgmma instructions defining input registers of a wgmma between "
                            "start and end of the pipeline stage"}


def test_ptxas_unknown_kernel_gives_none():
    assert set(parse_ptxas_verbose(PTXAS_TWO_KERNELS, "other").values()) == {None}


# llvm-readelf --notes of a gfx950 object with two kernels (argument lists shortened).
AMD_NOTES = """\
Displaying notes found in: .note
  Owner                Data size 	Description
  AMDGPU               0x000003cf	NT_AMDGPU_METADATA (AMDGPU Metadata)
    AMDGPU Metadata:
        ---
amdhsa.kernels:
  - .agpr_count:     0
    .args:
      - .address_space:  global
        .name:           x
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
    .group_segment_fixed_size: 0
    .kernarg_segment_size: 88
    .name:           saxpy
    .private_segment_fixed_size: 0
    .sgpr_count:     22
    .vgpr_count:     4
    .wavefront_size: 64
  - .agpr_count:     32
    .args:
      - .name:           a
        .offset:         0
    .group_segment_fixed_size: 65536
    .name:           gemm
    .private_segment_fixed_size: 128
    .sgpr_count:     48
    .vgpr_count:     256
amdhsa.target:   amdgcn-amd-amdhsa--gfx950
amdhsa.version:
  - 1
  - 2
...
"""


def test_amd_notes_per_kernel():
    assert parse_amd_notes(AMD_NOTES, "saxpy") == {
        "vgpr_count": 4, "agpr_count": 0, "sgpr_count": 22, "scratch_bytes": 0, "lds_bytes": 0}
    assert parse_amd_notes(AMD_NOTES, "gemm") == {
        "vgpr_count": 256, "agpr_count": 32, "sgpr_count": 48, "scratch_bytes": 128,
        "lds_bytes": 65536}


def test_amd_argument_names_are_not_kernels():
    assert set(parse_amd_notes(AMD_NOTES, "x").values()) == {None}



@kiln.kernel(num_threads=64)
def scale_rows(x: kiln.Tensor[kiln.f32], y: kiln.Tensor[kiln.f32], n: kiln.i32):
    i = kiln.block_id(0) * 64 + kiln.thread_id(0)
    if i < n:
        y[i] = x[i] * 3.0


@pytest.mark.lower
def test_amd_metadata_comes_from_the_assembly_and_matches_the_object_notes(tmp_path):
    """The assembly's .amdgpu_metadata gives the resource keys without llvm-readelf (the GPU
    machine has none); where llvm-readelf exists, the object's notes agree."""
    x = np.ones(64, np.float32)
    ck = scale_rows.compile(x, x, 64, target="gfx950")
    found = {key: ck.metadata[key] for key in AMD_KEYS}
    assert all(isinstance(v, int) for v in found.values()), found
    assert found["vgpr_count"] > 0 and found["scratch_bytes"] == 0
    readelf = llvm_tool("llvm-readelf")
    if readelf is None or "obj" not in ck.asm:
        pytest.skip("no llvm-readelf to compare the object's notes with")
    obj = tmp_path / "kernel.o"
    obj.write_bytes(ck.asm["obj"])
    notes = subprocess.run([str(readelf), "--notes", str(obj)], capture_output=True,
                           text=True).stdout
    kernels = re.findall(r"^\s*\.name:\s*(\w+)\s*$", notes, re.M)
    assert parse_amd_notes(notes, kernels[-1]) == found
