"""PTX from a ``gpu.module`` through LLVM's C API, with a pass pipeline Kiln chooses.

Upstream ``gpu-module-to-binary{format=isa}`` translates the module, links the needed libdevice
functions, runs LLVM's ``default<O3>`` pipeline and emits PTX; the pipeline cannot be changed.
On WGMMA kernels its function-level SCCP is a third of the optimisation (the accumulators are
``{float x 128}`` structs carried by phis, and SCCP revisits every insertvalue of a chain each
time one field's state changes), while the IPSCCP run before it has already propagated every
constant. :func:`compile_ptx` makes the same steps through the C API of the ``libLLVM`` that
MLIR itself links (so the very same LLVM), with ``O3_PIPELINE``: ``default<O3>`` as LLVM 22
spells it, without that SCCP and without the passes that look for what no Kiln kernel holds
(``IDLE_PASSES``: coroutines, OpenMP, indirect calls, profile data...). The PTX of every
shipped kernel is byte-identical to upstream's (``tests/test_nvptx_llvm.py`` checks kernels
against ``gpu-module-to-binary``). LLVM's
optimisation and code generation run without the GIL (ctypes releases it), so autotune's
threads compile their configs' PTX at the same time.

``KILN_NVPTX_PIPELINE`` picks the path: ``fast`` (default), ``o3`` (``default<O3>`` through the
C API) or ``mlir`` (``gpu-module-to-binary``, also used where the C API is missing or LLVM is
not major version 22). Other ``opt_level`` values always run ``default<O{n}>``.

Example::

    pipeline = pipeline_for(3)          # None: run gpu-module-to-binary instead
    ptx = compile_ptx(gpu_module_op, "sm_90a", "+ptx80", 3, pipeline, profile=state.profile)
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from contextlib import nullcontext
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p

from mlir import ir

from kiln.core import env
from kiln.core.errors import CompilationError

TRIPLE = b"nvptx64-nvidia-cuda"
LLVM_MAJOR = 22  # O3_PIPELINE is LLVM 22's default<O3>; other versions run default<O3>

_SIMPLIFYCFG = ("simplifycfg<bonus-inst-threshold=1;{};keep-loops;no-hoist-common-insts;"
                "no-hoist-loads-stores-with-cond-faulting;no-sink-common-insts;speculate-blocks;"
                "simplify-cond-branch;no-speculate-unpredictables>")
_CFG_EARLY = _SIMPLIFYCFG.format("no-forward-switch-cond;no-switch-range-to-icmp;"
                                 "no-switch-to-arithmetic;no-switch-to-lookup")
_CFG = _SIMPLIFYCFG.format("no-forward-switch-cond;switch-range-to-icmp;no-switch-to-arithmetic;"
                           "no-switch-to-lookup")
_INSTCOMBINE = "instcombine<max-iterations=1;no-verify-fixpoint>"
# LLVM 22's default<O3> for nvptx64 (`opt -O3 -print-pipeline-passes`) less the function
# simplification's `sccp` (after gvn): nothing in it is left for SCCP after IPSCCP.
_O3_LESS_SCCP = ",".join((
    "memprof-remove-attributes,annotation2metadata,forceattrs,nvvm-reflect,"
    "function(nvvm-intr-range),inferattrs,coro-early",
    f"function<eager-inv>(ee-instrument<>,lower-expect,{_CFG_EARLY},sroa<modify-cfg>,early-cse<>,"
    "callsite-splitting)",
    "openmp-opt,ipsccp,called-value-propagation,globalopt",
    f"function<eager-inv>(mem2reg,{_INSTCOMBINE},{_CFG})",
    "always-inline,require<globals-aa>,function(invalidate<aa>),require<profile-summary>",
    "cgscc(devirt<4>(inline,function-attrs<skip-non-recursive-function-attrs>,argpromotion,"
    "openmp-opt-cgscc,function<eager-inv;no-rerun>(sroa<modify-cfg>,early-cse<memssa>,"
    "speculative-execution<only-if-divergent-target>,jump-threading,correlated-propagation,"
    f"{_CFG},{_INSTCOMBINE},aggressive-instcombine,libcalls-shrinkwrap,tailcallelim,{_CFG},"
    "reassociate,constraint-elimination,loop-mssa(loop-instsimplify,loop-simplifycfg,"
    "licm<no-allowspeculation>,loop-rotate<header-duplication;no-prepare-for-lto>,"
    f"licm<allowspeculation>,simple-loop-unswitch<nontrivial;trivial>),{_CFG},{_INSTCOMBINE},"
    "loop(loop-idiom,indvars,extra-simple-loop-unswitch-passes,loop-deletion,loop-unroll-full),"
    "sroa<modify-cfg>,vector-combine,mldst-motion<no-split-footer-bb>,gvn<>,bdce,"
    f"{_INSTCOMBINE},jump-threading,correlated-propagation,adce,memcpyopt,dse,move-auto-init,"
    "loop-mssa(licm<allowspeculation>),coro-elide,simplifycfg<bonus-inst-threshold=1;"
    "no-forward-switch-cond;switch-range-to-icmp;switch-to-arithmetic;no-switch-to-lookup;"
    "keep-loops;hoist-common-insts;no-hoist-loads-stores-with-cond-faulting;sink-common-insts;"
    f"speculate-blocks;simplify-cond-branch;no-speculate-unpredictables>,{_INSTCOMBINE}),"
    "function-attrs,function(require<should-not-run-function-passes>),coro-split,"
    "coro-annotation-elide))",
    "deadargelim,coro-cleanup,globalopt,globaldce,elim-avail-extern,rpo-function-attrs,"
    "recompute-globalsaa",
    "function<eager-inv>(drop-unnecessary-assumes,float2int,lower-constant-intrinsics,chr,"
    "loop(loop-rotate<header-duplication;no-prepare-for-lto>,loop-deletion),loop-distribute,"
    "inject-tli-mappings,loop-vectorize<no-interleave-forced-only;no-vectorize-forced-only;>,"
    f"drop-unnecessary-assumes,infer-alignment,loop-load-elim,{_INSTCOMBINE},"
    "simplifycfg<bonus-inst-threshold=1;forward-switch-cond;switch-range-to-icmp;"
    "switch-to-arithmetic;switch-to-lookup;no-keep-loops;hoist-common-insts;"
    "no-hoist-loads-stores-with-cond-faulting;sink-common-insts;speculate-blocks;"
    "simplify-cond-branch;no-speculate-unpredictables>,slp-vectorizer,vector-combine,"
    f"{_INSTCOMBINE},loop-unroll<O3>,transform-warning,sroa<preserve-cfg>,infer-alignment,"
    f"{_INSTCOMBINE},loop-mssa(licm<allowspeculation>),alignment-from-assumptions,loop-sink,"
    "instsimplify,div-rem-pairs,tailcallelim,simplifycfg<bonus-inst-threshold=1;"
    "no-forward-switch-cond;switch-range-to-icmp;switch-to-arithmetic;no-switch-to-lookup;"
    "keep-loops;no-hoist-common-insts;hoist-loads-stores-with-cond-faulting;"
    "no-sink-common-insts;speculate-blocks;simplify-cond-branch;speculate-unpredictables>)",
    "alloc-token,globaldce,constmerge,cg-profile,rel-lookup-table-converter,"
    "function(annotation-remarks)",
))
# default<O3>'s passes that look for what no Kiln kernel holds, each walking the module (3% of
# the passes' time at prefill D128; every shipped kernel's PTX is the same without them):
IDLE_PASSES = (
    "memprof-remove-attributes", "forceattrs", "ee-instrument<>", "alloc-token",  # attributes
    "cg-profile",  # profile data
    "coro-early", "coro-split", "coro-elide", "coro-cleanup", "coro-annotation-elide",
    "openmp-opt", "openmp-opt-cgscc",
    "called-value-propagation",  # indirect calls
    "libcalls-shrinkwrap",  # library calls: NVPTX has none
    "annotation2metadata", "function(annotation-remarks)", "move-auto-init",  # annotations
    "elim-avail-extern",  # available_externally definitions
    "rel-lookup-table-converter",  # position-independent code
)


def without(pipeline: str, passes: tuple[str, ...]) -> str:
    """``pipeline`` (LLVM's textual form) less every element named in ``passes``, matched
    whole between commas and parentheses, e.g. ``without("a,f(b,c)", ("b",)) == "a,f(c)"``."""
    for name in passes:
        escaped = re.escape(name)  # the element and the comma after it, else the one before
        pipeline = re.sub(rf"(?:(?<=[(,])|^){escaped},|,{escaped}(?=\)|$)", "", pipeline)
    return pipeline


O3_PIPELINE = without(_O3_LESS_SCCP, IDLE_PASSES)


class UntranslatableError(CompilationError):
    """The module holds an op LLVM IR translation does not know (the caller names it)."""


_EXTERNAL, _LINKONCE_ODR, _INTERNAL, _PRIVATE = 0, 3, 8, 9  # LLVMLinkage values
_DEFAULT_VISIBILITY = 0

# name -> (restype, argtypes) of LLVM's C functions used (llvm-c/*.h); ctypes releases the GIL
# during each call
_SIGNATURES = {
    "LLVMGetVersion": (None, [POINTER(c_uint)] * 3),
    "LLVMContextCreate": (c_void_p, []),
    "LLVMContextDispose": (None, [c_void_p]),
    "LLVMDisposeModule": (None, [c_void_p]),
    "LLVMGetTargetFromTriple": (c_int, [c_char_p, POINTER(c_void_p), POINTER(c_void_p)]),
    "LLVMCreateTargetMachine": (c_void_p, [c_void_p, c_char_p, c_char_p, c_char_p, c_int, c_int,
                                           c_int]),
    "LLVMDisposeTargetMachine": (None, [c_void_p]),
    "LLVMCreateTargetDataLayout": (c_void_p, [c_void_p]),
    "LLVMDisposeTargetData": (None, [c_void_p]),
    "LLVMSetModuleDataLayout": (None, [c_void_p, c_void_p]),
    "LLVMSetTarget": (None, [c_void_p, c_char_p]),
    "LLVMCreatePassBuilderOptions": (c_void_p, []),
    "LLVMDisposePassBuilderOptions": (None, [c_void_p]),
    "LLVMPassBuilderOptionsSetLoopUnrolling": (None, [c_void_p, c_int]),
    "LLVMPassBuilderOptionsSetLoopInterleaving": (None, [c_void_p, c_int]),
    "LLVMPassBuilderOptionsSetLoopVectorization": (None, [c_void_p, c_int]),
    "LLVMPassBuilderOptionsSetSLPVectorization": (None, [c_void_p, c_int]),
    "LLVMRunPasses": (c_void_p, [c_void_p, c_char_p, c_void_p, c_void_p]),
    "LLVMGetErrorMessage": (c_void_p, [c_void_p]),
    "LLVMDisposeErrorMessage": (None, [c_void_p]),
    "LLVMDisposeMessage": (None, [c_void_p]),
    "LLVMTargetMachineEmitToMemoryBuffer": (c_int, [c_void_p, c_void_p, c_int, POINTER(c_void_p),
                                                    POINTER(c_void_p)]),
    "LLVMGetBufferStart": (c_void_p, [c_void_p]),
    "LLVMGetBufferSize": (c_size_t, [c_void_p]),
    "LLVMDisposeMemoryBuffer": (None, [c_void_p]),
    "LLVMCreateMemoryBufferWithMemoryRange": (c_void_p, [c_void_p, c_size_t, c_char_p, c_int]),
    "LLVMGetBitcodeModuleInContext2": (c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
    "LLVMLinkModules2": (c_int, [c_void_p, c_void_p]),
    "LLVMGetFirstFunction": (c_void_p, [c_void_p]),
    "LLVMGetNextFunction": (c_void_p, [c_void_p]),
    "LLVMGetFirstGlobal": (c_void_p, [c_void_p]),
    "LLVMGetNextGlobal": (c_void_p, [c_void_p]),
    "LLVMGetValueName2": (c_char_p, [c_void_p, POINTER(c_size_t)]),
    "LLVMIsDeclaration": (c_int, [c_void_p]),
    "LLVMGetLinkage": (c_int, [c_void_p]),
    "LLVMSetLinkage": (None, [c_void_p, c_int]),
    "LLVMSetVisibility": (None, [c_void_p, c_int]),
}


@functools.cache
def _library():
    """libMLIRPythonCAPI with the C functions typed (LLVM's resolve through the libLLVM it
    links), the embedded libdevice as (address, size), and LLVM's version; None without them."""
    try:
        from mlir import _mlir_libs

        lib = ctypes.CDLL(os.path.join(os.path.dirname(_mlir_libs.__file__),
                                       "libMLIRPythonCAPI.so"))
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
        for part in ("TargetInfo", "Target", "TargetMC", "AsmPrinter"):  # idempotent
            getattr(lib, f"LLVMInitializeNVPTX{part}")()
        # Called holding the GIL (PYFUNCTYPE): its diagnostics reach a Python handler.
        lib.translate = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_void_p)(
            ("mlirTranslateModuleToLLVMIR", lib))
        size = c_uint.in_dll(lib, "_mlir_embedded_libdevice_size").value
        libdevice = (ctypes.addressof(ctypes.c_ubyte.in_dll(lib, "_mlir_embedded_libdevice")), size)
    except (OSError, AttributeError, ValueError):  # another MLIR build: upstream's pass instead
        return None
    version = [c_uint() for _ in range(3)]
    lib.LLVMGetVersion(*version)
    return lib, libdevice, tuple(v.value for v in version)


def pipeline_for(opt_level: int) -> str | None:
    """The LLVM pipeline :func:`compile_ptx` runs at ``opt_level`` under ``KILN_NVPTX_PIPELINE``,
    or None where upstream ``gpu-module-to-binary`` compiles instead."""
    choice, loaded = env.nvptx_pipeline(), _library()
    if choice == "mlir" or loaded is None:
        return None
    if choice == "fast" and opt_level == 3 and loaded[2][0] == LLVM_MAJOR:
        return O3_PIPELINE
    return f"default<O{opt_level}>"


def compile_ptx(gpu_module: ir.Operation, chip: str, features: str, opt_level: int,
                pipeline: str, *, profile=None, prefix: str = "") -> str:
    """PTX of ``gpu_module`` (LLVM dialect) for ``chip``: translate, link libdevice's needed
    functions, run ``pipeline`` and emit, as upstream ``gpu-module-to-binary{format=isa}`` does
    (steps timed as ``<prefix>translate``/``link``/``passes``/``codegen`` in ``profile``, a
    :class:`~kiln.core.profile.CompileProfile`)."""
    lib, libdevice, _ = _library()

    def step(name: str):
        return profile.step(prefix + name) if profile is not None else nullcontext()

    context = lib.LLVMContextCreate()
    machine = module = None
    try:
        with step("translate"):
            module = _translate(lib, gpu_module, context)
            machine = _target_machine(lib, chip, features, opt_level)
            _set_layout(lib, module, machine)
        with step("link"):
            _link_libdevice(lib, context, module, machine, libdevice)
        with step("passes"):
            _run_passes(lib, module, machine, pipeline)
        with step("codegen"):
            return _emit(lib, module, machine)
    finally:
        if module:
            lib.LLVMDisposeModule(module)
        if machine:
            lib.LLVMDisposeTargetMachine(machine)
        lib.LLVMContextDispose(context)


def _translate(lib, gpu_module: ir.Operation, context: int) -> int:
    """The LLVM module of ``gpu_module``; its diagnostics go into the error, not to stderr."""
    diagnostics: list[str] = []

    def keep(diagnostic) -> bool:
        diagnostics.append(f"{diagnostic.location}: {diagnostic.message}")
        return True

    handler = gpu_module.context.attach_diagnostic_handler(keep)
    try:
        module = lib.translate(_operation_pointer(gpu_module), context)
    finally:
        handler.detach()
    if not module:
        raise UntranslatableError("MLIR could not translate the kernel to LLVM IR:\n  "
                                  + "\n  ".join(diagnostics or ["no diagnostic"]),
                                  fix="report this Kiln bug with KILN_DUMP_DIR's files")
    return module


_capsule_pointer = ctypes.PYFUNCTYPE(c_void_p, ctypes.py_object, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _operation_pointer(op: ir.Operation) -> int:
    """The ``MlirOperation`` (one pointer) behind a Python ``ir.Operation``."""
    return _capsule_pointer(op._CAPIPtr, b"mlir.ir.Operation._CAPIPtr")


def _target_machine(lib, chip: str, features: str, opt_level: int) -> int:
    target, error = c_void_p(), c_void_p()
    if lib.LLVMGetTargetFromTriple(TRIPLE, byref(target), byref(error)):
        message = _take_message(lib, error)
        raise CompilationError(f"LLVM has no NVPTX target: {message}",
                               fix="use an MLIR build with the NVPTX backend")
    # Relocation and code model 0: LLVM's defaults, as upstream's createTargetMachine({}, {})
    return lib.LLVMCreateTargetMachine(target, TRIPLE, chip.encode(), features.encode(),
                                       opt_level, 0, 0)


def _set_layout(lib, module: int, machine: int) -> None:
    layout = lib.LLVMCreateTargetDataLayout(machine)
    lib.LLVMSetModuleDataLayout(module, layout)
    lib.LLVMDisposeTargetData(layout)
    lib.LLVMSetTarget(module, TRIPLE)


def _globals(lib, module: int):
    """Every function, then every global variable, of ``module``."""
    for first, following in ((lib.LLVMGetFirstFunction, lib.LLVMGetNextFunction),
                             (lib.LLVMGetFirstGlobal, lib.LLVMGetNextGlobal)):
        value = first(module)
        while value:
            yield value
            value = following(value)


def _name(lib, value: int) -> bytes:
    return lib.LLVMGetValueName2(value, byref(c_size_t()))


def _link_libdevice(lib, context: int, module: int, machine: int,
                    libdevice: tuple[int, int]) -> None:
    """Link the libdevice functions ``module`` declares (and what they use), internalised, as
    upstream's ``Linker::LinkOnlyNeeded`` with its internalize callback does: libdevice's
    definitions become ``linkonce_odr`` so the linker takes only the referenced ones."""
    declared = {_name(lib, f) for f in _globals(lib, module) if lib.LLVMIsDeclaration(f)}
    if not any(name.startswith(b"__nv_") for name in declared):  # libdevice defines only __nv_*
        return
    defined = {_name(lib, g) for g in _globals(lib, module) if not lib.LLVMIsDeclaration(g)}
    buffer = lib.LLVMCreateMemoryBufferWithMemoryRange(libdevice[0], libdevice[1],
                                                       b"libdevice", 0)
    source = c_void_p()
    if lib.LLVMGetBitcodeModuleInContext2(context, buffer, byref(source)):  # owns the buffer
        raise CompilationError("LLVM could not read the embedded libdevice",
                               fix="report this Kiln bug (KILN_NVPTX_PIPELINE=mlir avoids it)")
    for value in _globals(lib, source.value):
        if not lib.LLVMIsDeclaration(value) and lib.LLVMGetLinkage(value) == _EXTERNAL:
            lib.LLVMSetLinkage(value, _LINKONCE_ODR)
    _set_layout(lib, source.value, machine)  # libdevice's own triple would only warn
    if lib.LLVMLinkModules2(module, source.value):  # takes the source module
        raise CompilationError("LLVM could not link libdevice into the kernel",
                               fix="report this Kiln bug (KILN_NVPTX_PIPELINE=mlir avoids it)")
    for value in _globals(lib, module):
        if (not lib.LLVMIsDeclaration(value) and _name(lib, value) not in defined
                and lib.LLVMGetLinkage(value) not in (_INTERNAL, _PRIVATE)):
            lib.LLVMSetLinkage(value, _INTERNAL)
            lib.LLVMSetVisibility(value, _DEFAULT_VISIBILITY)


def _run_passes(lib, module: int, machine: int, pipeline: str) -> None:
    options = lib.LLVMCreatePassBuilderOptions()
    try:  # upstream's makeOptimizingTransformer turns all four on
        for knob in ("LoopUnrolling", "LoopInterleaving", "LoopVectorization", "SLPVectorization"):
            getattr(lib, f"LLVMPassBuilderOptionsSet{knob}")(options, 1)
        error = lib.LLVMRunPasses(module, pipeline.encode(), machine, options)
    finally:
        lib.LLVMDisposePassBuilderOptions(options)
    if error:
        text = lib.LLVMGetErrorMessage(error)  # consumes the error
        message = ctypes.string_at(text).decode(errors="replace")
        lib.LLVMDisposeErrorMessage(text)
        raise CompilationError(f"LLVM's pass pipeline failed: {message}",
                               fix="report this Kiln bug (KILN_NVPTX_PIPELINE=mlir avoids it)")


def _emit(lib, module: int, machine: int) -> str:
    error, buffer = c_void_p(), c_void_p()
    if lib.LLVMTargetMachineEmitToMemoryBuffer(machine, module, 0, byref(error), byref(buffer)):
        message = _take_message(lib, error)
        raise CompilationError(f"LLVM's NVPTX backend failed: {message}",
                               fix="report this Kiln bug (KILN_NVPTX_PIPELINE=mlir avoids it)")
    try:
        return ctypes.string_at(lib.LLVMGetBufferStart(buffer),
                                lib.LLVMGetBufferSize(buffer)).decode()
    finally:
        lib.LLVMDisposeMemoryBuffer(buffer)


def _take_message(lib, message: c_void_p) -> str:
    if not message.value:
        return "no message"
    text = ctypes.string_at(message.value).decode(errors="replace")
    lib.LLVMDisposeMessage(message)
    return text
