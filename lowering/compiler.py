"""Compile Kiln IR through the target's ordered stages into a launchable :class:`CompiledKernel`.

Example::

    sig = KernelSignature("saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
                                    ScalarParam("n", "i32"), ScalarParam("a", "f32")))
    ck = compile_kernel(kiln_ir_text, sig, CompileOptions("sm_90a"))
    print(ck.asm["ptx"], ck.metadata["registers"])
    ck.launch((blocks, 1, 1), [x, y, n, 2.0])

The compile cache sits in the runtime (``kiln.runtime.cache.compile_cached`` looks a key up and
stores what this module compiles); launching goes through the driver the facade installs.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

from mlir import ir

from kiln.core import env
from kiln.core.errors import KilnValueError
from kiln.core.options import CompileOptions
from kiln.core.profile import CompileProfile
from kiln.core.targets import Target, get_target
from kiln.driver import installed
from kiln.kernel import kiln_asm
from kiln.lowering import amd, nvidia
from kiln.lowering.dump import dump_prefix, dump_stage, ir_key
from kiln.lowering.pipeline import Backend, CompileState, parse_module
from kiln.passes.cluster_schedule import recipes_of
from kiln.passes.enclosing import gpu_funcs
from kiln.signature import KernelSignature

ARTIFACT_FORMAT = 2  # bump when the cached artifact dict changes shape
BACKENDS: dict[str, Backend] = {b.name: b for b in (nvidia.NvidiaBackend(), amd.AmdBackend())}


def backend_for(target: Target) -> Backend:
    """The vendor :class:`~kiln.lowering.pipeline.Backend` that compiles and launches for
    ``target``, e.g. ``backend_for(get_target("gfx950")).stages``."""
    return BACKENDS[target.vendor]


def stages_for(target: Target) -> dict:
    """The ordered stage functions (name -> fn(state)) for ``target``'s vendor."""
    return backend_for(target).stages


class CompiledKernel:
    """A kernel compiled for one target: every stage's text/bytes plus resource metadata.

    ``asm`` maps stage names, in order, to artifacts (``"kiln"``, ``"gpu"``, ``"nvvm"``/``"rocdl"``,
    ``"llvm"``, ``"ptx"``/``"amdgcn"``, then ``"cubin"`` or ``"obj"``/``"hsaco"`` when made).
    The launcher caches its host-side state on the instance. ``dump_prefix`` starts the names of
    its ``KILN_DUMP_DIR`` files (``lowering/dump.py``).
    """

    def __init__(self, name: str, target: Target, options: CompileOptions,
                 signature: KernelSignature, asm: dict, metadata: dict, dump_prefix: str = ""):
        self.name = name
        self.target = target
        self.options = options
        self.signature = signature
        self.asm = asm
        self.metadata = metadata
        self.dump_prefix = dump_prefix or name
        self._dumped_to: Path | None = None  # the KILN_DUMP_DIR that holds its stages

    @property
    def binary(self) -> str | bytes:
        """What a loader takes: cubin (else PTX text for the driver JIT) or hsaco (else object)."""
        for stage in backend_for(self.target).binary_stages:
            if stage in self.asm:
                return self.asm[stage]
        raise KeyError(f"kernel {self.name!r} has no binary stage")

    def launch(self, grid: tuple[int, int, int], args: Sequence, *, stream=None) -> None:
        """Run on the GPU over ``grid`` blocks; ``args`` follow ``signature.params`` (through
        the runtime's launcher, which the facade installs: ``kiln.runtime.launch.launch``)."""
        installed().launch(self, grid, args, stream=stream)

    def dump_stages(self) -> None:
        """Write every stage under ``KILN_DUMP_DIR`` unless this kernel already did (a cache hit
        runs no stage, so this is where its stages get dumped)."""
        directory = env.dump_dir()
        if directory is None or directory == self._dumped_to:
            return
        for stage, artifact in self.asm.items():
            dump_stage(self.dump_prefix, stage, artifact)
        self._dumped_to = directory

    def to_artifact(self) -> dict:
        """Plain JSON data and bytes (the stage binaries), for the compile cache."""
        metadata = dict(self.metadata)
        if "compile_profile" in metadata:
            metadata["compile_profile"] = list(metadata["compile_profile"])
        return {"format": ARTIFACT_FORMAT, "name": self.name, "target": self.target.name,
                "options": dataclasses.asdict(self.options), "signature": self.signature.to_json(),
                "asm": dict(self.asm), "metadata": metadata}

    @classmethod
    def from_artifact(cls, artifact: dict) -> CompiledKernel | None:
        """Rebuild from :meth:`to_artifact`'s dict; None if it has another format or shape."""
        if not isinstance(artifact, dict) or artifact.get("format") != ARTIFACT_FORMAT:
            return None
        try:
            asm, metadata = artifact["asm"], artifact["metadata"]
            if not (isinstance(asm, dict) and isinstance(metadata, dict)
                    and all(isinstance(v, (str, bytes)) for v in asm.values())):
                return None
            if "compile_profile" in metadata:  # JSON keeps its (step, wall, cpu) rows as lists
                metadata["compile_profile"] = [tuple(row) for row in metadata["compile_profile"]]
            return cls(str(artifact["name"]), get_target(artifact["target"]),
                       CompileOptions(**artifact["options"]),
                       KernelSignature.from_json(artifact["signature"]), asm, metadata)
        except (AttributeError, KeyError, TypeError, ValueError):  # malformed: a miss, not an error
            return None

    def __repr__(self) -> str:
        return f"CompiledKernel({self.name!r}, target={self.target.name}, stages={list(self.asm)})"


def compile_kernel(kiln_ir: str | ir.Module, signature: KernelSignature,
                   options: CompileOptions, *, dump_key: str | None = None,
                   profile: CompileProfile | None = None) -> CompiledKernel:
    """Lower Kiln IR (text, or a traced ``ir.Module``) through every stage of ``options.target``.

    Options and the block shape are validated before MLIR or LLVM sees them. A module (what
    ``TracedKernel.take_module`` hands over) is lowered in place in its own Context, without
    the print and parse of its text: ``asm["kiln"]`` is printed from a copy beside ptxas.
    ``dump_key`` (the cache key, when the runtime compiles for its cache) names the
    ``KILN_DUMP_DIR`` files; without it they are named by a hash of the IR and options. MLIR
    failures raise :class:`~kiln.core.errors.CompilationError` at the user's line, with a
    reproducer command. ``profile`` (e.g. holding the trace already) gets every step's time;
    the kernel's ``metadata["compile_profile"]`` holds its entries.
    """
    target = options.chip
    _check_launch_shape(signature, options, target)
    name, backend = signature.name, backend_for(target)
    profile = profile if profile is not None else CompileProfile()
    module = kiln_ir if isinstance(kiln_ir, ir.Module) else None
    text = None if module is not None else kiln_ir
    if text is None and dump_key is None:  # the dump files are named by the IR's hash
        text = kiln_asm(module)
    prefix = dump_prefix(name, target.name, dump_key or ir_key(text, options.key()))
    metadata: dict = {"target": target.name, "num_warps": options.num_warps, "compile_ms": {},
                      "compile_profile": profile.entries}
    with module.context if module is not None else ir.Context():
        with profile.step("parse"):  # a traced module: only the copy its text is printed from
            if module is None:
                module = parse_module(name, text, dump_prefix=prefix)
                traced = None
            else:
                traced = module.operation.clone() if text is None else None
            recipes = _stamp_target(module, target)
        state = CompileState(name, target, options, signature, module, metadata, profile=profile,
                             dump_prefix=prefix, defer_text=True,
                             defer_proofs=backend.defers_proofs)
        state.scratch["recipes"] = recipes
        if traced is not None:
            state.defer("kiln", lambda: kiln_asm(traced))
        else:
            state.asm["kiln"] = text
            dump_stage(prefix, "kiln", text)
        try:
            for stage, make in backend.stages.items():
                start = time.perf_counter()
                with profile.step(stage):
                    artifact = make(state)
                metadata["compile_ms"][stage] = round((time.perf_counter() - start) * 1e3, 3)
                if artifact is not None:
                    state.asm[stage] = artifact
                    dump_stage(prefix, stage, artifact)
        finally:  # proofs and text left for later (run beside ptxas, else here; also on failure)
            if state.pending():
                with profile.step("text"):
                    state.run_deferred("text")
        backend.check(state, recipes)
    kernel = CompiledKernel(name, target, options, signature, state.asm, metadata, prefix)
    kernel._dumped_to = env.dump_dir()  # each stage was dumped as it was made
    return kernel


def _stamp_target(module: ir.Module, target: Target) -> dict:
    """Tell Kiln's passes which chip each gpu.func is for (``kiln.target``); return the
    cluster recipes declared in the module (cluster -> ClusterRecipe)."""
    recipes: dict = {}
    for func in gpu_funcs(module.operation):
        if "kiln.target" not in func.attributes:
            func.attributes["kiln.target"] = ir.StringAttr.get(target.name)
        recipes.update(recipes_of(func))
    return recipes


# The backends' ISA checks, re-exported for callers that import them from the compiler.
check_amdgpu_assembly, check_sass_schedule = amd.check_amdgpu_assembly, nvidia.check_sass_schedule


def _check_launch_shape(signature: KernelSignature, options: CompileOptions, target: Target) -> None:
    target.check_block(signature.block)
    if signature.num_threads != options.block_size:
        raise KilnValueError(
            f"kernel {signature.name!r} has a block of {signature.num_threads} threads but "
            f"num_warps={options.num_warps} gives {options.block_size} on {target.name}",
            fix="build the signature's block from num_warps * warp_size")
    target.check_shared_bytes(signature.dynamic_shared_bytes)
