"""Wait insertion and its proofs, from DSL kernels down to gfx950 assembly."""

import inspect

import numpy as np
import pytest
from mlir import ir
from mlir.dialects import arith, llvm, memref, rocdl

import kiln
from kiln import f32
from kiln.cluster import ClusterRecipe, cluster, manual_waits
from kiln.core.errors import WaitError
from kiln.lowering import isa_amdgpu
from kiln.passes.wait_analysis import decode_gfx9_waitcnt, encode_gfx9_waitcnt
from kiln.shared import dynamic_shared


def _pointer(value: ir.Value, space: int) -> ir.Value:
    """A raw pointer to a memref's data (how a user writes a DMA without Kiln's wrappers)."""
    address = memref.extract_aligned_pointer_as_index(value)
    as_int = arith.index_cast(ir.IntegerType.get_signless(64), address)
    return llvm.inttoptr(llvm.PointerType.get(space), as_int)


def dma_to_lds(src: kiln.TensorRef, dst) -> None:
    """One 4-byte global->LDS DMA per lane (``global_load_lds_dword``)."""
    rocdl.GlobalLoadLDSOp(_pointer(src.ir, 1), _pointer(dst.ir, 3), 4, 0, 0)


def wait_vmcnt(n: int) -> None:
    rocdl.s_waitcnt(encode_gfx9_waitcnt(vmcnt=n))


@kiln.kernel
def dma_then_read(x: kiln.Tensor[f32], y: kiln.Tensor[f32], MANUAL: kiln.constexpr):
    if MANUAL:
        manual_waits()
    tile = kiln.shared((128,), f32)
    other = kiln.shared((128,), f32)
    i = kiln.thread_id(0)
    dma_to_lds(x, tile)
    dma_to_lds(y, other)
    rocdl.s_barrier()      # a bare s_barrier: gpu.barrier's fences would drain every counter
    y[i] = tile[i] * 2.0   # READ_LINE


READ_LINE = next(n for n, line in enumerate(inspect.getsource(inspect.getmodule(dma_then_read)).splitlines(), 1)
                 if line.rstrip().endswith("# READ_LINE"))
ARGS = (np.random.rand(128).astype(np.float32), np.random.rand(128).astype(np.float32))


def _lines(asm: str, prefixes: tuple) -> list[str]:
    return [line.strip() for line in asm.splitlines() if line.strip().startswith(prefixes)]


def test_gfx9_waitcnt_encoding_round_trips():
    rng = np.random.default_rng()
    for vm, exp, lgkm in zip(rng.integers(0, 64, 20), rng.integers(0, 8, 20), rng.integers(0, 16, 20)):
        imm = encode_gfx9_waitcnt(vmcnt=int(vm), expcnt=int(exp), lgkmcnt=int(lgkm))
        assert decode_gfx9_waitcnt(imm) == {"vmcnt": vm, "expcnt": exp, "lgkmcnt": lgkm}
    assert encode_gfx9_waitcnt(vmcnt=0) == 0x0F70  # what LLVM prints as s_waitcnt vmcnt(0)


@pytest.mark.lower
def test_dma_read_gets_the_fewest_wait_before_the_barrier():
    ck = dma_then_read.compile(*ARGS, MANUAL=False, target="gfx950", num_warps=2)
    # Only the DMA into `tile` must land: one younger DMA may stay in flight, and the wait
    # goes before the barrier so the other wave's DMA is visible after it.
    assert "rocdl.s.waitcnt 3953" in ck.asm["gpu"]
    ops = _lines(ck.asm["amdgcn"], ("global_load_lds", "s_waitcnt vmcnt", "s_barrier", "ds_read"))
    assert [op.split()[0] for op in ops] == ["global_load_lds_dword", "global_load_lds_dword",
                                             "s_waitcnt", "s_barrier", "ds_read_b32"]
    assert ops[2] == "s_waitcnt vmcnt(1)"


@pytest.mark.lower
def test_planted_missing_wait_is_rejected_at_the_read_line():
    with pytest.raises(WaitError) as caught:
        dma_then_read.compile(*ARGS, MANUAL=True, target="gfx950", num_warps=2)
    assert caught.value.loc.line == READ_LINE
    assert "rocdl.global.load.lds" in caught.value.message and "vmcnt=1" in caught.value.fix


@kiln.kernel
def dma_to_dynamic_then_read_static(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
    ring = dynamic_shared((128,), f32)
    tile = kiln.shared((128,), f32)
    i = kiln.thread_id(0)
    tile[i] = y[i]
    rocdl.s_barrier()
    dma_to_lds(x, ring)
    y[i] = tile[(i + 1) % 128] * 2.0  # the DMA writes only dynamic shared memory
    rocdl.s_barrier()
    y[i + 128] = ring[(i + 1) % 128]


@pytest.mark.lower
def test_a_dma_into_dynamic_shared_memory_leaves_static_buffers_unwaited():
    # A static kiln.shared buffer is not part of the dynamic shared memory an async copy (a DMA
    # here, a TMA ring on NVIDIA) writes: its read needs no wait; the ring's read does, and
    # its wait goes before the barrier that publishes the other waves' copies.
    x, y = np.random.rand(128).astype(np.float32), np.random.rand(256).astype(np.float32)
    ck = dma_to_dynamic_then_read_static.compile(x, y, target="gfx950", num_warps=2)
    ops = [line.strip() for line in ck.asm["gpu"].splitlines()
           if "rocdl.s.waitcnt" in line or "rocdl.s.barrier" in line or
           ("memref.load" in line and (line.endswith(", 3>") or "workgroup" in line))]
    kinds = ["wait" if "waitcnt" in op else "barrier" if "barrier" in op else
             "static" if op.endswith(", 3>") else "dynamic" for op in ops]
    assert kinds == ["barrier", "static", "wait", "barrier", "dynamic"], ops


@kiln.kernel
def clustered(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    with cluster(0, ClusterRecipe(work=(("vmem_read", 2),), priority=2)):
        a = x[i]
        b = x[i + 64]
    with cluster(1, ClusterRecipe(work=(("valu", 1), ("vmem_write", 1)), barrier_at_end=False)):
        y[i] = a * b


@pytest.mark.lower
def test_clusters_reach_the_assembly_with_setprio_barrier_and_live_registers():
    ck = clustered.compile(*ARGS, target="gfx950", num_warps=2)
    program = isa_amdgpu.parse(ck.asm["amdgcn"], "clustered")
    instances = isa_amdgpu.cluster_instances(program)
    assert [m.cluster for m, _ in instances] == [0, 1]
    first = [ins.mnemonic for ins in instances[0][1]]
    assert first.index("s_setprio") < first.index("global_load_dword")
    assert first[-2:] == ["s_setprio", "s_barrier"]
    assert isa_amdgpu.class_counts(instances[0][1])["vmem_read"] == 2
    assert "s_barrier" not in [ins.mnemonic for ins in instances[1][1]]
    assert set(ck.metadata["cluster_live_vgprs"]) == {"c0", "c1"}
    assert ck.metadata["cluster_live_vgprs"]["c1"] >= 2  # both loaded values are live


def test_isa_verifier_finds_a_read_before_its_wait():
    asm = "\n".join(["k:", "global_load_dword v1, v0, s[0:1]", "global_load_dword v2, v0, s[2:3]",
                     "s_waitcnt vmcnt(1)", "v_add_f32_e32 v3, v1, v1", "v_add_f32_e32 v3, v2, v3",
                     "s_endpgm"])
    with pytest.raises(WaitError, match="v_add_f32_e32 v3, v2, v3"):
        isa_amdgpu.verify_waits(isa_amdgpu.parse(asm, "k"), "k")
    fixed = asm.replace("v_add_f32_e32 v3, v2", "s_waitcnt vmcnt(0)\nv_add_f32_e32 v3, v2")
    isa_amdgpu.verify_waits(isa_amdgpu.parse(fixed, "k"), "k")


def test_isa_verifier_joins_paths_at_a_loop_header():
    asm = "\n".join(["k:", ".LBB0_1:", "v_add_f32_e32 v4, v1, v4", "global_load_dword v1, v0, s[0:1]",
                     "s_cbranch_scc1 .LBB0_1", "s_waitcnt vmcnt(0)", "s_endpgm"])
    with pytest.raises(WaitError, match="v_add_f32_e32 v4, v1, v4"):  # the back-edge brings v1 in flight
        isa_amdgpu.verify_waits(isa_amdgpu.parse(asm, "k"), "k")


# Excerpt of LLVM's gfx950 code for the lazy-rescale cadence (test_attention_softmax): exp2 is a
# call to __ocml_exp2_f32, and kernel arguments reloaded after the rescale branch are read
# ~480 instructions later, after calls, with no s_waitcnt of their own.
RELOAD_ACROSS_CALL = """run:
\ts_load_dwordx2 s[80:81], s[0:1], 0x0
\ts_waitcnt lgkmcnt(0)
\ts_cmp_eq_u32 s2, 0
\ts_cbranch_scc1 .LBB0_2
\ts_swappc_b64 s[30:31], s[80:81]
\ts_branch .LBB0_3
.LBB0_2:
\tv_mov_b32_e32 v42, 1.0
.LBB0_3:
\ts_load_dwordx4 s[68:71], s[48:49], 0x58
\tv_mov_b32_e32 v0, v44
\ts_swappc_b64 s[30:31], s[80:81]
\tv_mov_b32_e32 v44, v0
\ts_lshl_b64 s[0:1], s[70:71], 2
\ts_endpgm
"""


def test_isa_verifier_counts_a_call_as_a_full_wait():
    """The callee opens with s_waitcnt 0 (LLVM's SIInsertWaitcnts for every non-kernel
    function), so loads issued before a call are retired after it; before it they are not."""
    isa_amdgpu.verify_waits(isa_amdgpu.parse(RELOAD_ACROSS_CALL, "run"), "run")
    read_first = RELOAD_ACROSS_CALL.replace("\ts_lshl_b64 s[0:1], s[70:71], 2\n", "").replace(
        "\tv_mov_b32_e32 v0, v44\n", "\tv_mov_b32_e32 v0, v44\n\ts_lshl_b64 s[0:1], s[70:71], 2\n")
    with pytest.raises(WaitError, match=r"s_lshl_b64 s\[0:1\], s\[70:71\]"):
        isa_amdgpu.verify_waits(isa_amdgpu.parse(read_first, "run"), "run")
    unloaded_target = RELOAD_ACROSS_CALL.replace("\ts_waitcnt lgkmcnt(0)\n", "")
    with pytest.raises(WaitError, match=r"s_swappc_b64 s\[30:31\], s\[80:81\]"):
        isa_amdgpu.verify_waits(isa_amdgpu.parse(unloaded_target, "run"), "run")


WGMMA_UNCOMMITTED = """
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @uncommitted(%a: i64, %b: i64, %acc: !llvm.struct<(f32, f32, f32, f32)>, %out: memref<1xf32, 1>) kernel attributes {kiln.target = "sm_90a"} {
      %c0 = arith.constant 0 : index
      %d0 = nvvm.wgmma.mma_async %a, %b, %acc, <m = 64, n = 8, k = 16>, D[<f32>, <one>], A[<bf16>, <one>, <row>], B[<bf16>, <one>, <row>] : !llvm.struct<(f32, f32, f32, f32)> -> !llvm.struct<(f32, f32, f32, f32)>
      %x = llvm.extractvalue %d0[0] : !llvm.struct<(f32, f32, f32, f32)>
      memref.store %x, %out[%c0] : memref<1xf32, 1>
      gpu.return
    }
  }
}
"""


@pytest.mark.parametrize("pass_name", ["kiln-insert-waits", "kiln-verify-waits"])
def test_reading_an_uncommitted_wgmma_result_asks_for_a_commit(pass_name):
    from kiln.core.errors import WaitError
    from kiln.passes import build_pass_manager

    with ir.Context():
        module = ir.Module.parse(WGMMA_UNCOMMITTED)
        with pytest.raises(WaitError, match="commit"):
            build_pass_manager([pass_name]).run(module.operation)


@kiln.kernel
def scaled_copy(x: kiln.Tensor[f32], y: kiln.Tensor[f32]):
    i = kiln.thread_id(0)
    v = x[i]
    y[i] = v * 3.0  # ASM_READ_LINE: the multiply reads the loaded register


@pytest.mark.lower
def test_assembly_gap_is_reported_at_the_python_line_of_the_read():
    """The AMD assembly carries line tables (.loc), so a wait missing from the final ISA is a
    WaitError at the user's line that reads the loaded value, not at a cluster boundary."""
    from kiln.lowering import isa_amdgpu

    asm = scaled_copy.compile(np.zeros(64, np.float32), np.zeros(64, np.float32),
                              target="gfx950", num_warps=2).asm["amdgcn"]
    isa_amdgpu.verify_waits(isa_amdgpu.parse(asm), "scaled_copy")  # the real ISA is covered
    planted = "\n".join(line for line in asm.splitlines() if "s_waitcnt vmcnt" not in line)
    with pytest.raises(WaitError) as caught:
        isa_amdgpu.verify_waits(isa_amdgpu.parse(planted), "scaled_copy")
    read_line = next(n for n, text in enumerate(open(__file__), 1) if "ASM_READ_LINE" in text
                     and "next(" not in text)
    assert caught.value.loc.line == read_line


@pytest.mark.lower
def test_clustered_kernel_is_code_generated_once_per_artifact(monkeypatch):
    """The verbose assembly (with cluster markers) is the amdgcn stage itself: one assembly
    emission and one object emission (in a second process, else here), not a second assembly
    for the checks."""
    from kiln.lowering import amd

    import llvmlite.binding as llvmlite

    llvmlite.initialize_all_targets()
    llvmlite.initialize_all_asmprinters()
    emitted = []
    machine_class = type(llvmlite.Target.from_triple("amdgcn-amd-amdhsa")
                         .create_target_machine(cpu="gfx950"))
    for method in ("emit_assembly", "emit_object"):
        real = getattr(machine_class, method)
        monkeypatch.setattr(machine_class, method,
                            lambda self, module, _real=real, _name=method:
                            emitted.append(_name) or _real(self, module))
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setattr(amd, "_OBJECT_PROCESS_BYTES", 0)  # a small kernel: start one anyway
    ck = type(clustered)(clustered.fn).compile(*ARGS, target="gfx950", num_warps=2)
    assert emitted == ["emit_assembly"]
    assert "amdgcn.object" in [step for step, _, _ in ck.metadata["compile_profile"]]
    assert "sched_group_barrier" in ck.asm["amdgcn"]  # the markers need the verbose text
    monkeypatch.setattr(amd, "_start_object_process", lambda state, work: None)
    emitted.clear()
    here = type(clustered)(clustered.fn).compile(*ARGS, target="gfx950", num_warps=2)
    assert emitted == ["emit_assembly", "emit_object"]
    assert here.asm["obj"] == ck.asm["obj"]
