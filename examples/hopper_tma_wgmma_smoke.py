"""Hopper smoke kernel: TMA loads on an mbarrier, WGMMA m64n64k16 steps, f32 result.

One CTA of 128 threads (one warp group) computes ``C = A @ B`` for A: 64 x 64 bf16 and
B: 64 x 64 bf16 (row-major, N contiguous), C: 64 x 64 f32:

1. thread 0 initialises an mbarrier, announces the bytes both TMA boxes will deliver and issues
   the two TMA loads into 128B-swizzled shared tiles;
2. every thread waits on the mbarrier (phase 0);
3. the warp group runs ``nvgpu.warpgroup.mma`` (four m64n64k16 steps over K) into an f32
   accumulator and stores it to C.

The kernel body (:func:`smoke_tile`) uses only Kiln's NVGPU wrappers. Until ``@kiln.kernel``
can express TensorMap parameters and shared tiles, :func:`build_kiln_ir` wraps the body in a
hand-built ``gpu.func`` that follows the front end's kiln-IR contract.

Run on an H100: ``python examples/hopper_tma_wgmma_smoke.py``.
"""

from __future__ import annotations

import numpy as np
from mlir import ir
from mlir.dialects import arith, gpu, llvm, memref

import kiln
from kiln import mbarrier, tma, wgmma
from kiln.lowering.signature import KernelSignature, TensorMapParam, TensorParam
from kiln.nvidia_asm import compiling_for, fence_mbarrier_init

M, N, K = 64, 64, 64
SWIZZLE = 128  # bytes: one 64-element bf16 row, the layout WGMMA reads without bank conflicts
SWIZZLE_ALIGN = 1024  # 128B-swizzled tiles must start on a 1024-byte boundary
KERNEL_NAME = "tma_wgmma_smoke"

SIGNATURE = KernelSignature(
    KERNEL_NAME,
    (TensorMapParam("a_map", "bf16", 2, (M, K), SWIZZLE),
     TensorMapParam("b_map", "bf16", 2, (K, N), SWIZZLE),
     TensorParam("c", "f32", 2)),
    block=(128, 1, 1))


def smoke_tile(a_map, b_map, a_smem, b_smem, c, leader) -> None:
    """C[0:M, 0:N] = A_box @ B_box; ``leader`` is true in exactly one thread of the CTA."""
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=1, predicate=leader)
    fence_mbarrier_init()
    gpu.barrier()  # every thread must see the initialised barrier before waiting on it

    tma.prefetch_descriptor(a_map, predicate=leader)
    tma.prefetch_descriptor(b_map, predicate=leader)
    bars.arrive_expect_tx(0, tma.box_bytes(a_map) + tma.box_bytes(b_map), predicate=leader)
    tma.load(a_map, a_smem, (0, 0), bars, 0, predicate=leader)  # coords: (k, m), innermost first
    tma.load(b_map, b_smem, (0, 0), bars, 0, predicate=leader)  # coords: (n, k)
    bars.try_wait(0, phase=0)

    acc = wgmma.accumulator(M, N, kiln.f32)
    acc = wgmma.mma(acc, wgmma.descriptor(a_smem, a_map), wgmma.descriptor(b_smem, b_map),
                    transpose_b=True)  # B is stored K x N with N contiguous
    wgmma.store(acc, c, (0, 0))


def build_kiln_ir(target: str = "sm_90a") -> str:
    """The smoke kernel as kiln IR text (one ``gpu.module @kiln_kernels``), per the front-end
    contract; TensorMap parameters arrive as ``!llvm.ptr`` (see ``kiln.tma.descriptor_from_pointer``)."""
    with ir.Context(), ir.Location.unknown(), compiling_for(target):
        module = ir.Module.create()
        module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(module.body):
            kernels = gpu.GPUModuleOp("kiln_kernels")
        body = kernels.bodyRegion.blocks.append()
        bf16, shared = kiln.bf16.mlir_type(), ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 3)
        tile_types = {name: ir.MemRefType.get(list(box), bf16, memory_space=shared)
                      for name, box in (("a_tile", (M, K)), ("b_tile", (K, N)))}
        dynamic = ir.ShapedType.get_dynamic_size()
        out_type = ir.MemRefType.get(
            [dynamic, dynamic], kiln.f32.mlir_type(),
            layout=ir.StridedLayoutAttr.get(dynamic, [dynamic, 1]),
            memory_space=ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 1))
        with ir.InsertionPoint(body):
            for name, tile_type in tile_types.items():
                memref.global_(name, ir.TypeAttr.get(tile_type), alignment=SWIZZLE_ALIGN)
            func_type = ir.FunctionType.get([llvm.PointerType.get()] * 2 + [out_type], [])
            kernel = gpu.GPUFuncOp(ir.TypeAttr.get(func_type), sym_name=KERNEL_NAME, kernel=True)
            kernel.attributes["known_block_size"] = ir.DenseI32ArrayAttr.get(list(SIGNATURE.block))
        entry = kernel.body.blocks.append(*func_type.inputs)
        with ir.InsertionPoint(entry):
            a_ptr, b_ptr, c = entry.arguments
            a_map = tma.descriptor_from_pointer(a_ptr, kiln.bf16, (M, K), SWIZZLE)
            b_map = tma.descriptor_from_pointer(b_ptr, kiln.bf16, (K, N), SWIZZLE)
            a_smem, b_smem = (memref.get_global(t, name) for name, t in tile_types.items())
            thread = gpu.thread_id(gpu.Dimension.x)
            leader = arith.cmpi(arith.CmpIPredicate.eq, thread,
                                arith.constant(ir.IndexType.get(), 0))
            smoke_tile(a_map, b_map, a_smem, b_smem, c, leader)
            gpu.return_([])
        module.operation.verify()
        return module.operation.get_asm(enable_debug_info=True)


def reference_inputs(seed: int = 0):
    """Random bf16 A, B and a NaN-poisoned f32 C (so unwritten elements fail the check)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((K, N)).astype(ml_dtypes.bfloat16)
    c = np.full((M, N), np.nan, dtype=np.float32)
    return a, b, c


def relative_error(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    expected = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.linalg.norm(c - expected) / np.linalg.norm(expected))


def main() -> None:
    from kiln.lowering.compiler import compile_kernel
    from kiln.lowering.options import CompileOptions

    compiled = compile_kernel(build_kiln_ir(), SIGNATURE, CompileOptions(target="sm_90a"))
    a, b, c = reference_inputs()
    compiled.launch((1, 1, 1), (a, b, c))
    error = relative_error(c, a, b)
    print(f"relative error {error:.2e}: {'PASS' if error < 1e-2 else 'FAIL'}")


if __name__ == "__main__":
    main()
