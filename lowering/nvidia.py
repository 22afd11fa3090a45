"""NVIDIA backend: Kiln IR -> gpu -> nvvm -> llvm -> ptx -> cubin (Triton-backend style).

Each stage is a short function of the shared :class:`~kiln.lowering.pipeline.CompileState`
returning its artifact (text or bytes), or None when it is skipped. The nvvm pass list mirrors
the device half of upstream ``gpu-lower-to-nvvm-pipeline``; PTX comes from the in-process NVPTX
backend (``gpu-module-to-binary{format=isa}``); ``ptxas`` makes the cubin and reports registers.
:class:`NvidiaBackend` adds the SASS schedule check.

Example::

    state = CompileState("saxpy", get_target("sm_90a"), options, signature, module, {})
    for name, stage in stages.items():
        artifact = stage(state)
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from mlir import ir
from mlir.dialects import gpu

from kiln.core import env
from kiln.core.errors import CompilationError
from kiln.lowering import isa_sass, nvptx_llvm
from kiln.lowering.metadata import empty_nvidia_metadata, parse_ptxas_verbose
from kiln.lowering.dump import dump_stage
from kiln.lowering.pipeline import (CANONICALIZE, Backend, CompileState, make_gpu,
                                    run_passes)
from kiln.lowering.tools import stage_tool
from kiln.lowering.translate import device_llvm_module, device_module, translate
from kiln.lowering.verify_schedule import verify_schedule_sass

TRIPLE = "nvptx64-nvidia-cuda"


def nvvm_passes(state: CompileState) -> list[str]:
    options = state.options
    attach = (f"nvvm-attach-target{{chip={state.target.name} features={options.ptx_features()} "
              f"O={options.opt_level}}}")
    flush = ["kiln-flush-f32-denormals"] if options.flush_denormals else []
    # wide accumulators as scalars before the loops become branches (LLVM's SCCP, see the pass)
    scalarize = ["kiln-scalarize-structs"] if env.scalarize_structs() else []
    return [
        *scalarize,
        "convert-nvgpu-to-nvvm",
        "kiln-tma-l2-hints",  # after the conversion that keeps the hint only in a location
        "convert-vector-to-scf", "convert-scf-to-cf",
        "convert-nvvm-to-llvm", "convert-func-to-llvm", "expand-strided-metadata", attach,
        # the regions are simplified once, by llvm-optimize-for-nvvm-target's rewrite driver,
        # and cse runs once, at the end: upstream's IR, its cleanup at half the cost
        "lower-affine", "convert-arith-to-llvm", "convert-index-to-llvm", CANONICALIZE,
        f"gpu.module(convert-gpu-to-nvvm,llvm-optimize-for-nvvm-target,{CANONICALIZE},cse,"
        "reconcile-unrealized-casts)",
        "kiln-extern-dynamic-shared",  # static shared buffers must not sit in the dynamic region
        *flush,
    ]


def make_nvvm(state: CompileState) -> str:
    if state.options.maxnreg is None:
        return run_passes(state, "nvvm", nvvm_passes(state))
    run_passes(state, "nvvm", nvvm_passes(state), text=False)
    state.changing()
    _set_maxnreg(state.module, state.kernel, state.options.maxnreg)
    return state.module_text("nvvm")


def _set_maxnreg(module: ir.Module, kernel: str, maxnreg: int) -> None:
    # Becomes the PTX ".maxnreg" directive, which ptxas honours per kernel.
    def visit(op: ir.Operation):
        if op.name != "llvm.func":
            return ir.WalkResult.ADVANCE
        if ir.StringAttr(op.attributes["sym_name"]).value == kernel:
            op.attributes["nvvm.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), maxnreg)
        return ir.WalkResult.SKIP  # no function inside a function body

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)


def make_llvm(state: CompileState) -> str | None:
    if state.defer_text and nvptx_llvm.pipeline_for(state.options.opt_level) is not None:
        # make_ptx translates the gpu.module itself and changes nothing: the text is made later
        state.defer("llvm", lambda: translate(device_llvm_module(state.module, TRIPLE)))
        return None
    inner = device_llvm_module(state.module, TRIPLE)
    if not state.defer_text:
        return translate(inner)
    state.defer("llvm", lambda: translate(inner))  # no later stage reads the LLVM IR text
    return None


def make_ptx(state: CompileState) -> str:
    options = state.options
    pipeline = nvptx_llvm.pipeline_for(options.opt_level)
    if pipeline is not None:  # the same steps as the pass below, with Kiln's LLVM pipeline
        try:
            return nvptx_llvm.compile_ptx(device_module(state.module), state.target.name,
                                          options.ptx_features(), options.opt_level, pipeline,
                                          profile=state.profile, prefix="ptx.")
        except nvptx_llvm.UntranslatableError:
            device_llvm_module(state.module, TRIPLE)  # names the op LLVM IR has no form for
            raise
    run_passes(state, "ptx", ["gpu-module-to-binary{format=isa}"], text=False)
    for op in state.module.body.operations:
        if op.operation.name == "gpu.binary":
            return gpu.ObjectAttr(op.operation.attributes["objects"][0]).object.decode()
    raise CompilationError("gpu-module-to-binary produced no gpu.binary",
                           fix="report this Kiln bug with the kernel")


def make_cubin(state: CompileState) -> bytes | None:
    state.metadata.update(empty_nvidia_metadata())
    ptxas = stage_tool("ptxas")
    if ptxas is None:
        return None  # the launcher JIT-compiles the PTX through the driver instead
    with tempfile.TemporaryDirectory(prefix="kiln-ptxas-") as tmp:
        ptx_path, cubin_path = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        ptx_path.write_text(state.asm["ptx"])
        command = [str(ptxas), f"-arch={state.target.name}", "-v", f"-O{state.options.opt_level}",
                   str(ptx_path), "-o", str(cubin_path)]
        with state.step("cubin", "ptxas"):  # the deferred text is made while ptxas runs
            process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
            try:
                state.run_deferred("cubin.ptxas")
            finally:
                _, stderr = process.communicate()
        if process.returncode != 0:
            raise CompilationError(
                f"ptxas rejected the PTX of kernel {state.kernel!r}:\n{stderr.strip()}",
                fix="set KILN_DUMP_DIR to inspect the .ptx; if the kernel is valid, report a Kiln bug")
        state.metadata.update(parse_ptxas_verbose(stderr, state.kernel))
        return cubin_path.read_bytes()


stages = {"gpu": make_gpu, "nvvm": make_nvvm, "llvm": make_llvm, "ptx": make_ptx, "cubin": make_cubin}


def check_sass_schedule(state: CompileState, recipes: dict) -> None:
    """The NVIDIA schedule check (ScheduleWarning) on the cubin's SASS; skipped without a
    working ``cuobjdump`` (it is not part of every CUDA install). The listing is dumped as the
    ``sass`` stage under ``KILN_DUMP_DIR``."""
    cuobjdump = stage_tool("cuobjdump")
    sass = isa_sass.dump_sass(state.asm["cubin"], cuobjdump) if cuobjdump is not None else None
    if sass is None:
        return
    dump_stage(state.dump_prefix or state.kernel, "sass", sass)
    verify_schedule_sass(sass, recipes, state.kernel)


class NvidiaBackend(Backend):
    """The stages above and the SASS schedule check (``kiln.runtime.launch`` launches its
    binaries through the CUDA driver)."""

    name = "nvidia"
    stages = stages
    binary_stages = ("cubin", "ptx")  # without ptxas the driver JIT-compiles the PTX
    binary_tool = "ptxas"
    defers_proofs = True  # make_cubin runs them while ptxas runs

    def check(self, state: CompileState, recipes: dict) -> None:
        if recipes and "cubin" in state.asm:
            with state.profile.step("check-sass"):
                check_sass_schedule(state, recipes)
