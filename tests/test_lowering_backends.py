"""The vendor backends: compile_kernel and CompiledKernel ask ``backend_for(target)`` for stages,
checks and binaries, and the runtime's launch asks ``LAUNCHERS[backend.name]``, with no vendor
branch of their own."""

from pathlib import Path

import pytest

from kiln.lowering import amd, compiler, nvidia
from kiln.lowering.compiler import CompiledKernel, backend_for, compile_kernel, stages_for
from kiln.core.options import CompileOptions
from kiln.lowering.pipeline import Backend
from kiln.signature import KernelSignature, ScalarParam, TensorParam
from kiln.core.targets import TARGETS, get_target
from kiln.runtime import launch as launch_mod

SAXPY_IR = (Path(__file__).parent / "lit" / "lowering" / "Inputs" / "saxpy.mlir").read_text()
SAXPY = KernelSignature("saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
                                  ScalarParam("n", "i32"), ScalarParam("a", "f32")), block=(128, 1, 1))


class RecordingBackend(Backend):
    """A backend whose two stages and check only record what the compile loop hands them."""

    name = "nvidia"
    binary_stages = ("bin", "gpu")
    binary_tool = "ptxas"

    def __init__(self):
        self.calls = []
        self.stages = {"gpu": self._stage("gpu", "gpu text"), "ptx": self._stage("ptx", None)}

    def _stage(self, name, artifact):
        def make(state):
            self.calls.append((name, sorted(state.asm)))
            return artifact
        return make

    def check(self, state, recipes):
        self.calls.append(("check", sorted(state.asm)))

    def launcher(self, ck):
        def launch(flat, grid, stream):
            self.calls.append(("launch", list(flat), grid, stream))
        return launch, None


@pytest.fixture
def recording(monkeypatch):
    backend = RecordingBackend()
    monkeypatch.setitem(compiler.BACKENDS, "nvidia", backend)
    monkeypatch.setitem(launch_mod.LAUNCHERS, "nvidia", backend.launcher)
    monkeypatch.delenv("KILN_DUMP_DIR", raising=False)
    return backend


def test_every_target_has_its_vendor_backend():
    for target in TARGETS.values():
        backend = backend_for(target)
        assert backend.name == target.vendor and stages_for(target) is backend.stages
    assert isinstance(backend_for(get_target("sm_90a")), nvidia.NvidiaBackend)
    assert list(backend_for(get_target("gfx950")).stages) == list(amd.stages)
    with pytest.raises(TypeError):
        Backend()  # check is abstract


def test_compile_loop_runs_only_the_backends_stages_then_its_check(recording):
    ck = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    assert recording.calls == [("gpu", ["kiln"]), ("ptx", ["gpu", "kiln"]),
                               ("check", ["gpu", "kiln"])]
    assert list(ck.asm) == ["kiln", "gpu"]  # a stage returning None is skipped
    assert ck.binary == "gpu text"  # the first of the backend's binary stages that exists


def test_launch_uses_the_runtimes_launcher_for_the_backend(recording):
    signature = KernelSignature("k", (ScalarParam("n", "i32"),), block=(128, 1, 1))
    ck = CompiledKernel("k", get_target("sm_90a"), CompileOptions("sm_90a"), signature,
                        {"ptx": "// ptx"}, {})
    ck.launch((3, 1, 1), [7])
    assert recording.calls == [("launch", [7], (3, 1, 1), None)]


def test_isa_checks_keep_their_old_names():
    assert compiler.check_amdgpu_assembly is amd.check_amdgpu_assembly
    assert compiler.check_sass_schedule is nvidia.check_sass_schedule
