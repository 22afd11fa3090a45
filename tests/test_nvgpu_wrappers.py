"""Kiln's NVGPU wrappers (kiln.mbarrier, kiln.tma, kiln.wgmma, kiln.nvidia_asm) inside a
hand-built gpu.func: the ops they emit, the errors they raise, and PTX for the instructions."""

from __future__ import annotations

import contextlib
import re

import pytest
from mlir import ir, passmanager
from mlir.dialects import arith, gpu, llvm, memref

import kiln
from kiln import mbarrier, nvidia_asm, tma, wgmma
from kiln.signature import TensorMapParam

pytestmark = pytest.mark.lower  # builds IR and lowers it to PTX in-process; no GPU

SHARED = 3
GLOBAL = 1


def memref_type(shape, dtype, space, *, dynamic_rows=False):
    space_attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), space)
    if not dynamic_rows:
        return ir.MemRefType.get(list(shape), dtype.mlir_type(), memory_space=space_attr)
    dyn = ir.ShapedType.get_dynamic_size()
    return ir.MemRefType.get([dyn, dyn], dtype.mlir_type(), memory_space=space_attr,
                             layout=ir.StridedLayoutAttr.get(dyn, [dyn, 1]))


class Kernel:
    """A gpu.func under construction: ``args`` are its block arguments, ``text`` the module."""

    def __init__(self, module, args):
        self.module, self.args = module, args

    @property
    def text(self) -> str:
        return str(self.module)

    def ptx(self) -> str:
        with self.module.context:
            return re.sub(r"[ \t]+", " ", self._lower())  # PTX separates operands with tabs

    def _lower(self) -> str:
        pm = passmanager.PassManager.parse(
            "builtin.module(gpu-lower-to-nvvm-pipeline{cubin-chip=sm_90a cubin-features=+ptx80 "
            "cubin-format=isa})")
        pm.run(self.module.operation)
        for op in self.module.body.operations:
            if op.operation.name == "gpu.binary":
                return gpu.ObjectAttr(op.operation.attributes["objects"][0]).object.decode()
        raise AssertionError("no gpu.binary")


@contextlib.contextmanager
def kernel(*arg_types_fn, target="sm_90a"):
    """Build ``gpu.func @k(args)`` for ``target``; the body is the ``with`` block."""
    with ir.Context(), ir.Location.unknown(), nvidia_asm.compiling_for(target):
        module = ir.Module.create()
        module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(module.body):
            kernels = gpu.GPUModuleOp("kiln_kernels")
        body = kernels.bodyRegion.blocks.append()
        arg_types = [make() for make in arg_types_fn]
        with ir.InsertionPoint(body):
            func_type = ir.FunctionType.get(arg_types, [])
            fn = gpu.GPUFuncOp(ir.TypeAttr.get(func_type), sym_name="k", kernel=True)
            fn.attributes["known_block_size"] = ir.DenseI32ArrayAttr.get([128, 1, 1])
        entry = fn.body.blocks.append(*arg_types)
        k = Kernel(module, list(entry.arguments))
        with ir.InsertionPoint(entry):
            yield k
            gpu.return_([])
        module.operation.verify()


def shared_tile(shape=(64, 64), dtype=kiln.bf16):
    return lambda: memref_type(shape, dtype, SHARED)


def global_matrix(dtype=kiln.f32):
    return lambda: memref_type(None, dtype, GLOBAL, dynamic_rows=True)


def pointer():
    return llvm.PointerType.get()


def tid_is_zero():
    tid = gpu.thread_id(gpu.Dimension.x)
    return arith.cmpi(arith.CmpIPredicate.eq, tid, arith.constant(ir.IndexType.get(), 0))


# --- mbarrier ---------------------------------------------------------------------------------

def test_mbarrier_group_ops_and_ptx():
    with kernel() as k:
        bars = mbarrier.group(num_barriers=2)
        leader = tid_is_zero()
        bars.init(1, count=1, predicate=leader)
        bars.arrive_expect_tx(1, 4096, predicate=leader)
        bars.arrive(0)
        bars.try_wait(1, phase=1)
    text = k.text
    assert "num_barriers = 2" in text
    assert re.search(r"nvgpu.mbarrier.init %\w+\[%c1\w*\], %c1\w*, predicate", text)
    assert re.search(r"nvgpu.mbarrier.arrive.expect_tx %\w+\[%c1\w*\], %c4096", text)
    assert "nvgpu.mbarrier.try_wait.parity" in text and "%true" in text
    ptx = k.ptx()
    assert "mbarrier.init.shared.b64" in ptx
    assert "mbarrier.arrive.expect_tx.shared.b64" in ptx
    assert re.search(r"mbarrier.try_wait.parity.shared.b64 \w+, \[%r\d+\], 1,", ptx)


def test_release_arrive_declares_wgmma_pending():
    """``wgmma_pending=N`` is stamped on the arrive op itself (what kiln-verify-waits reads);
    a plain arrive carries nothing."""
    with kernel() as k:
        bars = mbarrier.group(num_barriers=2)
        bars.arrive(0)
        bars.arrive(1, wgmma_pending=1)
        bars.arrive_cluster(1, 0, wgmma_pending=0)
    text = k.text
    assert len(re.findall(r"nvgpu.mbarrier.arrive %\S+\[%\S+\] :", text)) == 1
    assert re.search(r"nvgpu.mbarrier.arrive %\S+\[%\S+\] \{kiln.wgmma_pending = 1 : i64\}", text)
    assert re.search(r"nvvm.mbarrier.arrive %\S+ \{kiln.wgmma_pending = 0 : i64\}", text)


def test_phase_tracker_python_iterations():
    with kernel():
        ring = mbarrier.PhaseTracker(mbarrier.group(num_barriers=2))
        slots = [ring.slot(n) for n in range(6)]
    assert slots == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (1, 0)]


def test_phase_tracker_traced_iteration_computes_index_and_parity():
    with kernel(lambda: ir.IndexType.get()) as k:
        ring = mbarrier.PhaseTracker(mbarrier.group(num_barriers=3))
        ring.wait(k.args[0])
    text = k.text
    assert re.search(r"arith.remui %arg0, %c3", text)
    assert re.search(r"arith.divui %arg0, %c3", text)
    assert "arith.trunci" in text
    wait = re.search(r"nvgpu.mbarrier.try_wait.parity %\w+\[(%\S+)\], (%\S+),", text)
    assert wait and not wait.group(2).startswith("%false")


@pytest.mark.parametrize("build, message", [
    (lambda: mbarrier.group(num_barriers=0), "num_barriers"),
    (lambda: mbarrier.group(1).init(1, count=1), "out of range"),
    (lambda: mbarrier.group(1).init(0, count=0), "arrival count"),
    (lambda: mbarrier.group(1).try_wait(0, phase=2), "parity must be 0 or 1"),
    (lambda: mbarrier.group(1).arrive_expect_tx(0, 1 << 20), "transaction count"),
    (lambda: mbarrier.group(1).arrive(0, wgmma_pending=8), "wgmma_pending must be"),
    (lambda: mbarrier.group(1).arrive_cluster(0, 0, wgmma_pending=True), "wgmma_pending must be"),
    (lambda: mbarrier.PhaseTracker(mbarrier.group(2), stages=3), "stages=3"),
])
def test_mbarrier_rejects_bad_arguments(build, message):
    with pytest.raises(kiln.KilnValueError, match=message) as err, kernel():
        build()
    assert err.value.loc.filename == __file__ and "Fix:" in str(err.value)


def test_mbarrier_needs_sm90():
    with pytest.raises(kiln.TargetError, match="sm_90"), kernel(target="sm_80"):
        mbarrier.group(1)


# --- TMA --------------------------------------------------------------------------------------

def test_tma_load_store_prefetch_ops_and_ptx():
    with kernel(pointer, shared_tile()) as k:
        desc = tma.descriptor_from_pointer(k.args[0], kiln.bf16, (64, 64), 128)
        tile = k.args[1]
        bars = mbarrier.group(1)
        leader = tid_is_zero()
        tma.prefetch_descriptor(desc, predicate=leader)
        tma.load(desc, tile, (64, 0), bars, 0, predicate=leader)
        nvidia_asm.fence_proxy_async()
        tma.store(tile, desc, (0, 128), predicate=leader)
        tma.commit_group()
        tma.wait_group(0, read=True)
    text = k.text
    assert "swizzle = swizzle_128b" in text
    assert re.search(r"nvgpu.tma.async.load %\w+\[%c64\w*, %c0\w*\]", text)
    assert re.search(r"nvgpu.tma.async.store %\w+ to %\w+\[%c0\w*, %c128\w*\]", text)
    ptx = k.ptx()
    assert "prefetch.tensormap" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    assert "cp.async.bulk.commit_group" in ptx and "cp.async.bulk.wait_group.read 0" in ptx


def test_tma_prefetch_is_an_l2_tensor_prefetch():
    with kernel(pointer) as k:
        desc = tma.descriptor_from_pointer(k.args[0], kiln.bf16, (64, 64), 128)
        tma.prefetch(desc, (64, gpu.thread_id(gpu.Dimension.x)))
    assert "nvvm.cp.async.bulk.tensor.prefetch" in k.text
    assert re.search(r"cp.async.bulk.prefetch.tensor.2d.L2.global.tile \[%rd\d+, \{%r\d+, %r\d+\}\]",
                     k.ptx())


def test_tma_prefetch_needs_one_coordinate_a_box_dimension():
    with pytest.raises(kiln.KilnValueError, match="needs 2 coordinates"), \
            kernel(pointer) as k:
        tma.prefetch(tma.descriptor_from_pointer(k.args[0], kiln.bf16, (64, 64), 128), (0,))


def test_tma_multicast_mask():
    with kernel(pointer, shared_tile()) as k:
        desc = tma.descriptor_from_pointer(k.args[0], kiln.bf16, (64, 64), 128)
        tma.load(desc, k.args[1], (0, 0), mbarrier.group(1), 0, multicast_mask=0b11)
    assert re.search(r"nvgpu.tma.async.load .* multicast_mask = %c3_i16", k.text)


def test_box_bytes():
    assert tma.box_bytes(TensorMapParam("a", "bf16", 2, (64, 64), 128)) == 8192
    assert tma.box_bytes(TensorMapParam("b", "f32", 3, (2, 8, 32))) == 2048
    with kernel(shared_tile((128, 32), kiln.f16)) as k:
        assert tma.box_bytes(k.args[0]) == 128 * 32 * 2
        with pytest.raises(kiln.KilnTypeError, match="box size"):
            tma.box_bytes(k.args[0].type)


@pytest.mark.parametrize("box, swizzle, message", [
    ((64, 128), 128, "exceeds the 128-byte swizzle"),
    ((64, 64), 48, "swizzle must be one of"),
    ((512, 8), 0, "1-5 dimensions of 1..256"),
    ((1,) * 6, 0, "1-5 dimensions"),
])
def test_tma_descriptor_type_validation(box, swizzle, message):
    with pytest.raises(kiln.KilnValueError, match=message), kernel():
        tma.descriptor_type(kiln.bf16, box, swizzle)


def test_tma_load_rejects_wrong_coords_and_non_shared_destination():
    with kernel(pointer, shared_tile(), global_matrix(kiln.bf16)) as k:
        desc = tma.descriptor_from_pointer(k.args[0], kiln.bf16, (64, 64), 128)
        bars = mbarrier.group(1)
        with pytest.raises(kiln.KilnValueError, match="needs 2 coordinates"):
            tma.load(desc, k.args[1], (0, 0, 0), bars, 0)
        with pytest.raises(kiln.KilnTypeError, match="shared-memory tile"):
            tma.load(desc, k.args[2], (0, 0), bars, 0)
        with pytest.raises(kiln.KilnTypeError, match="traced kernel value"):
            tma.load("a_map", k.args[1], (0, 0), bars, 0)
        with pytest.raises(kiln.KilnValueError, match="multicast mask"):
            tma.load(desc, k.args[1], (0, 0), bars, 0, multicast_mask=1 << 16)


def test_tma_needs_a_tma_target():
    with pytest.raises(kiln.TargetError, match="TMA"), kernel(pointer, shared_tile(),
                                                               target="sm_80") as k:
        tma.prefetch_descriptor(k.args[0])


# --- WGMMA ------------------------------------------------------------------------------------

def _descriptors(k, a_index=0, b_index=1, b_major="k"):
    """K-major A and B (or MN-major B) descriptors of 128B-swizzled shared tiles."""
    a = wgmma.smem_descriptor(k.args[a_index], leading_bytes=16, stride_bytes=1024)
    b = wgmma.smem_descriptor(k.args[b_index], leading_bytes=16 if b_major == "k" else 8192,
                              stride_bytes=1024)
    return a, b


def test_wgmma_f16_inputs_lower_to_m64n128k16():
    with kernel(shared_tile((64, 64), kiln.f16), shared_tile((128, 64), kiln.f16)) as k:
        a, b = _descriptors(k)
        acc = wgmma.fragment_zeros(128)
        wgmma.fence()
        for step in range(4):  # K = 64: four k16 steps, 32 bytes apart
            acc = wgmma.mma_async(acc, a + 2 * step, b + 2 * step, dtype=kiln.f16)
        wgmma.commit()
        wgmma.wait_group(0)
        assert (acc.shape, acc.dtype, acc.grid) == ((64, 128), kiln.f32, (1, 1))
        assert acc.layout == kiln.layout.wgmma_m64_accumulator(128)
    assert "nvgpu.warpgroup" not in k.text
    ptx = k.ptx()
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16") == 4
    assert "wgmma.wait_group.sync.aligned 0" in ptx


def test_wgmma_explicit_fence_commit_wait():
    with kernel() as k:
        wgmma.fence()
        wgmma.commit()
        wgmma.wait_group(1)
    ptx = k.ptx()
    assert "wgmma.fence.sync.aligned" in ptx
    assert "wgmma.commit_group.sync.aligned" in ptx
    assert "wgmma.wait_group.sync.aligned 1" in ptx


@pytest.mark.parametrize("n", [264, 12, 0])
def test_wgmma_accumulator_rejects_unsupported_n(n):
    with pytest.raises(kiln.UnsupportedError, match=f"64x{n} is not supported"), kernel():
        wgmma.fragment_zeros(n)


def _bad_operands(k):
    a, b = _descriptors(k)
    return {"f32 operands": (lambda: wgmma.mma_async(wgmma.fragment_zeros(64), a, b,
                                                     dtype=kiln.f32),
                             kiln.UnsupportedError, "f16 or bf16"),
            "a major": (lambda: wgmma.mma_async(wgmma.fragment_zeros(64), a, b, dtype=kiln.bf16,
                                                a_major="row"),
                        kiln.KilnValueError, "must be 'k' or 'mn'"),
            "A kind": (lambda: wgmma.mma_async(wgmma.fragment_zeros(64), kiln.cast(1.0, kiln.f32),
                                               b, dtype=kiln.bf16),
                       kiln.KilnTypeError, "i64 shared-memory descriptor or a vector<8"),
            "B kind": (lambda: wgmma.mma_async(wgmma.fragment_zeros(64), a,
                                               kiln.cast(1, kiln.i32), dtype=kiln.bf16),
                       kiln.KilnTypeError, "B descriptor must be an i64"),
            "accumulator": (lambda: wgmma.mma_async(
                kiln.RegTile.full(kiln.layout.mma_m16n8_accumulator(), (1, 1), 0.0), a, b,
                dtype=kiln.bf16), kiln.KilnTypeError, "needs a WGMMA accumulator"),
            "traced accumulate": (lambda: wgmma.mma_async(
                wgmma.fragment_zeros(64), a, b, dtype=kiln.bf16,
                accumulate=kiln.cast(1, kiln.i32) > 0),
                kiln.UnsupportedError, "needs A in registers")}


@pytest.mark.parametrize("case", ["f32 operands", "a major", "A kind", "B kind", "accumulator",
                                  "traced accumulate"])
def test_wgmma_mma_async_rejects_bad_operands(case):
    with kernel(shared_tile(), shared_tile()) as k:
        issue, error, message = _bad_operands(k)[case]
        with pytest.raises(error, match=message):
            issue()


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "gfx950"])
def test_wgmma_needs_wgmma_target(target):
    with pytest.raises(kiln.TargetError, match="WGMMA") as err, kernel(target=target):
        wgmma.fragment_zeros(64)
    assert "sm_90a" in str(err.value)


def test_accumulator_flattens_through_control_flow():
    with kernel():
        acc = wgmma.fragment_zeros(64)  # the struct the WGMMA reads: one value through loops
        values, aux = acc.__kiln_flatten__()
        again = kiln.RegTile.__kiln_unflatten__(aux, values)
        tile = wgmma.fragment_to_tile(acc)  # the vector form: one value per fragment
        tile_again = kiln.RegTile.__kiln_unflatten__(*reversed(tile.__kiln_flatten__()))
        bars = mbarrier.group(2)
        bars_again = mbarrier.MBarrierGroup.__kiln_unflatten__(*reversed(bars.__kiln_flatten__()))
    assert len(values) == 1 and values[0] == acc.struct() and again.struct() == acc.struct()
    assert (again.shape, again.dtype, again.layout) == ((64, 64), kiln.f32, acc.layout)
    assert [f.ir for f in tile_again.fragments] == [f.ir for f in tile.fragments]
    assert (bars_again.ir, bars_again.num_barriers) == (bars.ir, 2)


# --- nvidia_asm -------------------------------------------------------------------------------

def test_elect_setmaxnreg_fences_lower_to_ptx():
    with kernel() as k:
        leader = nvidia_asm.elect_sync()
        assert leader.dtype is kiln.i1
        nvidia_asm.fence_mbarrier_init()
        nvidia_asm.setmaxnreg(240, increase=True)
        nvidia_asm.setmaxnreg(40, increase=False)
    ptx = k.ptx()
    assert "elect.sync" in ptx
    assert "fence.mbarrier_init.release.cluster" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 240" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 40" in ptx


@pytest.mark.parametrize("count", [20, 241, 300])
def test_setmaxnreg_rejects_bad_counts(count):
    with pytest.raises(kiln.KilnValueError, match="multiple of 8 in 24..256"), kernel():
        nvidia_asm.setmaxnreg(count, increase=True)


def test_predicate_must_be_boolean():
    with pytest.raises(kiln.KilnTypeError, match="predicate must be a boolean"), \
            kernel(lambda: ir.IndexType.get()) as k:
        mbarrier.group(1).init(0, count=1, predicate=k.args[0])


# --- the whole Hopper sequence, independent of the front end ----------------------------------

def test_tma_mbarrier_wgmma_sequence_lowers_to_ptx():
    with kernel(pointer, pointer, shared_tile(), shared_tile(), global_matrix()) as k:
        a_map = tma.descriptor_from_pointer(k.args[0], kiln.bf16, (64, 64), 128)
        b_map = tma.descriptor_from_pointer(k.args[1], kiln.bf16, (64, 64), 128)
        a_smem, b_smem, c = k.args[2:]
        leader = tid_is_zero()
        bars = mbarrier.group(1)
        bars.init(0, count=1, predicate=leader)
        nvidia_asm.fence_mbarrier_init()
        gpu.barrier()
        bars.arrive_expect_tx(0, tma.box_bytes(a_map) + tma.box_bytes(b_map), predicate=leader)
        tma.load(a_map, a_smem, (0, 0), bars, 0, predicate=leader)
        tma.load(b_map, b_smem, (0, 0), bars, 0, predicate=leader)
        mbarrier.PhaseTracker(bars).wait(0)
        a, b = _descriptors(k, 2, 3, b_major="mn")  # B is K x N with N contiguous
        acc = wgmma.fragment_zeros(64)
        wgmma.fence()
        for step in range(4):
            acc = wgmma.mma_async(acc, a + 2 * step, b + 128 * step, dtype=kiln.bf16,
                                  b_major="mn")
        wgmma.commit()
        wgmma.wait_group(0)
        tid = kiln.Value(arith.index_cast(ir.IntegerType.get_signless(32),
                                          gpu.thread_id(gpu.Dimension.x)))
        for i in range(32):
            row, col = acc.layout(tid, i)
            memref.store(acc.element(i).ir, c, [nvidia_asm.as_index(row, "row"),
                                                nvidia_asm.as_index(col, "col")])
    ptx = k.ptx()
    tx_bytes = re.search(r"mov.b32 (%r\d+), 16384;", ptx).group(1)  # two 64 x 64 bf16 boxes
    assert re.search(rf"mbarrier.arrive.expect_tx.shared.b64 _, \[%r\d+\], {tx_bytes};", ptx)
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier") == 2
    assert re.search(r"mbarrier.try_wait.parity.shared.b64 \w+, \[%r\d+\], 0,", ptx)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 4
    assert "wgmma.wait_group.sync.aligned 0" in ptx
    assert ptx.count("st.global.b32") == 32  # 64 x 64 f32 over 128 threads


def test_indices_accept_traced_integers_and_reject_floats():
    with kernel(lambda: ir.IntegerType.get_signless(32), lambda: ir.F32Type.get()) as k:
        bars = mbarrier.group(4)
        bars.arrive(kiln.Value(k.args[0]))
        with pytest.raises(kiln.KilnTypeError, match="mbarrier index must be an int"):
            bars.arrive(k.args[1])
        with pytest.raises(kiln.KilnTypeError, match="mbarrier index must be an int"):
            bars.arrive(1.0)
    assert re.search(r"arith.index_cast %arg0 : i32 to index", k.text)
