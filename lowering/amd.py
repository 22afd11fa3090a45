"""AMD backend: Kiln IR -> gpu -> rocdl -> llvm -> amdgcn -> obj -> hsaco.

The rocdl stage converts the gpu.module to the LLVM dialect with ROCDL intrinsics; LLVM IR is
translated in-process, then optimised and compiled by llvmlite's AMDGPU backend (assembly
and an ELF object, the object in a second process: :func:`make_amdgcn`). ``ld.lld``, when
present, links the object into a loadable ``hsaco``. Resource usage comes from the assembly's
``.amdgpu_metadata`` (the code-object notes' YAML). The assembly-level wait and schedule
proofs run beside the code generation.

Example::

    for name, stage in stages.items():
        artifact = stage(state)        # state.target is gfx942 or gfx950
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from mlir import ir

from kiln.core.errors import CompilationError, UnsupportedError, source_loc_from_mlir
from kiln.lowering import isa_amdgpu
from kiln.lowering import llvmlite_codegen as codegen
from kiln.lowering.metadata import parse_amd_notes
from kiln.lowering.pipeline import Backend, CompileState, make_gpu, run_passes
from kiln.lowering.tools import stage_tool
from kiln.lowering.translate import device_llvm_ir
from kiln.lowering.verify_schedule import verify_schedule

TRIPLE = codegen.TRIPLE
# llvmlite parses into LLVM's one global context and its target machines (llvmlite_codegen)
# are shared; neither is thread-safe, and autotune compiles its configs on a thread pool.
_LLVMLITE_LOCK = threading.Lock()
# LLVM IR below this size is emitted here: faster than a process starts (H200 host: the README's
# saxpy, 3 KB, 0.17 s with one, 0.14 without; a 71 KB GEMM 0.75 s with, 1.01 without).
_OBJECT_PROCESS_BYTES = 32_000


def rocdl_passes(state: CompileState) -> list[str]:
    chip, opt = state.target.name, state.options.opt_level
    return [
        f"rocdl-attach-target{{chip={chip} O={opt}}}",
        "convert-vector-to-scf", "expand-strided-metadata", "lower-affine",
        # Before convert-gpu-to-rocdl turns math ops into ROCm device-library calls.
        "kiln-amdgpu-native-math",
        # f32 -> fp8 casts (4 lanes at most: wider ones leave strided-slice ops with no
        # lowering here) become v_cvt_pk_fp8_f32; LLVM has no fp8 type.
        f"convert-arith-to-amdgpu{{chipset={chip}}}",
        f"gpu.module(convert-scf-to-cf,convert-amdgpu-to-rocdl{{chipset={chip}}},"
        f"convert-gpu-to-rocdl{{chipset={chip} index-bitwidth=64}},canonicalize,cse,"
        "reconcile-unrealized-casts)",
        "reconcile-unrealized-casts",
        "kiln-extern-dynamic-shared",  # static LDS buffers must not sit in the dynamic region
        # Line tables turn the ops' user locations into .loc directives in the assembly, so the
        # assembly-level wait proof names the Python line of a read.
        "ensure-debug-info-scope-on-llvm-func{emission-kind=LineTablesOnly}",
    ]


def _reject_printf(state: CompileState) -> None:
    """kiln.print's gpu.printf needs ROCm's ockl printf (device libraries Kiln does not link);
    name the user's line instead of convert-gpu-to-rocdl's "failed to legalize"."""
    found = []

    def visit(op):
        if op.name == "gpu.printf" and not found:
            found.append(op.location)
        return ir.WalkResult.ADVANCE

    state.module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if found:
        raise UnsupportedError(f"kiln.print is not supported on AMD targets ({state.target.name})",
                               fix="run the kernel in the interpreter (kernel.interpret[grid]"
                                   "(..., target=...)) or on an NVIDIA target to print",
                               loc=source_loc_from_mlir(found[0]))


def make_rocdl(state: CompileState) -> str:
    _reject_printf(state)
    return run_passes(state, "rocdl", rocdl_passes(state))


def make_llvm(state: CompileState) -> str:
    text = device_llvm_ir(state.module, TRIPLE)
    _reject_device_library_calls(state, text)
    return text


def _reject_device_library_calls(state: CompileState, llvm_ir: str) -> None:
    """A call into the ROCm device library (``__ocml_*``/``__ockl_*``) would leave an undefined
    symbol in the code object, which then fails to load: reject it at compile time."""
    missing = sorted(set(re.findall(r"^declare [^@]*@(__oc[km]l_\w+)", llvm_ir, re.MULTILINE)))
    if missing:
        raise CompilationError(
            f"kernel {state.kernel!r} needs ROCm device-library functions Kiln does not link: "
            f"{', '.join(missing)}",
            fix="use operations with a native AMDGPU lowering (exp2, log2, sqrt, rsqrt, fma, "
                "min/max...) or report the missing operation")


def _llvm_error(state: CompileState, err: RuntimeError) -> CompilationError:
    return CompilationError(f"LLVM rejected the IR of kernel {state.kernel!r}: {err}",
                            fix="set KILN_DUMP_DIR and inspect the .ll; report a Kiln bug")


@contextmanager
def _timed(steps: list, name: str) -> Iterator[None]:
    """Append ``(name, wall s, this thread's CPU s)`` of the body to ``steps``."""
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        steps.append((name, time.perf_counter() - wall, time.thread_time() - cpu))


def _emit_beside(state: CompileState, stage: str, emit: Callable, beside: Callable, *,
                 threaded: bool = True):
    """``emit(steps)`` (LLVM's work, under ``_LLVMLITE_LOCK``) on a thread, while this thread
    runs ``beside()`` (Python that no later stage needs, timed as ``<stage>.beside``):
    llvmlite's calls release the GIL, as ptxas runs beside NVIDIA's. The thread's steps enter
    the profile as ``<stage>.<step>`` (CPU: that thread's); its result is returned and its
    error raised, after ``beside``'s own. ``threaded=False`` does the same work one step after
    the other (the serial baseline of ``bench/compile_time.py --serial-llvm`` and the tests)."""
    if not threaded:
        steps: list = []
        with state.step(stage, "beside"):
            beside()
        with _LLVMLITE_LOCK:
            result = emit(steps)
        for name, wall, cpu in steps:
            state.profile.add(f"{stage}.{name}", wall, cpu)
        return result
    done: dict = {"steps": []}

    def run() -> None:
        try:
            with _LLVMLITE_LOCK:
                done["result"] = emit(done["steps"])
        except BaseException as err:  # noqa: BLE001 - raised again on the compiling thread
            done["error"] = err

    worker = threading.Thread(target=run, name=f"kiln-{stage}-{state.kernel}", daemon=True)
    worker.start()
    try:
        with state.step(stage, "beside"):
            beside()
    finally:
        worker.join()
        for name, wall, cpu in done["steps"]:
            state.profile.add(f"{stage}.{name}", wall, cpu)
    if "error" in done:
        raise done["error"]
    return done["result"]


def _optimized(state: CompileState, steps: list) -> str:
    """The O-level-optimised LLVM IR text (made once; call it holding ``_LLVMLITE_LOCK``)."""
    if "optimized_llvm" not in state.scratch:
        with _timed(steps, "optimize"):
            try:
                state.scratch["optimized_llvm"] = codegen.optimize(
                    state.asm["llvm"], state.target.name, state.options.opt_level)
            except RuntimeError as err:
                raise _llvm_error(state, err) from None
    return state.scratch["optimized_llvm"]


def _start_object_process(state: CompileState, work: Path) -> subprocess.Popen | None:
    """Start ``llvmlite_codegen.py``, which emits the object into ``work/kernel.o`` once
    :func:`_hand_over` sends it the optimised IR; None where no process starts, where this
    process may use one CPU only, or for a small module (the object is then emitted here)."""
    if _usable_cpus() < 2 or len(state.asm["llvm"]) < _OBJECT_PROCESS_BYTES:
        return None
    import llvmlite  # the child finds it where this process does

    paths = [str(Path(llvmlite.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
    try:
        with open(work / "stderr", "wb") as stderr:  # a file: a full pipe would block it
            return subprocess.Popen(
                [sys.executable, codegen.__file__, state.target.name,
                 str(state.options.opt_level), str(work / "kernel.o")],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p)))
    except OSError:
        return None


def _usable_cpus() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _hand_over(child: subprocess.Popen | None, optimized: str, work: Path) -> None:
    """Send the optimised IR to the object's process (a dead one is left to make_obj)."""
    if child is None:
        return
    try:
        (work / "kernel.opt.ll").write_text(optimized)
        child.stdin.write(f"{work / 'kernel.opt.ll'}\n".encode())
        child.stdin.close()
    except OSError:  # it ended already (BrokenPipeError): make_obj emits the object
        pass


def make_amdgcn(state: CompileState) -> str:
    """The assembly; verbose (comments on) when the kernel declares clusters, since LLVM
    prints the cluster markers (empty sched_group_barriers) only there. Codegen is identical,
    and emitting only the verbose text saves a whole codegen.

    In a compile that defers its proofs (``compile_kernel``'s), a thread has LLVM optimise and
    emit the assembly while this one makes the deferred texts and proofs (``amdgcn.beside.*``);
    a second process, started meanwhile, emits the ELF object from the optimised IR
    (``amdgcn.object``) while the assembly is emitted and checked (``amdgcn.check.*``).
    ``make_obj`` takes the object."""
    verbose = bool(state.scratch.get("recipes"))
    chip, opt_level = state.target.name, state.options.opt_level

    def emit(steps: list) -> str:
        optimized = _optimized(state, steps)
        _hand_over(child, optimized, work)
        with _timed(steps, "emit"):
            try:
                return codegen.emit(optimized, chip, opt_level, assembly=True, verbose=verbose)
            except RuntimeError as err:
                raise _llvm_error(state, err) from None

    with tempfile.TemporaryDirectory(prefix="kiln-amdgcn-") as tmp:
        work, started = Path(tmp), time.perf_counter()
        child = _start_object_process(state, work) if state.defer_proofs else None
        with _LLVMLITE_LOCK, state.step("amdgcn", "machine"):
            # importing llvmlite needs the GIL throughout: on the thread, beside the texts
            # (C++ printing that holds the GIL), it took 3x as long (H200 host)
            codegen.target_machine(chip, opt_level)
            codegen.target_machine(chip, opt_level, verbose)
        try:
            asm = _emit_beside(state, "amdgcn", emit, lambda: state.run_deferred("amdgcn.beside"))
            # the assembly carries the code object's metadata: no object or llvm-readelf needed
            state.metadata.update(parse_amd_notes(asm, state.kernel))
            state.asm["amdgcn"] = asm
            if state.defer_proofs:
                with state.step("amdgcn", "check"):
                    check_amdgpu_assembly(state, state.scratch.get("recipes") or {},
                                          "amdgcn.check")
            if child is not None:
                child.wait()
                state.profile.add("amdgcn.object", time.perf_counter() - started, 0.0)
                if child.returncode == 0:  # else make_obj emits it here (and meets its error)
                    state.scratch["obj"] = (work / "kernel.o").read_bytes()
        finally:
            if child is not None and child.poll() is None:  # this compile failed first
                child.kill()
                child.wait()
            if child is not None:
                child.stdin.close()
    return asm


def make_obj(state: CompileState) -> bytes:
    """The ELF object make_amdgcn's second process made, else made here."""
    if "obj" in state.scratch:
        return state.scratch.pop("obj")
    with _LLVMLITE_LOCK, state.step("obj", "emit"):
        optimized = _optimized(state, [])
        try:
            return codegen.emit(optimized, state.target.name, state.options.opt_level,
                                assembly=False)
        except RuntimeError as err:
            raise _llvm_error(state, err) from None


def make_hsaco(state: CompileState) -> bytes | None:
    ld_lld = stage_tool("ld.lld")
    if ld_lld is None:
        return None  # the object alone is enough for inspection; launching needs the hsaco
    with tempfile.TemporaryDirectory(prefix="kiln-lld-") as tmp:
        obj_path, hsaco_path = Path(tmp) / "kernel.o", Path(tmp) / "kernel.hsaco"
        obj_path.write_bytes(state.asm["obj"])
        done = subprocess.run([str(ld_lld), "-shared", str(obj_path), "-o", str(hsaco_path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise CompilationError(f"ld.lld failed for kernel {state.kernel!r}:\n{done.stderr.strip()}",
                                   fix="check KILN_LD_LLD points at an LLVM ld.lld with AMDGPU support")
        return hsaco_path.read_bytes()


stages = {"gpu": make_gpu, "rocdl": make_rocdl, "llvm": make_llvm, "amdgcn": make_amdgcn,
          "obj": make_obj, "hsaco": make_hsaco}


def check_amdgpu_assembly(state: CompileState, recipes: dict,
                          step: str = "check-assembly") -> None:
    """The assembly-level proofs: waits cover every load's registers (WaitError), clusters
    match their recipes (ScheduleWarning; the amdgcn stage emitted verbose assembly, which
    holds the cluster markers); live VGPRs per cluster go into the metadata. Timed as
    ``<step>.parse`` etc."""
    with state.step(step, "parse"):
        program = isa_amdgpu.parse(state.asm["amdgcn"], state.kernel)
    with state.step(step, "verify-waits"):
        isa_amdgpu.verify_waits(program, state.kernel)
    if recipes:
        with state.step(step, "verify-schedule"):
            verify_schedule(program, recipes, state.kernel)
            live = isa_amdgpu.live_vgprs_at_clusters(program)
        if live:
            state.metadata["cluster_live_vgprs"] = live


class AmdBackend(Backend):
    """The stages above; the proofs (Kiln's wait proof, the assembly-level ones) run beside
    LLVM's code generation, in :func:`make_amdgcn` (``kiln.runtime.launch`` launches its code
    objects through HIP)."""

    name = "amd"
    stages = stages
    binary_stages = ("hsaco", "obj")
    binary_tool = "ld.lld"
    defers_proofs = True  # make_amdgcn runs them while LLVM optimises and emits

    def check(self, state: CompileState, recipes: dict) -> None:
        """The assembly checks, unless :func:`make_amdgcn` ran them (``defer_proofs``)."""
        if not state.defer_proofs:
            with state.profile.step("check-assembly"):
                check_amdgpu_assembly(state, recipes)
