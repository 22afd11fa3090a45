"""Tracing one specialisation of a kernel function into Kiln IR: the ``gpu.module`` holding one
``gpu.func`` whose arguments are the run-time parameters (tensors as memrefs, tensor maps as
descriptor addresses, scalars), the body built by running the rewritten Python function on
traced values, verified, with the launch signature the trace derived.

``@kiln.kernel`` (:mod:`kiln.kernel`) specialises a call into :class:`ArgSpec` s and calls
:func:`trace_kernel`; a :class:`TracedKernel` is what the compiler and the interpreter take.
Example::

    traced = saxpy.trace(x, y, n, 2.0, BLOCK=256)   # trace_kernel(saxpy.fn, "saxpy", specs, ...)
    print(traced.module_asm)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from mlir import ir
from mlir.dialects import gpu, llvm

from . import ast_rewrite, builder, threads
from .annotations import TensorMapSpec
from .core import dtypes as dt
from .core.errors import (CompilationError, InternalError, KilnTypeError, SourceLoc,
                          source_loc_from_mlir, trace_location)
from .core.targets import get_target
from .driver import lowering_signature
from .nvidia.tma import descriptor_from_pointer
from .tensor import TensorRef, memref_type
from .values import Value

# The trace state (builder's stack) is global: threads (autotune's parallel compile) trace one
# at a time and lower concurrently.
_TRACE_LOCK = threading.RLock()


@dataclass(frozen=True)
class ArgSpec:
    """How one argument specialises the kernel (part of the cache key)."""
    name: str
    kind: str  # "tensor" | "scalar" | "constexpr" | "tensormap"
    dtype: dt.DType | None = None
    rank: int = 0
    contiguous: bool = True
    value: Any = field(default=None, compare=False)  # constexpr value, compared by `typed`
    tensormap: TensorMapSpec | None = None
    typed: Any = None  # fingerprint.typed_key(value): 2, 2.0, True and -0.0 all differ

    def key(self) -> str:
        """A runtime argument's part of the on-disk key. A constexpr's part is its content
        fingerprint, which kiln.driver.key_parts computes (``typed`` holds functions by
        identity: its repr has addresses, no key across processes)."""
        spec = f"{self.name}:{self.kind}:{self.dtype}:{self.rank}:{int(self.contiguous)}"
        if self.tensormap is not None:  # the box and swizzle change the traced IR
            spec += f":{self.tensormap.box}:{self.tensormap.swizzle}"
            spec += ":nan" if self.tensormap.oob_fill_nan else ""
        return spec


def kiln_asm(module: ir.Module | ir.Operation) -> str:
    """Kiln IR text as the trace prints it: with locations (errors and the interpreter point
    at the user's lines through them)."""
    return module.operation.get_asm(enable_debug_info=True)


class TracedKernel:
    """The kiln IR of one specialisation: ``module_asm`` (with locations), ``signature`` and
    ``shared_bytes``.

    A trace keeps its ``ir.Module`` and prints ``module_asm`` on first read: printing with
    locations costs as much as a third of the trace, and a compile takes the module itself
    (:meth:`take_module`) and prints the text beside ptxas. Example::

        traced = saxpy.trace(x, y, n, 2.0, BLOCK=256)
        print(traced.module_asm)
    """

    def __init__(self, name: str, module_asm: str | None, signature: Any, shared_bytes: int,
                 *, module: ir.Module | None = None):
        if module_asm is None and module is None:
            raise InternalError("a TracedKernel needs its IR text or its module")
        self.name = name
        self.signature = signature  # kiln.signature.KernelSignature
        self.shared_bytes = shared_bytes
        self._asm = module_asm
        self._module = module

    @property
    def module_asm(self) -> str:
        """The kiln IR text (printed from the traced module on first read)."""
        if self._asm is None:
            if self._module is None:
                raise InternalError(f"the traced module of {self.name} was handed to the "
                                    "compiler before its text was read; read the compiled "
                                    "kernel's asm['kiln'] instead")
            self._asm = kiln_asm(self._module)
            self._module = None
        return self._asm

    def take_module(self) -> ir.Module | None:
        """The traced module, unprinted, for the compiler to lower in place (its own Context);
        None once ``module_asm`` was read. ``module_asm`` is unavailable afterwards."""
        module, self._module = self._module, None
        return module

    def __repr__(self) -> str:
        return f"TracedKernel({self.name!r}, signature={self.signature!r})"


def trace_kernel(fn: Callable, name: str, specs: tuple[ArgSpec, ...], target_name: str,
                 num_warps: int) -> TracedKernel:
    """The Kiln IR of kernel ``name`` (the function ``fn``) specialised on ``specs`` (one per
    parameter, constexprs included) for ``target_name`` with ``num_warps`` warps per block.

    Raises the user's errors as traced (KilnError subclasses at their lines) and
    CompilationError where MLIR rejects an op or the module fails verification. Example:
    ``trace_kernel(saxpy.fn, "saxpy", saxpy.specialize(args, {"BLOCK": 256}), "sm_90a", 8)``."""
    with _TRACE_LOCK:
        return _trace_locked(fn, name, specs, target_name, num_warps)


def _trace_locked(fn: Callable, name: str, specs: tuple[ArgSpec, ...], target_name: str,
                  num_warps: int) -> TracedKernel:
    target = get_target(target_name)
    block = (num_warps * target.warp_size, 1, 1)
    target.check_block(block)
    code = fn.__code__
    def_loc = SourceLoc(code.co_filename, code.co_firstlineno)
    rewritten = ast_rewrite.rewrite(fn)
    with builder.trace_context() as ctx, ir.Location.file(def_loc.filename, def_loc.line, 1):
        module = ir.Module.create()
        module.operation.attributes["gpu.container_module"] = ir.UnitAttr.get()
        with ir.InsertionPoint(module.body):
            gpu_module = gpu.GPUModuleOp(builder.KERNEL_MODULE_NAME)
        gpu_block = gpu_module.bodyRegion.blocks.append()
        arg_types = [_arg_type(s) for s in specs if s.kind != "constexpr"]
        with ir.InsertionPoint(gpu_block):
            func = gpu.GPUFuncOp(ir.FunctionType.get(arg_types, []), sym_name=name,
                                 kernel=True, known_block_size=list(block))
        entry = func.body.blocks.append(*arg_types)
        state = builder.TraceState(ctx, module, gpu_block, target, block, entry_block=entry,
                                   param_names=tuple(s.name for s in specs
                                                     if s.kind != "constexpr"))
        builder.push(state)
        try:
            with ir.InsertionPoint(entry), trace_location(def_loc):
                block_args = iter(entry.arguments)
                call_args = [s.value if s.kind == "constexpr" else
                             _wrap_arg(s, next(block_args)) for s in specs]
                result = rewritten(*call_args)
                if result is not None:
                    raise KilnTypeError(f"kernel {name} returned {result!r}; kernels "
                                        "cannot return values",
                                        fix="store results into a tensor argument")
                for finish in state.finishers:  # what only the whole body decides
                    finish()
                gpu.ReturnOp([])
        except ir.MLIRError as err:
            raise _compilation_error(err, f"MLIR rejected an op built by {name}") from None
        finally:
            builder.pop()
        derived = tuple(param for param, _ in state.derived_maps.values())
        if derived:  # the tensor maps kiln.copy derived are parameters after the declared
            func.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
                [a.type for a in entry.arguments], []))
        _verify(module, name)
        threads.check_thread_indexing(state.thread_ids, name, block[0], target,
                                      num_warps)
    constexprs = tuple((s.name, repr(s.value)) for s in specs if s.kind == "constexpr")
    signature = lowering_signature(name, specs, block, constexprs,
                                   dynamic_shared_bytes=state.dynamic_shared_bytes,
                                   cluster=state.cluster,
                                   programmatic_launch=state.programmatic_launch,
                                   derived=derived)
    return TracedKernel(name, None, signature, state.shared_bytes, module=module)

def _arg_type(spec: ArgSpec) -> ir.Type:
    if spec.kind == "tensor":
        return memref_type(spec.dtype, spec.rank, spec.contiguous)
    if spec.kind == "tensormap":
        # convert-gpu-to-nvvm cannot lower a gpu.func taking !nvgpu.tensormap.descriptor:
        # the kernel takes the descriptor's device address and casts it (kiln.tma).
        return llvm.PointerType.get()
    return spec.dtype.mlir_type()

def _wrap_arg(spec: ArgSpec, arg: ir.Value):
    if spec.kind == "tensor":
        return TensorRef(arg, spec.dtype, spec.name)
    if spec.kind == "tensormap":

        tm = spec.tensormap
        return descriptor_from_pointer(arg, tm.dtype, tm.box, tm.swizzle,
                                       oob_fill_nan=tm.oob_fill_nan)
    return Value(arg, spec.dtype)


def _verify(module: ir.Module, name: str) -> None:
    try:
        module.operation.verify()
    except ir.MLIRError as err:
        raise _compilation_error(err, f"kernel {name} failed MLIR verification") from None


def _compilation_error(err: ir.MLIRError, what: str) -> CompilationError:
    """A CompilationError at the user line of MLIR's first diagnostic (every traced op carries
    its source location)."""
    diags = err.error_diagnostics
    message = diags[0].message if diags else str(err)
    loc = source_loc_from_mlir(diags[0].location) if diags else None
    return CompilationError(f"{what}: {message}",
                            fix="check the dtypes/shapes of the operands on this line", loc=loc)
