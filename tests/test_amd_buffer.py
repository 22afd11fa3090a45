"""AMD data movement and rocdl wrappers: buffer views, global->LDS DMA with async tokens,
s_waitcnt encoding, barriers, priorities and scheduling hints."""

import re

import numpy as np
import pytest

import kiln
from kiln import amd_asm, amd_buffer
from kiln.amd.sched import SchedMask, encode_waitcnt
from kiln.core.errors import KilnTypeError, KilnValueError, TargetError, UnsupportedError

rng = np.random.default_rng()


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """These kernels differ only in the Python callables they close over, which the compile
    cache key cannot see: compile each one afresh."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")


def test_waitcnt_encoding_matches_the_gfx9_bit_layout():
    for _ in range(200):
        vm, lgkm, exp = (int(rng.integers(0, 64)), int(rng.integers(0, 16)),
                         int(rng.integers(0, 8)))
        imm = encode_waitcnt(vmcnt=vm, lgkmcnt=lgkm, expcnt=exp)
        assert (imm & 0xF) | ((imm >> 14) & 0x3) << 4 == vm
        assert (imm >> 4) & 0x7 == exp and (imm >> 8) & 0xF == lgkm
        assert imm & 0x3000 == 0  # bits 13:12 are unused on GFX9
    assert encode_waitcnt() == 0xCF7F  # nothing waited on: every counter at its maximum
    assert encode_waitcnt(vmcnt=0) == 0x0F70 and encode_waitcnt(lgkmcnt=0) == 0xC07F
    for bad in ({"vmcnt": 64}, {"lgkmcnt": 16}, {"expcnt": -1}, {"vmcnt": True}):
        with pytest.raises(KilnValueError, match="out of range"):
            encode_waitcnt(**bad)


def _compile(body, chip="gfx950", warps=2, dtype=kiln.bf16):
    @kiln.kernel
    def movement(src: kiln.Tensor[dtype, 2], out: kiln.Tensor[dtype, 2], m: kiln.i32):
        tile = kiln.shared((64, 64), dtype)
        body(src, out, tile, m)

    args = (np.empty((2, 2), dtype.numpy), np.empty((2, 2), dtype.numpy), 1)
    return movement.compile(*args, target=chip, num_warps=warps)


def _two_dmas_then_wait(src, out, tile, m):
    lane = kiln.lane_id()
    view = amd_buffer.buffer(src, valid_bytes=m * 128)
    first = amd_buffer.copy_to_lds(view, (lane // 8, (lane % 8) * 8), tile, (0, 0), width=8)
    second = amd_buffer.copy_to_lds(src, (lane // 8 + 8, (lane % 8) * 8), tile, (8, 0),
                                    width=8)
    amd_asm.s_waitcnt(vmcnt=0, waits_for=[first, second])
    amd_asm.s_barrier()
    out.store(lane, 0, tile.load(lane % 16, 0, width=8))


@pytest.mark.lower
def test_dma_ops_carry_tokens_and_become_lds_loads():
    compiled = _compile(_two_dmas_then_wait)
    kiln_ir = compiled.asm["kiln"]
    assert "amdgpu.fat_raw_buffer_cast" in kiln_ir
    tokens = re.findall(r'amdgpu.gather_to_lds .*\{kiln.async = "vmcnt", kiln.token = (\d+)',
                        kiln_ir)
    assert tokens == ["0", "1"]
    assert "rocdl.s.waitcnt {kiln.waits_for = [0, 1]} 3952" in kiln_ir
    asm = compiled.asm["amdgcn"]
    assert re.search(r"buffer_load_dwordx4 .* lds", asm)  # from the buffer view
    assert "global_load_lds_dwordx4" in asm  # from the plain tensor
    assert re.search(r"s_waitcnt vmcnt\(0\)\s+s_barrier", asm)
    # Token numbers restart for every trace, so the IR (and the cache key) is deterministic.
    assert _compile(_two_dmas_then_wait).asm["kiln"] == kiln_ir


def _hints(src, out, tile, m):
    amd_asm.s_setprio(2)
    amd_asm.sched_barrier(SchedMask.VALU | SchedMask.SALU)
    amd_asm.sched_group_barrier(SchedMask.MFMA, 1, 0)
    amd_asm.sched_group_barrier(SchedMask.DS_READ, 2, 0)
    amd_asm.iglp_opt(1)
    amd_asm.s_waitcnt(lgkmcnt=3, expcnt=1)
    amd_asm.s_setprio(0)


@pytest.mark.lower
def test_hints_reach_the_assembly():
    compiled = _compile(_hints)
    kiln_ir = compiled.asm["kiln"]
    assert "rocdl.sched.barrier 6" in kiln_ir and "rocdl.iglp.opt 1" in kiln_ir
    llvm_ir = compiled.asm["llvm"]  # scheduling hints steer codegen and leave no instruction
    assert "call void @llvm.amdgcn.sched.group.barrier(i32 8, i32 1, i32 0)" in llvm_ir
    assert "call void @llvm.amdgcn.sched.group.barrier(i32 256, i32 2, i32 0)" in llvm_ir
    assert "call void @llvm.amdgcn.iglp.opt(i32 1)" in llvm_ir
    asm = compiled.asm["amdgcn"]
    assert "s_setprio 2" in asm and "s_setprio 0" in asm
    assert re.search(r"s_waitcnt expcnt\(1\) lgkmcnt\(3\)", asm)


@pytest.mark.lower
def test_buffer_loads_and_stores():
    def copy_row(src, out, tile, m):
        lane = kiln.lane_id()
        view, out_view = amd_buffer.buffer(src), amd_buffer.buffer(out)
        out_view.store(lane, 0, view.load(lane, 0, width=4))

    asm = _compile(copy_row).asm["amdgcn"]
    assert "buffer_load_dwordx2" in asm and "buffer_store_dwordx2" in asm
    assert "global_load" not in asm


@pytest.mark.lower
def test_misuse_is_rejected(marker_line):
    @kiln.kernel
    def wide_on_gfx942(src: kiln.Tensor[kiln.bf16, 2]):
        tile = kiln.shared((64, 64), kiln.bf16)
        amd_buffer.copy_to_lds(src, (0, 0), tile, (0, 0), width=8)  # @wide

    with pytest.raises(UnsupportedError, match=r"width=8 .* gfx942 DMA size") as err:
        wide_on_gfx942.trace(np.empty((2, 2), kiln.bf16.numpy), target="gfx942", num_warps=1)
    assert "use width=2" in str(err.value) and err.value.loc.line == marker_line("@wide")
    with pytest.raises(UnsupportedError, match="use width=2 or 8"):
        _compile(lambda s, o, t, m: amd_buffer.copy_to_lds(s, (0, 0), t, (0, 0), width=4))
    with pytest.raises(KilnTypeError, match="copy_to_lds writes LDS"):
        _compile(lambda s, o, t, m: amd_buffer.copy_to_lds(s, (0, 0), o, (0, 0), width=2))
    with pytest.raises(KilnTypeError, match="needs a global kiln.Tensor"):
        _compile(lambda s, o, t, m: amd_buffer.buffer(t))
    with pytest.raises(KilnValueError, match="s_setprio priority must be a Python int in 0..3"):
        _compile(lambda s, o, t, m: amd_asm.s_setprio(4))
    with pytest.raises(KilnTypeError, match="waits_for must hold AsyncTokens"):
        _compile(lambda s, o, t, m: amd_asm.s_waitcnt(vmcnt=0, waits_for=[1]))
    with pytest.raises(TargetError, match="AMD GFX9 instruction"):
        _compile(lambda s, o, t, m: amd_asm.s_barrier(), chip="sm_90a", warps=4)
