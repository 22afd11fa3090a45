"""The host-side launcher: an MLIR module that loads the kernel binary and calls ``gpu.launch_func``.

For a :class:`~kiln.lowering.signature.KernelSignature` and an already compiled device binary,
:func:`build_host_module` emits::

    module attributes {gpu.container_module} {
      gpu.binary @kiln_kernels [#gpu.object<#nvvm.target<chip = "sm_90a">, bin = "...">]
      func.func @kiln_launch(<params>, %gx: index, %gy: index, %gz: index, %smem: i32,
                             %stream: !llvm.ptr) {
        gpu.launch_func async [%stream as token] @kiln_kernels::@<name> blocks in (%gx, %gy, %gz)
            threads in (<block>) dynamic_shared_memory_size %smem args(<params>)
      }
    }

which :func:`lower_host_module` lowers with ``gpu-to-llvm`` (the host half of
``gpu-lower-to-nvvm-pipeline``). Translation turns ``gpu.binary`` into a global constructor that
loads the module (``mgpuModuleLoad``, or ``mgpuModuleLoadJIT`` for PTX) and the launch into
``mgpuLaunchKernel`` on the caller's stream. :class:`HostLauncher` JIT-compiles it once with the
``ExecutionEngine`` and calls the plain C-ABI ``kiln_launch`` through ctypes with the flat C
argument list (a memref expands to allocated ptr, aligned ptr, offset, sizes..., strides...),
not through the slower packed wrapper; its address comes from ``kiln_launch_address``.

Parameter ABI on the host side:

- tensors: ``memref<?x..xT, strided<[?,..,?], offset: ?>, 1>`` (every field passed, so one
  launcher serves contiguous and strided layouts alike);
- f16/bf16/fp8 scalars: their integer bit pattern (ctypes has no half type), bitcast in IR;
- tensor maps: ``!llvm.ptr`` to the 128-byte ``CUtensorMap`` in device memory, which is what
  ``convert-nvgpu-to-nvvm`` turns the kernel's ``!nvgpu.tensormap.descriptor`` into.

Example::

    launcher = build_nvidia_launcher(sig, get_target("sm_90a"), ptx=ptx_text)
    launcher(flat_args, (gx, gy, gz), stream=0)
"""

from __future__ import annotations

import ctypes
from typing import Mapping, Sequence

from kiln.dtypes import dtype as to_dtype
from kiln.errors import CompilationError, LaunchError
from kiln.lowering.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam
from kiln.lowering.targets import Target

BINARY_SYMBOL = "kiln_kernels"
LAUNCH_SYMBOL = "kiln_launch"
# The Python ExecutionEngine only looks up packed ``void(void**)`` wrappers; this function's
# packed wrapper hands out the address of the plain C-ABI ``kiln_launch``.
ADDRESS_SYMBOL = "kiln_launch_address"
GLOBAL_MEMORY_SPACE = 1

HOST_PIPELINE = ("builtin.module(convert-func-to-llvm,convert-arith-to-llvm,"
                 "convert-index-to-llvm,gpu-to-llvm,canonicalize,reconcile-unrealized-casts)")

# Host-side carrier of a scalar: (ctypes type, integer width when passed as bits else None).
_SCALAR_CARRIERS = {
    "i1": (ctypes.c_bool, None), "i8": (ctypes.c_int8, None), "i16": (ctypes.c_int16, None),
    "i32": (ctypes.c_int32, None), "i64": (ctypes.c_int64, None),
    "index": (ctypes.c_int64, None), "f32": (ctypes.c_float, None),
    "f64": (ctypes.c_double, None), "f16": (ctypes.c_uint16, 16), "bf16": (ctypes.c_uint16, 16),
    "f8e4m3": (ctypes.c_uint8, 8), "f8e5m2": (ctypes.c_uint8, 8),
}


def scalar_carrier(dtype_name: str) -> tuple[type, int | None]:
    """ctypes type a scalar of ``dtype_name`` crosses into ``kiln_launch`` as, and its bit width
    when it is passed as a bit pattern (f16/bf16/fp8)."""
    return _SCALAR_CARRIERS[to_dtype(dtype_name).name]


def flat_c_argtypes(signature: KernelSignature) -> list[type]:
    """The C argument types of the lowered ``kiln_launch`` (parameters, grid, smem, stream)."""
    types: list[type] = []
    for param in signature.params:
        if isinstance(param, TensorParam):
            types += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            types += [ctypes.c_int64] * (2 * param.rank)
        elif isinstance(param, TensorMapParam):
            types.append(ctypes.c_void_p)
        else:
            types.append(scalar_carrier(param.dtype)[0])
    return types + [ctypes.c_int64] * 3 + [ctypes.c_int32, ctypes.c_void_p]


def _host_param_type(param, ir, llvm):
    if isinstance(param, TensorParam):
        dynamic = ir.ShapedType.get_dynamic_size()
        layout = ir.StridedLayoutAttr.get(dynamic, [dynamic] * param.rank)
        space = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), GLOBAL_MEMORY_SPACE)
        return ir.MemRefType.get([dynamic] * param.rank, to_dtype(param.dtype).mlir_type(),
                                 layout, space)
    if isinstance(param, TensorMapParam):
        return llvm.PointerType.get()
    _, bits = scalar_carrier(param.dtype)
    if bits is not None:
        return ir.IntegerType.get_signless(bits)
    return to_dtype(param.dtype).mlir_type()


def build_host_module(signature: KernelSignature, kernel_object):
    """The host module (in the active ``ir.Context``) launching ``signature.name`` from
    ``kernel_object``, a ``#gpu.object`` attribute holding the device binary."""
    from mlir import ir
    from mlir.dialects import _gpu_ops_gen, arith, builtin, func, gpu, llvm

    module = ir.Module.create()
    module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
    index = ir.IndexType.get()
    stream_type = llvm.PointerType.get()
    param_types = [_host_param_type(p, ir, llvm) for p in signature.params]
    with ir.InsertionPoint(module.body):
        # No Python builder exists for the offloading handler; select_object<0> is the default.
        gpu.BinaryOp(BINARY_SYMBOL, ir.ArrayAttr.get([kernel_object]),
                     offloadingHandler=ir.Attribute.parse("#gpu.select_object<0>"))
        fn_type = ir.FunctionType.get(
            param_types + [index] * 3 + [ir.IntegerType.get_signless(32), stream_type], [])
        fn = func.FuncOp(LAUNCH_SYMBOL, fn_type)
        entry = fn.add_entry_block()
        address_fn = func.FuncOp(ADDRESS_SYMBOL, ir.FunctionType.get([], [stream_type]))
    with ir.InsertionPoint(address_fn.add_entry_block()):
        launch_ref = func.ConstantOp(fn_type, ir.FlatSymbolRefAttr.get(LAUNCH_SYMBOL))
        address = builtin.UnrealizedConversionCastOp([stream_type], [launch_ref.result]).result
        func.ReturnOp([address])
    with ir.InsertionPoint(entry):
        args = list(entry.arguments)
        kernel_args = []
        for param, value in zip(signature.params, args):
            if isinstance(param, ScalarParam) and scalar_carrier(param.dtype)[1] is not None:
                value = arith.bitcast(to_dtype(param.dtype).mlir_type(), value)
            kernel_args.append(value)
        grid = args[len(param_types):len(param_types) + 3]
        smem, stream = args[-2], args[-1]

        def const(v: int):
            return arith.constant(index, v)

        block = [const(v) for v in signature.block]
        cluster = [const(v) for v in signature.cluster] if signature.cluster else [None] * 3
        # gpu-to-llvm launches on the stream of the async dependency (a token lowers to the
        # stream pointer); a plain ``<%stream>`` async object is dropped and a fresh stream
        # created, synchronised and destroyed on every launch.
        token_type = gpu.AsyncTokenType.get()
        token = builtin.UnrealizedConversionCastOp([token_type], [stream]).result
        kernel_ref = ir.SymbolRefAttr.get([BINARY_SYMBOL, signature.name])
        _gpu_ops_gen.LaunchFuncOp(
            token_type, [token], kernel_ref, *grid, *block, kernel_args,
            clusterSizeX=cluster[0], clusterSizeY=cluster[1], clusterSizeZ=cluster[2],
            dynamicSharedMemorySize=smem)
        func.ReturnOp([])
    return module


def lower_host_module(module) -> None:
    """Lower the host module to the LLVM dialect in place (raises CompilationError)."""
    from mlir import ir, passmanager

    try:
        passmanager.PassManager.parse(HOST_PIPELINE).run(module.operation)
    except ir.MLIRError as err:
        raise CompilationError(f"lowering the host launcher failed: {err}",
                               fix="this is a Kiln bug if the kernel compiled; please report it")


def nvidia_kernel_object(target: Target, *, cubin: bytes | None = None, ptx: str | None = None):
    """``#gpu.object`` for an NVIDIA kernel: the cubin when there is one, else PTX that the
    driver JIT-compiles at module load (``-O3``)."""
    from mlir import ir
    from mlir.dialects import gpu

    # No typed Python builder exists for #nvvm.target.
    nvvm_target = ir.Attribute.parse(f'#nvvm.target<chip = "{target.name}">')
    if cubin is not None:
        return gpu.ObjectAttr.get(nvvm_target, int(gpu.CompilationTarget.Binary), bytes(cubin))
    if ptx is None:
        raise LaunchError(f"no cubin or PTX to launch for {target.name}",
                          fix="compile the kernel for an NVIDIA target before launching it")
    jit_options = ir.DictAttr.get({"O": ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 3)})
    return gpu.ObjectAttr.get(nvvm_target, int(gpu.CompilationTarget.Assembly),
                              ptx.encode(), jit_options)


class HostLauncher:
    """A JIT-compiled ``kiln_launch``; call it with the flat parameter values.

    ``runtime_libs`` are the MLIR GPU runtime wrapper libraries the launcher links against;
    ``runtime_symbols`` maps ``mgpu*`` names to addresses of in-process implementations that
    take precedence (a runtime provided by the host application, or a recording stub).
    Construction runs the module-load constructor, so the device must be usable.
    """

    def __init__(self, signature: KernelSignature, build_object, runtime_libs: Sequence[str],
                 runtime_symbols: Mapping[str, int] | None = None):
        from mlir import execution_engine, ir

        self.signature = signature
        self._context = ir.Context()  # owned: the engine's module must outlive every launch
        with self._context, ir.Location.unknown():
            module = build_host_module(signature, build_object())
            lower_host_module(module)
            self._engine = execution_engine.ExecutionEngine(
                module, opt_level=2, shared_libs=list(runtime_libs))
            for name, address in (runtime_symbols or {}).items():
                self._engine.raw_register_runtime(name, ctypes.c_void_p(address))
            self._engine.initialize()
        result = ctypes.c_void_p()
        packed_args = (ctypes.c_void_p * 1)(ctypes.addressof(result))
        packed = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._engine.raw_lookup(ADDRESS_SYMBOL))
        packed(packed_args)
        self._launch = ctypes.CFUNCTYPE(None, *flat_c_argtypes(signature))(result.value)
        self._smem = signature.dynamic_shared_bytes

    def __call__(self, flat_args: Sequence, grid: tuple[int, int, int], stream: int | None) -> None:
        self._launch(*flat_args, grid[0], grid[1], grid[2], self._smem, stream)


def build_nvidia_launcher(signature: KernelSignature, target: Target, *,
                          cubin: bytes | None = None, ptx: str | None = None) -> HostLauncher:
    """A :class:`HostLauncher` for an NVIDIA kernel (needs a CUDA driver and GPU)."""
    from kiln.lowering.cuda import cuda_runtime_libs, require_cuda

    require_cuda()  # the ExecutionEngine aborts the process if libcuda.so.1 is missing
    return HostLauncher(signature, lambda: nvidia_kernel_object(target, cubin=cubin, ptx=ptx),
                        cuda_runtime_libs())
