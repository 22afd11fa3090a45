"""A cold compile's critical path: the traced module is lowered without printing and parsing
its text, and the wait proof runs on a copy beside ptxas. Neither may change an artifact or
let a wrong kernel through."""

from __future__ import annotations

import functools
import gc
import inspect
import subprocess
import sys
import threading

import numpy as np
import pytest
from mlir import ir

import kiln
import kiln.cp_async as cp_async
import kiln.tiles as tiles
from kiln.cluster import manual_waits
from kiln.core.errors import CompilationError, InternalError, WaitError
from kiln.core.options import CompileOptions
from kiln.kernel import JITKernel
from kiln.lowering import amd, compiler, nvidia, pipeline
from kiln.lowering.compiler import compile_kernel
from kiln.lowering.tools import find_ptxas

pytestmark = pytest.mark.lower


@kiln.kernel
def staged_copy(x: kiln.Tensor[kiln.bf16, 2], out: kiln.Tensor[kiln.bf16], rows: kiln.i32,
                MANUAL: kiln.constexpr, WAIT: kiln.constexpr = False):
    if MANUAL:
        manual_waits()  # and, without WAIT, no cp_async.wait: the read below is uncovered
    s = tiles.SharedTile((16, 64), kiln.bf16)
    src = tiles.GlobalTile(x, (16, 64), (kiln.block_id(0) * 16, 0), row_end=rows)
    r = kiln.thread_id(0) % 16
    group = cp_async.commit([cp_async.copy(s, (r, 0), src, (r, 0), width=8)])
    if WAIT:
        cp_async.wait(group)
    kiln.barrier()
    out.store(0, s.load(r, 0, width=8))  # READ_LINE


READ_LINE = next(n for n, line in enumerate(inspect.getsource(inspect.getmodule(staged_copy))
                                            .splitlines(), 1) if line.endswith("# READ_LINE"))


def _args():
    rows = int(np.random.default_rng().integers(17, 64))
    return (np.random.rand(rows, 64).astype(kiln.bf16.numpy), np.zeros(8, kiln.bf16.numpy), rows)


def _steps(kernel) -> list[str]:
    return [name for name, _, _ in kernel.metadata["compile_profile"]]


def test_traced_module_compiles_to_the_artifacts_of_its_text(monkeypatch):
    """Lowering the traced module in place gives every stage of the text's compile, byte for
    byte; the kiln text is the trace's own print."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    args = _args()
    traced = staged_copy.trace(*args, MANUAL=False, target="sm_90a")
    text = traced.module_asm
    options = CompileOptions("sm_90a")
    from_text = compile_kernel(text, traced.signature, options)
    held = staged_copy.trace(*args, MANUAL=False, target="sm_90a")
    module = held.take_module()
    assert isinstance(module, ir.Module)
    from_module = compile_kernel(module, held.signature, options)
    assert list(from_module.asm) == list(from_text.asm)
    for stage in ("kiln", "gpu", "nvvm", "llvm", "ptx"):
        assert from_module.asm[stage] == from_text.asm[stage], stage
    assert from_module.asm["kiln"] == text
    assert "parse" in _steps(from_module)


def test_a_handed_over_module_has_no_text_and_a_printed_one_is_not_handed_over():
    traced = staged_copy.trace(*_args(), MANUAL=False, target="sm_90a")
    assert traced.take_module() is not None
    assert traced.take_module() is None  # handed over once
    with pytest.raises(InternalError, match="asm\\['kiln'\\]"):
        traced.module_asm
    printed = staged_copy.trace(*_args(), MANUAL=False, target="sm_90a")
    assert "nvgpu.device_async_copy" in printed.module_asm
    assert printed.take_module() is None  # the compiler then parses the text
    assert printed.module_asm.startswith("#loc") or "module" in printed.module_asm


def test_the_wait_proof_runs_beside_ptxas_or_after_the_stages(monkeypatch):
    """With waits of its own (manual) the kernel's whole proof runs beside ptxas; where
    kiln-insert-waits placed them, its last walk already proved them and only the ring proof
    is left (kiln-verify-rings). Both place the same wait in the PTX."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    where = "cubin.ptxas" if find_ptxas() is not None else "text"
    manual = staged_copy.compile(*_args(), MANUAL=True, WAIT=True, target="sm_90a")
    inserted = staged_copy.compile(*_args(), MANUAL=False, target="sm_90a")
    for ck, proof, skipped in ((manual, "kiln-verify-waits", "kiln-verify-rings"),
                               (inserted, "kiln-verify-rings", "kiln-verify-waits")):
        steps = _steps(ck)
        assert f"{where}.{proof}" in steps and f"{where}.kiln" in steps
        assert not any(step.endswith(skipped) for step in steps)
        assert f"gpu.passes.{proof}" not in steps  # not on the critical path
        assert "cp.async.wait_group" in ck.asm["ptx"]
    assert "gpu.passes.kiln-insert-waits" in _steps(inserted)


def test_a_missing_wait_still_fails_the_compile_at_the_read(monkeypatch):
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    with pytest.raises(WaitError) as caught:
        staged_copy.compile(*_args(), MANUAL=True, target="sm_90a")
    assert caught.value.loc.line == READ_LINE
    assert "cp_async" in caught.value.message or "device_async_copy" in caught.value.message


def test_the_proof_error_wins_over_a_later_stage_failure(monkeypatch):
    """The proof ran before the later stages once; a failure there must not hide its error."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")

    def broken_ptx(state):
        raise CompilationError("planted ptx failure", fix="none")

    monkeypatch.setitem(nvidia.NvidiaBackend.stages, "ptx", broken_ptx)
    with pytest.raises(WaitError) as caught:
        staged_copy.compile(*_args(), MANUAL=True, target="sm_90a")
    assert caught.value.loc.line == READ_LINE
    with pytest.raises(CompilationError, match="planted ptx failure"):  # a sound kernel
        staged_copy.compile(*_args(), MANUAL=False, target="sm_90a", num_warps=2)


def test_a_failing_deferred_proof_is_the_gpu_stage_error_with_a_reproducer(monkeypatch,
                                                                          tmp_path):
    from kiln import passes

    def refuse(op, pass_):
        pass_.signal_pass_failure()

    monkeypatch.setitem(passes._REGISTRY, "kiln-test-refuse",
                        passes.KilnPass("kiln-test-refuse", refuse, "test: a failing proof"))
    monkeypatch.setattr(pipeline, "GPU_STAGE_PASSES",
                        pipeline.GPU_STAGE_PASSES + ("kiln-test-refuse",))
    monkeypatch.setattr(pipeline, "PROOF_PASSES", pipeline.PROOF_PASSES | {"kiln-test-refuse"})
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    with pytest.raises(CompilationError, match="the 'gpu' stage failed") as caught:
        staged_copy.compile(*_args(), MANUAL=False, target="sm_90a", num_warps=8)
    assert "kiln-test-refuse" in str(caught.value)
    reproducer = open(caught.value.reproducer).read()
    assert "nvgpu.device_async_wait" in reproducer  # the proof's input: waits inserted


def test_one_clone_serves_the_gpu_text_its_proof_and_the_next_reproducer(monkeypatch):
    """The module after the gpu stage is cloned once: its deferred text, the ring proof and
    the nvvm stage's reproducer copy share it (none changes it)."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    ck = staged_copy.compile(*_args(), MANUAL=False, target="sm_90a")
    steps = _steps(ck)
    assert steps.count("gpu.copy") == 1 and "gpu.snapshot" in steps and "nvvm.copy" in steps
    assert "gpu.proof-copy" not in steps and "nvvm.snapshot" not in steps
    assert "nvgpu.device_async_wait" in ck.asm["gpu"] and "llvm.func" in ck.asm["nvvm"]


def test_a_failing_stage_replays_on_its_own_copy_of_the_shared_clone(monkeypatch, tmp_path):
    """The nvvm stage's reproducer copy is the gpu stage's text copy: replaying the failing
    passes on it must leave both the reproducer and the gpu text as the gpu stage made them."""
    from kiln import passes

    def mangle_then_fail(op, pass_):
        op.attributes["kiln.mangled"] = ir.UnitAttr.get()
        pass_.signal_pass_failure()

    monkeypatch.setitem(passes._REGISTRY, "kiln-test-mangle",
                        passes.KilnPass("kiln-test-mangle", mangle_then_fail, "test: fails"))
    monkeypatch.setattr(nvidia, "nvvm_passes", lambda state: ["kiln-test-mangle"])
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    with pytest.raises(CompilationError, match="the 'nvvm' stage failed") as caught:
        staged_copy.compile(*_args(), MANUAL=False, target="sm_90a", num_warps=2)
    reproducer = open(caught.value.reproducer).read()
    assert "nvgpu.device_async_wait" in reproducer and "kiln.mangled" not in reproducer
    gpu_texts = [path.read_text() for path in tmp_path.rglob("*gpu*") if path.is_file()]
    assert gpu_texts and all("kiln.mangled" not in text for text in gpu_texts)
    assert any("nvgpu.device_async_wait" in text for text in gpu_texts)


def test_canonicalize_without_region_simplification_gives_upstreams_artifacts(monkeypatch):
    """The gpu and nvvm stages' canonicalize skips region simplification and the nvvm stage
    runs one cse (llvm-optimize-for-nvvm-target's rewrite driver simplifies the regions):
    upstream's lists (full canonicalize, cse twice) give the same text at every stage."""
    from kiln.kernels.attention.combine import compile_combine

    monkeypatch.setenv("KILN_NO_CACHE", "1")
    ours = compile_combine(target="sm_90a")
    full = "canonicalize"
    monkeypatch.setattr(pipeline, "GPU_STAGE_PASSES", tuple(
        full if name == pipeline.CANONICALIZE else name for name in pipeline.GPU_STAGE_PASSES))
    kiln_list = nvidia.nvvm_passes

    def upstream_list(state):
        names = [name.replace(pipeline.CANONICALIZE, full) for name in kiln_list(state)]
        at = names.index(full)
        names[at + 1:at + 1] = ["cse"]
        assert "region-simplify" not in " ".join(names) and names[at + 2].count(",cse,") == 1
        return names

    monkeypatch.setattr(nvidia, "nvvm_passes", upstream_list)
    for obj in gc.get_objects():  # compile again: no in-memory specialisation
        if isinstance(obj, JITKernel):
            obj._compiled.clear()
    upstream = compile_combine(target="sm_90a")
    assert upstream is not ours
    for stage in ("gpu", "nvvm", "llvm", "ptx"):
        assert ours.asm[stage] == upstream.asm[stage], stage


@kiln.kernel
def scale(x: kiln.Tensor[kiln.f32], y: kiln.Tensor[kiln.f32]):
    i = kiln.thread_id(0)
    y[i] = x[i] * 3.0


@pytest.fixture
def fresh_scale(monkeypatch):
    """``scale`` compiled anew by each call (no in-memory specialisation, no cache)."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    scale._compiled.clear()
    yield
    scale._compiled.clear()


@pytest.fixture
def object_processes(monkeypatch):
    """The second processes AMD compiles start for their objects (they run as usual), for
    modules of any size."""
    monkeypatch.setattr(amd, "_OBJECT_PROCESS_BYTES", 0)
    started = []
    real = amd._start_object_process

    def recording(state, work):
        process = real(state, work)
        started.append(process)
        return process

    monkeypatch.setattr(amd, "_start_object_process", recording)
    return started


def _codegen_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kiln-amdgcn-")]


def _compile_scale():
    x = np.random.rand(64).astype(np.float32)
    return scale.compile(x, np.zeros_like(x), target="gfx950", num_warps=1)


def test_amd_overlaps_its_codegen_with_the_same_artifacts(monkeypatch, fresh_scale,
                                                          object_processes):
    """An AMD compile emits the object in a second process while a thread has LLVM emit the
    assembly and this one makes the wait proof and the stage texts, then the assembly checks
    (as NVIDIA's beside ptxas): not in the gpu stage, and every artifact and metadata value is
    the one the same steps make one after the other."""
    assert compiler.BACKENDS["nvidia"].defers_proofs and compiler.BACKENDS["amd"].defers_proofs
    ck = _compile_scale()
    steps = _steps(ck)
    assert {"amdgcn.beside.kiln-verify-rings", "amdgcn.beside.kiln", "amdgcn.beside.rocdl",
            "amdgcn.optimize", "amdgcn.emit", "amdgcn.object", "amdgcn.check.verify-waits"} \
        <= set(steps)
    assert "gpu.passes.kiln-verify-rings" not in steps  # off the critical path
    assert "obj.emit" not in steps  # the second process made it
    assert [s for s in steps if "." not in s][-3:] == ["amdgcn", "obj", "hsaco"]
    assert len(object_processes) == 1 and object_processes[0].returncode == 0
    assert not _codegen_threads()
    monkeypatch.setattr(amd, "_emit_beside",
                        functools.partial(amd._emit_beside, threaded=False))
    monkeypatch.setattr(amd, "_start_object_process", lambda state, work: None)
    scale._compiled.clear()
    serial = _compile_scale()
    assert "obj.emit" in _steps(serial)
    assert list(serial.asm) == list(ck.asm)
    for stage, artifact in serial.asm.items():
        assert ck.asm[stage] == artifact, stage
    for key, value in serial.metadata.items():
        assert key in ("compile_profile", "compile_ms") or ck.metadata[key] == value, key


def test_a_small_module_emits_its_object_here(fresh_scale):
    """A module smaller than ``_OBJECT_PROCESS_BYTES`` of LLVM IR is emitted faster than a
    process starts."""
    ck = _compile_scale()
    assert len(ck.asm["llvm"]) < amd._OBJECT_PROCESS_BYTES
    assert "obj.emit" in _steps(ck) and "amdgcn.object" not in _steps(ck)


def test_a_failed_object_process_leaves_the_object_to_this_one(monkeypatch, fresh_scale):
    """Where the second process fails (no interpreter, a crash), the object is emitted here:
    the same bytes."""
    reference = _compile_scale()

    def failing(state, work):  # started whatever the module's size
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"],
                                stdin=subprocess.PIPE)

    monkeypatch.setattr(amd, "_start_object_process", failing)
    scale._compiled.clear()
    ck = _compile_scale()
    assert "obj.emit" in _steps(ck)
    assert ck.asm["obj"] == reference.asm["obj"]
    assert ck.asm.get("hsaco") == reference.asm.get("hsaco")  # none where ld.lld is missing


def test_an_amd_codegen_failure_on_its_thread_is_raised_by_the_compile(monkeypatch, fresh_scale,
                                                                      object_processes):
    def broken(state, steps):
        raise CompilationError("planted codegen failure", fix="none")

    monkeypatch.setattr(amd, "_optimized", broken)
    with pytest.raises(CompilationError, match="planted codegen failure"):
        _compile_scale()
    assert not _codegen_threads()  # joined before the error left the stage
    assert [p.poll() is not None for p in object_processes] == [True]  # ended, reaped


def test_an_amd_proof_failure_wins_over_its_codegen_failure(monkeypatch, fresh_scale,
                                                            object_processes):
    """Beside a failing codegen, a failing wait proof is the error (as it was when the proof
    ran in the gpu stage, before any codegen)."""
    from kiln import passes

    def refuse(op, pass_):
        pass_.signal_pass_failure()

    def broken(state, steps):
        raise CompilationError("planted codegen failure", fix="none")

    monkeypatch.setitem(passes._REGISTRY, "kiln-test-refuse",
                        passes.KilnPass("kiln-test-refuse", refuse, "test: a failing proof"))
    monkeypatch.setattr(pipeline, "GPU_STAGE_PASSES",
                        pipeline.GPU_STAGE_PASSES + ("kiln-test-refuse",))
    monkeypatch.setattr(pipeline, "PROOF_PASSES", pipeline.PROOF_PASSES | {"kiln-test-refuse"})
    monkeypatch.setattr(amd, "_optimized", broken)
    with pytest.raises(CompilationError, match="the 'gpu' stage failed") as caught:
        _compile_scale()
    assert "kiln-test-refuse" in str(caught.value)
    assert not _codegen_threads()
    assert [p.poll() is not None for p in object_processes] == [True]


def test_a_one_cpu_process_emits_the_object_itself(monkeypatch, fresh_scale, object_processes):
    monkeypatch.setattr(amd, "_usable_cpus", lambda: 1)
    ck = _compile_scale()
    assert object_processes == [None]
    assert "obj.emit" in _steps(ck) and "amdgcn.object" not in _steps(ck)
    assert ck.asm["obj"].startswith(b"\x7fELF")
