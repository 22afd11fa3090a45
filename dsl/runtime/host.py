"""The host-side launcher: an MLIR module that loads the kernel binary and calls ``gpu.launch_func``.

For a :class:`~kiln.signature.KernelSignature` and an already compiled device binary,
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
``ExecutionEngine`` and calls the engine's packed entry ``_mlir_kiln_launch(void **args)`` with
one argument: a :class:`LaunchArguments` block holding the flat C arguments (a memref expands
to allocated ptr, aligned ptr, offset, sizes..., strides...) in 8-byte slots. Converting ~60
arguments through ctypes costs ~5 µs per call; one pointer argument costs ~0.3 µs, and a
bound launch only rewrites the slots that change (tensor addresses, the stream).

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
import struct
import threading
from typing import Mapping, Sequence

from mlir import execution_engine, ir, passmanager
from mlir.dialects import _gpu_ops_gen, arith, builtin, func, gpu, llvm

from kiln.core.dtypes import dtype as to_dtype
from kiln.core.errors import CompilationError, KilnValueError, LaunchError
from kiln.signature import KernelSignature, ScalarParam, TensorMapParam, TensorParam
from kiln.core.targets import Target
from kiln.runtime.cuda import cuda_runtime_libs, require_cuda

BINARY_SYMBOL = "kiln_kernels"
LAUNCH_SYMBOL = "kiln_launch"
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


# struct codes of the C argument types, each padded to one 8-byte slot of LaunchArguments; the
# packed entry loads a narrower value from the start of its slot (little-endian hosts only).
_SLOT_CODES = {ctypes.c_void_p: "Q", ctypes.c_int64: "q", ctypes.c_int32: "i4x",
               ctypes.c_int16: "h6x", ctypes.c_int8: "b7x", ctypes.c_uint16: "H6x",
               ctypes.c_uint8: "B7x", ctypes.c_bool: "?7x", ctypes.c_float: "f4x",
               ctypes.c_double: "d"}
SLOT_BYTES = 8


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
        return ir.MemRefType.get([dynamic] * param.rank, to_dtype(param.dtype).storage.mlir_type(),
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
    try:
        passmanager.PassManager.parse(HOST_PIPELINE).run(module.operation)
    except ir.MLIRError as err:
        raise CompilationError(f"lowering the host launcher failed: {err}",
                               fix="this is a Kiln bug if the kernel compiled; please report it")


# The launch of a kernel: gpu.launch_func becomes a call of this runtime function when the
# host module is translated to LLVM IR.
KERNEL_LAUNCH = "mgpuLaunchKernel"
KERNEL_LAUNCH_ARGS = "!llvm.ptr, " + "i64, " * 6 + "i32, !llvm.ptr, !llvm.ptr, !llvm.ptr, i64"
# The runtime's launch takes no launch attributes, so a kernel that waits on prior grids
# (KernelSignature.programmatic_launch) resolves KERNEL_LAUNCH to this JIT-compiled shim: it
# launches with cuLaunchKernelEx and CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, and
# falls back to the runtime's launch (which reports its own errors) if the driver refuses.
CONFIG_TYPE = "!llvm.struct<(i32, i32, i32, i32, i32, i32, i32, ptr, ptr, i32)>"  # CUlaunchConfig
ATTRIBUTE_TYPE = "!llvm.struct<(i32, i32, array<16 x i32>)>"  # CUlaunchAttribute: id, pad, value
PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
_PROGRAMMATIC_SHIM = f"""
llvm.func @cuFuncSetAttribute(!llvm.ptr, i32, i32) -> i32
llvm.func @cuLaunchKernelEx(!llvm.ptr, !llvm.ptr, !llvm.ptr, !llvm.ptr) -> i32
llvm.func @{KERNEL_LAUNCH}({KERNEL_LAUNCH_ARGS})
llvm.func @kiln_programmatic_launch(%kernel: !llvm.ptr, %gx: i64, %gy: i64, %gz: i64,
    %bx: i64, %by: i64, %bz: i64, %smem: i32, %stream: !llvm.ptr, %params: !llvm.ptr,
    %extra: !llvm.ptr, %count: i64) {{
  %one = llvm.mlir.constant(1 : i64) : i64
  %attribute_id = llvm.mlir.constant({PROGRAMMATIC_STREAM_SERIALIZATION} : i32) : i32
  %allowed = llvm.mlir.constant(1 : i32) : i32
  %attribute_count = llvm.mlir.constant(1 : i32) : i32
  %no_attribute = llvm.mlir.zero : {ATTRIBUTE_TYPE}
  %with_id = llvm.insertvalue %attribute_id, %no_attribute[0] : {ATTRIBUTE_TYPE}
  %attribute_value = llvm.insertvalue %allowed, %with_id[2, 0] : {ATTRIBUTE_TYPE}
  %attribute = llvm.alloca %one x {ATTRIBUTE_TYPE} : (i64) -> !llvm.ptr
  llvm.store %attribute_value, %attribute : {ATTRIBUTE_TYPE}, !llvm.ptr
  %gx32 = llvm.trunc %gx : i64 to i32
  %gy32 = llvm.trunc %gy : i64 to i32
  %gz32 = llvm.trunc %gz : i64 to i32
  %bx32 = llvm.trunc %bx : i64 to i32
  %by32 = llvm.trunc %by : i64 to i32
  %bz32 = llvm.trunc %bz : i64 to i32
  %c0 = llvm.mlir.zero : {CONFIG_TYPE}
  %c1 = llvm.insertvalue %gx32, %c0[0] : {CONFIG_TYPE}
  %c2 = llvm.insertvalue %gy32, %c1[1] : {CONFIG_TYPE}
  %c3 = llvm.insertvalue %gz32, %c2[2] : {CONFIG_TYPE}
  %c4 = llvm.insertvalue %bx32, %c3[3] : {CONFIG_TYPE}
  %c5 = llvm.insertvalue %by32, %c4[4] : {CONFIG_TYPE}
  %c6 = llvm.insertvalue %bz32, %c5[5] : {CONFIG_TYPE}
  %c7 = llvm.insertvalue %smem, %c6[6] : {CONFIG_TYPE}
  %c8 = llvm.insertvalue %stream, %c7[7] : {CONFIG_TYPE}
  %c9 = llvm.insertvalue %attribute, %c8[8] : {CONFIG_TYPE}
  %c10 = llvm.insertvalue %attribute_count, %c9[9] : {CONFIG_TYPE}
  %config = llvm.alloca %one x {CONFIG_TYPE} : (i64) -> !llvm.ptr
  llvm.store %c10, %config : {CONFIG_TYPE}, !llvm.ptr
  %shared_attribute = llvm.mlir.constant({MAX_DYNAMIC_SHARED_SIZE_BYTES} : i32) : i32
  %set = llvm.call @cuFuncSetAttribute(%kernel, %shared_attribute, %smem)
      : (!llvm.ptr, i32, i32) -> i32
  %status = llvm.call @cuLaunchKernelEx(%config, %kernel, %params, %extra)
      : (!llvm.ptr, !llvm.ptr, !llvm.ptr, !llvm.ptr) -> i32
  %success = llvm.mlir.constant(0 : i32) : i32
  %refused = llvm.icmp "ne" %status, %success : i32
  llvm.cond_br %refused, ^fallback, ^done
^fallback:
  llvm.call @{KERNEL_LAUNCH}(%kernel, %gx, %gy, %gz, %bx, %by, %bz, %smem, %stream, %params,
      %extra, %count) : ({KERNEL_LAUNCH_ARGS}) -> ()
  llvm.br ^done
^done:
  llvm.return
}}
llvm.func @kiln_programmatic_launch_address() -> !llvm.ptr {{
  %address = llvm.mlir.addressof @kiln_programmatic_launch : !llvm.ptr
  llvm.return %address : !llvm.ptr
}}
"""


class ProgrammaticLaunchShim:
    """The JIT-compiled ``_PROGRAMMATIC_SHIM``; :attr:`address` is its launch function, a
    drop-in ``mgpuLaunchKernel``. ``symbols`` maps ``cuFuncSetAttribute``, ``cuLaunchKernelEx``
    (and, to replace the runtime's fallback launch, ``mgpuLaunchKernel``) to addresses; the
    rest resolves from ``runtime_libs``. Keep the object alive while the address is in use.
    Example: ``ProgrammaticLaunchShim(driver_symbols, cuda_runtime_libs()).address``."""

    def __init__(self, symbols: Mapping[str, int], runtime_libs: Sequence[str] = ()):
        self._context = ir.Context()
        with self._context, ir.Location.unknown():
            self._engine = execution_engine.ExecutionEngine(
                ir.Module.parse(_PROGRAMMATIC_SHIM), opt_level=2, shared_libs=list(runtime_libs))
            for name, address in symbols.items():
                self._engine.raw_register_runtime(name, ctypes.c_void_p(address))
            self._engine.initialize()
        # The packed entry of a function returning a pointer writes it to args[0].
        address = ctypes.c_void_p()
        args = (ctypes.c_void_p * 1)(ctypes.addressof(address))
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
            self._engine.raw_lookup("kiln_programmatic_launch_address"))(ctypes.addressof(args))
        self.address: int = address.value


_shim_lock = threading.Lock()
_driver_shim: ProgrammaticLaunchShim | None = None  # kept for the process


def programmatic_launch_shim(runtime_libs: Sequence[str]) -> int:
    """Address of the process's :class:`ProgrammaticLaunchShim` over the CUDA driver (compiled
    on first use)."""
    global _driver_shim
    with _shim_lock:
        if _driver_shim is None:
            driver = ctypes.CDLL("libcuda.so.1")
            symbols = {name: ctypes.cast(driver[name], ctypes.c_void_p).value
                       for name in ("cuFuncSetAttribute", "cuLaunchKernelEx")}
            _driver_shim = ProgrammaticLaunchShim(symbols, runtime_libs)
        return _driver_shim.address


def nvidia_kernel_object(target: Target, *, cubin: bytes | None = None, ptx: str | None = None):
    """``#gpu.object`` for an NVIDIA kernel: the cubin when there is one, else PTX that the
    driver JIT-compiles at module load (``-O3``)."""
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


class LaunchArguments:
    """Native memory for one ``kiln_launch`` call: one 8-byte slot per flat C argument (the
    parameters, grid x/y/z, dynamic shared bytes, stream) in ``words``, and the ``void *``
    array pointing at each slot that the packed entry reads.

    Slots are rewritten in place between calls; a pointer or i64 slot is written as
    ``words[i] = value`` (see :meth:`HostLauncher.pack` for every slot at once).
    """

    def __init__(self, count: int):
        self.words = (ctypes.c_uint64 * count)()
        base = ctypes.addressof(self.words)
        self._pointers = (ctypes.c_void_p * count)(*range(base, base + SLOT_BYTES * count,
                                                          SLOT_BYTES))
        self.address = ctypes.c_void_p(ctypes.addressof(self._pointers))

    def copy(self) -> LaunchArguments:
        twin = LaunchArguments(len(self.words))
        ctypes.memmove(twin.words, self.words, ctypes.sizeof(self.words))
        return twin


class PackedLaunches:
    """Launching from argument blocks, shared by :class:`HostLauncher` and the driver
    launcher: a subclass sets ``layout`` (the slots' struct), ``signature``, ``_smem``,
    ``entry`` (called with a block's address), ``thread_blocks`` and ``new_arguments()``."""

    def pack(self, arguments: LaunchArguments, flat_args: Sequence,
             grid: tuple[int, int, int], stream: int | None) -> None:
        """Write every slot of ``arguments`` (KilnValueError when a value does not fit its C
        type, e.g. 2**31 for an i32 parameter, 1e39 for an f32 one)."""
        try:
            self.layout.pack_into(arguments.words, 0, *flat_args, *grid, self._smem, stream or 0)
        except (struct.error, OverflowError) as err:  # OverflowError: a float past f32
            raise KilnValueError(f"launch arguments of {self.signature.name} do not fit their C "
                                 f"types ({err}): {_describe_flat(self.signature, flat_args)}",
                                 fix="pass values within the range of each parameter's dtype"
                                 ) from None

    def launch_packed(self, arguments: LaunchArguments) -> None:
        """Launch with the slots as they are (one call: ctypes, or the native shim)."""
        self.entry(arguments.address)

    def thread_arguments(self) -> LaunchArguments:
        """The calling thread's own argument block (made on its first launch)."""
        arguments = self.thread_blocks.get(threading.get_ident())
        if arguments is None:
            arguments = self.thread_blocks.setdefault(threading.get_ident(), self.new_arguments())
        return arguments

    def __call__(self, flat_args: Sequence, grid: tuple[int, int, int], stream: int | None) -> None:
        arguments = self.thread_arguments()
        self.pack(arguments, flat_args, grid, stream)
        self.entry(arguments.address)


class HostLauncher(PackedLaunches):
    """A JIT-compiled ``kiln_launch``; call it with the flat parameter values.

    ``runtime_libs`` are the MLIR GPU runtime wrapper libraries the launcher links against;
    ``runtime_symbols`` maps ``mgpu*`` names to addresses of in-process implementations that
    take precedence (a runtime provided by the host application, or a recording stub).
    Construction runs the module-load constructor, so the device must be usable.

    Two ways to launch: ``launcher(flat_args, grid, stream)`` packs every slot of a per-thread
    :class:`LaunchArguments` block and calls; a caller repeating one launch keeps its own block
    (:meth:`new_arguments`, :meth:`pack` once), rewrites the changing slots and calls
    :meth:`launch_packed`. Slot indices: parameters from 0 (``flat_c_argtypes`` order),
    then :attr:`grid_slot` (3 slots), the dynamic shared bytes, :attr:`stream_slot`.
    A generated launcher (:mod:`kiln.lowering.launch_fast`) packs :attr:`layout` into its
    thread's block (:meth:`thread_arguments`) itself and calls :attr:`entry` on its address.
    """

    def __init__(self, signature: KernelSignature, build_object, runtime_libs: Sequence[str],
                 runtime_symbols: Mapping[str, int] | None = None):
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
        # The packed entry of a void function reads args[0..n-1] and writes nothing back.
        self.entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
            self._engine.raw_lookup(LAUNCH_SYMBOL))
        argtypes = flat_c_argtypes(signature)
        self.layout = struct.Struct("<" + "".join(_SLOT_CODES[t] for t in argtypes))
        self.grid_slot = len(argtypes) - 5
        self.stream_slot = len(argtypes) - 1
        self._smem = signature.dynamic_shared_bytes
        # Thread id -> its argument block (the ctypes call releases the GIL).
        self.thread_blocks: dict[int, LaunchArguments] = {}

    def new_arguments(self) -> LaunchArguments:
        """A fresh, zeroed argument block for :meth:`pack` / :meth:`launch_packed`."""
        return LaunchArguments(self.layout.size // SLOT_BYTES)

def _describe_flat(signature: KernelSignature, flat_args: Sequence) -> str:
    """``name=value`` per parameter for an error message (tensors by their address)."""
    values = iter(flat_args)
    parts = []
    for param in signature.params:
        if isinstance(param, TensorParam):
            fields = [next(values, None) for _ in range(3 + 2 * param.rank)]
            parts.append(f"{param.name}=<tensor at {fields[1]}>")
        else:
            parts.append(f"{param.name}={next(values, None)!r}")
    return ", ".join(parts)


def build_nvidia_launcher(signature: KernelSignature, target: Target, *,
                          cubin: bytes | None = None, ptx: str | None = None) -> HostLauncher:
    """A :class:`HostLauncher` for an NVIDIA kernel (needs a CUDA driver and GPU)."""
    require_cuda()  # the ExecutionEngine aborts the process if libcuda.so.1 is missing
    libs = cuda_runtime_libs()
    # A cluster kernel launches through mgpuLaunchClusterKernel, which keeps the stream order.
    symbols = {KERNEL_LAUNCH: programmatic_launch_shim(libs)} \
        if signature.programmatic_launch and not signature.cluster else {}
    return HostLauncher(signature, lambda: nvidia_kernel_object(target, cubin=cubin, ptx=ptx),
                        libs, symbols)
