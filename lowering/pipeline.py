"""The :class:`Backend` interface and running one stage's pass list, turning MLIR diagnostics
into :class:`CompilationError`.

A failing stage saves its input module (with locations) as a reproducer and the error message
carries the exact ``kiln-opt`` command that replays the failure.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mlir import ir

from kiln.core.errors import CompilationError, SourceLoc, source_loc_from_mlir
from kiln.lowering.dump import dump_stage, write_reproducer
from kiln.core.options import CompileOptions
from kiln.core.profile import CompileProfile
from kiln.signature import KernelSignature
from kiln.core.targets import Target
from kiln.lowering.tools import kiln_opt_command
from kiln.passes import build_pass_manager, pipeline_text
from kiln.passes.enclosing import func_vendor, gpu_funcs
from kiln.passes.insert_waits import recording_proofs

# Passes every target runs first, on Kiln IR: Kiln's own rewrites, cleanup, then the waits
# (after cleanup, so they see the final op order) and their proof (docs/passes.md).
# Kiln IR is structured (a block per region): canonicalize without region simplification
# (block merging, dead block arguments), a quarter of its time; the same IR on every kernel.
CANONICALIZE = "canonicalize{region-simplify=disabled}"
GPU_STAGE_PASSES = ("kiln-fold-block-dim", "kiln-cluster-schedule", CANONICALIZE, "cse",
                    "kiln-insert-waits", "kiln-verify-waits")
# Passes that only prove and change nothing: a backend with ``defers_proofs`` runs them on a
# copy beside its binary tool (ptxas), off the compile's critical path.
VERIFY_WAITS, VERIFY_RINGS = "kiln-verify-waits", "kiln-verify-rings"
PROOF_PASSES = frozenset({VERIFY_WAITS})


@dataclass
class CompileState:
    """What the stages of one compile share. ``module`` is rewritten in place by MLIR stages;
    ``scratch`` holds objects a later stage reuses (e.g. the optimised llvmlite module);
    ``profile`` times the steps inside a stage (``"<stage>.<step>"``)."""

    kernel: str
    target: Target
    options: CompileOptions
    signature: KernelSignature
    module: ir.Module
    metadata: dict
    asm: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)
    profile: CompileProfile = field(default_factory=CompileProfile)
    dump_prefix: str = ""  # start of KILN_DUMP_DIR file names (lowering/dump.py); "" = kernel
    # Make text artifacts no later stage reads (printed modules, LLVM IR) after the stages,
    # from copies, while ptxas runs: printing costs as much as a pass (compile_kernel sets it).
    defer_text: bool = False
    deferred: list = field(default_factory=list)  # (stage, fn() -> artifact), in stage order
    # Run PROOF_PASSES later, with the deferred text (a failing proof still fails the compile).
    defer_proofs: bool = False
    proofs: list = field(default_factory=list)  # (stage, pass names, module copy)
    # A clone of ``module`` as it is now, shared by the deferred text, the proofs and the next
    # stage's reproducer (none of them changes it); None once ``module`` may have changed.
    _copy: ir.Operation | None = field(default=None, repr=False)

    def step(self, stage: str, name: str):
        """Time a step of ``stage`` in the profile."""
        return self.profile.step(f"{stage}.{name}")

    def copy(self, stage: str, name: str) -> ir.Operation:
        """A clone of the module as it is now (timed as ``<stage>.<name>`` when made), shared
        until :meth:`changing`: the readers of one module state share one clone. Readers
        must not change it (a failing stage replays its passes on a clone of it)."""
        if self._copy is None:
            with self.step(stage, name):
                self._copy = self.module.operation.clone()
        return self._copy

    def changing(self) -> None:
        """Say that ``module`` is about to change: the next :meth:`copy` clones it again."""
        self._copy = None

    def module_text(self, stage: str) -> str | None:
        """The module's text as ``stage``'s artifact: printed now, or (``defer_text``) from a
        copy that :meth:`run_deferred` prints, returning None."""
        if not self.defer_text:
            with self.step(stage, "print"):
                return str(self.module)
        copy = self.copy(stage, "copy")
        self.defer(stage, lambda: str(copy))
        return None

    def defer(self, stage: str, make: Callable[[], str | bytes]) -> None:
        """Make ``stage``'s artifact later (:meth:`run_deferred`); its slot in ``asm`` keeps the
        stage order."""
        self.asm[stage] = None
        self.deferred.append((stage, make))

    def defer_proof(self, stage: str, elements: Sequence[str]) -> None:
        """Run the proof passes ``elements`` of ``stage`` later (:meth:`run_deferred`), on a
        copy of the module as it is now."""
        self.proofs.append((stage, tuple(elements), self.copy(stage, "proof-copy")))

    def pending(self) -> bool:
        """Whether proofs or artifacts wait for :meth:`run_deferred`."""
        return bool(self.proofs or self.deferred)

    def run_deferred(self, step: str) -> list[str]:
        """Make the deferred artifacts (timed as ``<step>.<stage>``), then run the deferred
        proofs (timed as ``<step>.<pass>``; the first failing one raises) on the copies the
        texts were printed from; the stages made."""
        made = []
        while self.deferred:
            stage, make = self.deferred.pop(0)
            with self.profile.step(f"{step}.{stage}"):
                self.asm[stage] = make()
            dump_stage(self.dump_prefix or self.kernel, stage, self.asm[stage])
            made.append(stage)
        while self.proofs:
            stage, elements, module = self.proofs.pop(0)
            _prove(self, stage, elements, module, step)
        return made


def make_gpu(state: CompileState) -> str:
    """Every backend's first stage: Kiln's passes on Kiln IR (the proofs later, on a copy,
    when ``state.defer_proofs``). Where kiln-insert-waits' last walk of every function found
    no gap, kiln-verify-waits would repeat that walk on the unchanged module: only its ring
    proof, ``kiln-verify-rings``, runs."""
    rewrites = [name for name in GPU_STAGE_PASSES if name not in PROOF_PASSES]
    with recording_proofs() as proved:
        text = run_passes(state, "gpu", rewrites, text=state.defer_proofs)
    proofs = [name for name in GPU_STAGE_PASSES if name in PROOF_PASSES]
    if proofs and _all_proved(state.module, proved):
        proofs = [VERIFY_RINGS if name == VERIFY_WAITS else name for name in proofs]
    if not state.defer_proofs:
        return run_passes(state, "gpu", proofs) if proofs else state.module_text("gpu")
    if proofs:
        state.defer_proof("gpu", proofs)
    return text


def _all_proved(module: ir.Module, proved: set) -> bool:
    """Whether kiln-insert-waits proved every vendor function of ``module``."""
    funcs = [f for f in gpu_funcs(module.operation) if func_vendor(f) is not None]
    return bool(funcs) and all(f in proved for f in funcs)


class Backend(ABC):
    """One vendor's compiler, Triton-style: ``stages`` (name -> ``fn(state)`` returning the
    artifact or None, in order), the ISA checks, ``binary_stages`` (what a loader takes, preferred
    first) and ``binary_tool`` (the tool making the first). The compile loop and
    :class:`~kiln.lowering.compiler.CompiledKernel` call only these; the runtime keeps one
    launcher per backend ``name`` (``kiln.runtime.launch.LAUNCHERS``), since launching needs the
    driver glue of the layer above.

    Example: ``for name, make in backend_for(get_target("gfx950")).stages.items(): make(state)``.
    """

    name: str
    stages: dict[str, Callable[[CompileState], str | bytes | None]]
    binary_stages: tuple[str, ...]
    binary_tool: str
    defers_proofs = False  # a stage runs CompileState.run_deferred beside a tool (ptxas, codegen)

    @abstractmethod
    def check(self, state: CompileState, recipes: dict) -> None:
        """The ISA-level proofs on the finished stages, given the cluster recipes."""


def run_passes(state: CompileState, stage: str, elements: Sequence[str], *,
               text: bool = True) -> str | None:
    """Run ``elements`` on ``state.module``; return the module's text afterwards (with
    ``text``; printing a large module costs as much as a pass)."""
    # A copy of the input for the reproducer, printed only when the stage fails: cloning
    # costs a tenth of printing (the previous stage's text copy when there is one).
    before = state.copy(stage, "snapshot")
    state.changing()
    # Verified after Kiln's own passes and once at the end, not after every upstream pass (a
    # third of the nvvm stage); a failure is replayed verifying after every pass.
    pm = build_pass_manager(elements, timer=lambda name: state.step(stage, f"passes.{name}"),
                            verify_each=False)
    try:
        with state.step(stage, "passes"):
            pm.run(state.module.operation)
        with state.step(stage, "verify"):
            state.module.operation.verify()
    except ir.MLIRError as err:
        text = before.get_asm(enable_debug_info=True)
        raise stage_error(state.kernel, stage, _replayed_error(before.clone(), elements) or err,
                          text, elements, dump_prefix=state.dump_prefix) from None
    return state.module_text(stage) if text else None


def _prove(state: CompileState, stage: str, elements: Sequence[str], module: ir.Operation,
           step: str) -> None:
    """Run the proof passes ``elements`` of ``stage`` on ``module`` (a copy; a proof raises
    its own KilnError, a pass failure becomes the stage's CompilationError)."""
    pm = build_pass_manager(elements, timer=lambda name: state.profile.step(f"{step}.{name}"),
                            verify_each=False)
    try:
        pm.run(module)
    except ir.MLIRError as err:
        text = module.get_asm(enable_debug_info=True)
        raise stage_error(state.kernel, stage, _replayed_error(module.clone(), elements) or err,
                          text, elements, dump_prefix=state.dump_prefix) from None


def _replayed_error(module: ir.Operation, elements: Sequence[str]) -> ir.MLIRError | None:
    """The error of ``elements`` rerun on ``module`` verifying after every pass, else None."""
    try:
        build_pass_manager(elements).run(module)
    except ir.MLIRError as err:
        return err
    return None


def stage_error(kernel: str, stage: str, err: ir.MLIRError, module_text: str,
                elements: Sequence[str], *, dump_prefix: str = "") -> CompilationError:
    """A CompilationError at the user line of the first diagnostic, with a reproducer command."""
    path = write_reproducer(dump_prefix or kernel, stage, module_text)
    command = (f"{kiln_opt_command()} {shlex.quote(str(path))} "
               f"--pass-pipeline={shlex.quote(pipeline_text(elements))}")
    details = format_diagnostics(err)
    return CompilationError(
        f"the {stage!r} stage failed for kernel {kernel!r}:\n{details}\nreproduce with:\n  {command}",
        fix="the diagnostic above names the construct MLIR rejected; if it is not in your "
            "kernel, report a Kiln bug with the reproducer file",
        loc=first_user_location(err), reproducer=str(path))


def format_diagnostics(err: ir.MLIRError) -> str:
    """MLIR's own text for every error diagnostic and its notes, one per line."""
    lines = []
    for diag in err.error_diagnostics:
        lines.append(f"  error: {diag.location}: {diag.message}")
        lines.extend(f"    note: {note.location}: {note.message}" for note in diag.notes)
    return "\n".join(lines) or f"  error: {err}"


def first_user_location(err: ir.MLIRError) -> SourceLoc | None:
    """The first file:line:col location among the diagnostics (and their notes)."""
    for diag in err.error_diagnostics:
        for candidate in (diag, *diag.notes):
            loc = source_loc_from_mlir(candidate.location)
            if loc is not None:
                return loc
    return None


def parse_module(kernel: str, text: str, *, dump_prefix: str = "") -> ir.Module:
    """Parse (and verify) Kiln IR in the active Context; errors become CompilationError."""
    try:
        return ir.Module.parse(text)
    except ir.MLIRError as err:
        raise stage_error(kernel, "kiln", err, text, (), dump_prefix=dump_prefix) from None
