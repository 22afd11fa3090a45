"""compile_kernel end to end without a GPU: stages, dumps, errors with reproducers, artifacts."""

import contextlib
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
from source_modules import write_kernel_module

from kiln.core.errors import CompilationError, KilnValueError
from kiln.lowering.compiler import CompiledKernel, compile_kernel
from kiln.runtime.cache import compile_cached, load_cached
from kiln.core.options import CompileOptions
from kiln.signature import KernelSignature, ScalarParam, TensorParam

pytestmark = pytest.mark.lower

SAXPY_IR = (Path(__file__).parent / "lit" / "lowering" / "Inputs" / "saxpy.mlir").read_text()
SAXPY = KernelSignature("saxpy", (TensorParam("x", "f32", 1), TensorParam("y", "f32", 1),
                                  ScalarParam("n", "i32"), ScalarParam("a", "f32")), block=(128, 1, 1))

# The float add at "user_kernel.py":12 mixes f32 and i32, which the arith verifier rejects.
BAD_IR = """
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @bad(%a: f32, %b: i32) kernel attributes {known_block_size = array<i32: 128, 1, 1>} {
      %s = "arith.addf"(%a, %b) : (f32, i32) -> f32 loc("user_kernel.py":12:8)
      gpu.return loc("user_kernel.py":13:4)
    } loc("user_kernel.py":10:0)
  }
}
"""


def test_stage_order_per_vendor():
    nvidia = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    assert list(nvidia.asm)[:5] == ["kiln", "gpu", "nvvm", "llvm", "ptx"]
    assert ".target sm_90a" in nvidia.asm["ptx"]
    amd = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("gfx942", num_warps=2))
    assert list(amd.asm)[:6] == ["kiln", "gpu", "rocdl", "llvm", "amdgcn", "obj"]
    assert amd.metadata["scratch_bytes"] == 0 and amd.metadata["vgpr_count"] > 0
    assert amd.binary is amd.asm.get("hsaco", amd.asm["obj"])
    assert set(amd.metadata["compile_ms"]) == {"gpu", "rocdl", "llvm", "amdgcn", "obj", "hsaco"}


def test_maxnreg_reaches_ptx():
    kernel = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_80", maxnreg=40))
    assert ".maxnreg 40" in kernel.asm["ptx"]


def test_dump_dir_gets_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    kernel = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("gfx950", num_warps=2))
    prefix = kernel.dump_prefix
    assert prefix.startswith("saxpy.gfx950.") and len(prefix) == len("saxpy.gfx950.") + 8
    names = {p.name for p in tmp_path.iterdir()}
    expected = {f"{prefix}.{stage}" for stage in ("kiln.mlir", "gpu.mlir", "rocdl.mlir", "llvm.ll",
                                                  "amdgcn.s", "obj.o")}
    assert expected <= names
    assert (tmp_path / f"{prefix}.amdgcn.s").read_text() == kernel.asm["amdgcn"]
    assert (tmp_path / f"{prefix}.obj.o").read_bytes() == kernel.asm["obj"]


def test_verifier_error_points_at_user_line_with_reproducer(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    signature = KernelSignature("bad", (ScalarParam("a", "f32"), ScalarParam("b", "i32")))
    with pytest.raises(CompilationError) as caught:
        compile_kernel(BAD_IR, signature, CompileOptions("sm_90a"))
    err = caught.value
    assert (err.loc.filename, err.loc.line) == ("user_kernel.py", 12)
    assert str(err).startswith("user_kernel.py:12: the 'kiln' stage failed")
    assert "'arith.addf' op operand #1 must be floating-point-like, but got 'i32'" in str(err)
    assert Path(err.reproducer).parent == tmp_path
    command = str(err).split("reproduce with:\n  ")[1].splitlines()[0]
    replay = subprocess.run(shlex.split(command), capture_output=True, text=True)
    assert replay.returncode == 1
    assert "must be floating-point-like" in replay.stderr


def test_unlowered_op_is_reported_before_llvm_translation():
    # ub.poison on a tensor survives conversion; translating it would crash the process.
    leftover = ('%u = ub.poison : tensor<4xf32> loc("saxpy.py":8:2)\n'
                '      %c0 = arith.constant 0 : index\n'
                '      %e = tensor.extract %u[%c0] : tensor<4xf32> loc("saxpy.py":8:3)\n'
                '      memref.store %e, %y[%c0] : memref<?xf32, strided<[1], offset: ?>, 1>\n')
    ir_text = SAXPY_IR.replace("      gpu.return loc", leftover + "      gpu.return loc")
    for chip, warps in (("sm_90a", 4), ("gfx950", 2)):
        with pytest.raises(CompilationError, match="'ub.poison' was not lowered") as caught:
            compile_kernel(ir_text, SAXPY, CompileOptions(chip, num_warps=warps))
        assert (caught.value.loc.filename, caught.value.loc.line) == ("saxpy.py", 8)


def test_bad_pipeline_element_in_stage_is_a_kiln_error():
    from kiln.passes import build_pass_manager
    from mlir import ir

    with ir.Context(), pytest.raises(KilnValueError, match="bad pipeline element 'no-such-pass'"):
        build_pass_manager(["canonicalize", "no-such-pass"])
    with ir.Context(), pytest.raises(KilnValueError, match="cannot be nested"):
        build_pass_manager(["gpu.module(kiln-fold-block-dim)"])


def test_block_must_match_num_warps():
    with pytest.raises(KilnValueError, match="block of 128 threads but num_warps=8 gives 256"):
        compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a", num_warps=8))


def test_artifact_round_trips_through_the_json_cache(tmp_path, monkeypatch):
    from kiln.runtime import cache

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    kernel = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    cache.put("k" * 64, kernel.to_artifact())
    restored = CompiledKernel.from_artifact(cache.get("k" * 64))
    assert (restored.name, restored.target, restored.options, restored.signature) == (
        kernel.name, kernel.target, kernel.options, kernel.signature)
    assert restored.asm == kernel.asm and restored.metadata == kernel.metadata
    assert CompiledKernel.from_artifact({"format": -1}) is None


@pytest.mark.parametrize("field, value", [("signature", []), ("signature", {"params": [1]}),
                                          ("options", [1]), ("metadata", {"compile_profile": 3})])
def test_malformed_artifact_is_a_miss_not_an_error(field, value):
    artifact = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a")).to_artifact()
    artifact[field] = value
    assert CompiledKernel.from_artifact(artifact) is None


def test_amd_math_uses_native_instructions_not_device_library(tmp_path):
    """exp2/log2/exp/log/sqrt/rsqrt become v_exp/v_log/v_sqrt/v_rcp: no __ocml_ call, no scratch."""
    module = write_kernel_module(tmp_path, "amd_math_kernel", """
        import kiln
        from kiln import f32

        @kiln.kernel
        def transcendental(x: kiln.Tensor[f32]):
            i = kiln.thread_id(0)
            v = x[i]
            x[i] = kiln.exp2(v) + kiln.log2(v) + kiln.exp(v) + kiln.log(v) + kiln.rsqrt(v)
        """)

    ck = module.transcendental.compile(np.zeros(4, np.float32), target="gfx950")
    asm = ck.asm["amdgcn"]
    assert "__ocml" not in ck.asm["llvm"] and "s_swappc" not in asm
    for instruction in ("v_exp_f32", "v_log_f32", "v_sqrt_f32", "v_rcp_f32"):
        assert instruction in asm, instruction
    assert ck.metadata["scratch_bytes"] == 0


def test_amd_device_library_call_is_a_compile_error(tmp_path):
    """f64 exp2 has no native instruction: it would call __ocml_exp2_f64, which Kiln does not
    link, so compiling must fail with a CompilationError instead of producing a broken hsaco."""
    module = write_kernel_module(tmp_path, "amd_f64_kernel", """
        import kiln
        from kiln import f64

        @kiln.kernel
        def exp2_f64(x: kiln.Tensor[f64]):
            i = kiln.thread_id(0)
            x[i] = kiln.exp2(x[i])
        """)
    with pytest.raises(CompilationError, match="__ocml_exp2_f64") as info:
        module.exp2_f64.compile(np.zeros(4, np.float64), target="gfx950")
    assert "Fix:" in str(info.value)


def test_profile_times_every_step_and_the_cache_store(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_NO_CACHE", raising=False)
    kernel = compile_cached(SAXPY_IR, SAXPY, CompileOptions("gfx950", num_warps=2),
                            "profile-test")
    profile = kernel.metadata["compile_profile"]
    steps = [name for name, _, _ in profile]
    top = [s for s in steps if "." not in s]
    # The printed gpu and rocdl modules are made from copies while LLVM optimises and emits
    # the assembly on a thread; then the ISA checks (a module this small emits its object
    # here, not in a second process).
    assert top == ["parse", "gpu", "rocdl", "llvm", "amdgcn", "obj", "hsaco", "cache-store"]
    assert {"gpu.passes.kiln-insert-waits", "amdgcn.optimize", "amdgcn.emit", "obj.emit",
            "amdgcn.beside.gpu", "amdgcn.beside.rocdl", "amdgcn.check.verify-waits"} <= set(steps)
    assert all(wall >= 0 and cpu >= 0 for _, wall, cpu in profile)
    stage = dict((name, wall) for name, wall, _ in profile)
    assert stage["amdgcn"] >= stage["amdgcn.emit"] > 0  # a nested step lies inside its stage
    stored = load_cached("profile-test")  # stored before its own store was timed
    assert [s for s, _, _ in stored.metadata["compile_profile"]] == steps[:-1]


def test_text_made_beside_ptxas_is_the_text_printed_in_stage_order(monkeypatch):
    """The gpu, nvvm and llvm texts are made from copies while ptxas runs (steps
    ``cubin.ptxas.<stage>``), yet equal the texts printed as each stage ends."""
    from kiln.lowering import compiler, pipeline
    from kiln.lowering.tools import find_ptxas

    if find_ptxas() is None:
        pytest.skip("needs ptxas")
    beside = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    steps = [name for name, _, _ in beside.metadata["compile_profile"]]
    assert {"cubin.ptxas.gpu", "cubin.ptxas.nvvm", "cubin.ptxas.llvm"} <= set(steps)
    assert "text" not in steps  # nothing was left for after the stages

    class InOrder(pipeline.CompileState):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **(kwargs | dict(defer_text=False)))

    monkeypatch.setattr(compiler, "CompileState", InOrder)
    in_order = compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    assert list(beside.asm) == list(in_order.asm) == ["kiln", "gpu", "nvvm", "llvm", "ptx",
                                                      "cubin"]
    for stage in ("gpu", "nvvm", "llvm", "ptx"):
        assert beside.asm[stage] == in_order.asm[stage], stage
    assert "gpu.print" in [name for name, _, _ in in_order.metadata["compile_profile"]]


def test_failed_pass_reproducer_is_the_stage_input(tmp_path, monkeypatch):
    """The reproducer holds the module as the stage received it, with locations, even though
    the failing pass had already rewritten it."""
    from mlir import ir

    from kiln import passes
    from kiln.lowering import pipeline

    def mangle_then_fail(op, pass_):
        op.attributes["kiln.mangled"] = ir.UnitAttr.get()
        pass_.signal_pass_failure()

    monkeypatch.setitem(passes._REGISTRY, "kiln-test-mangle",
                        passes.KilnPass("kiln-test-mangle", mangle_then_fail, "test: fails"))
    monkeypatch.setattr(pipeline, "GPU_STAGE_PASSES", ("kiln-test-mangle",))
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    with pytest.raises(CompilationError, match="the 'gpu' stage failed") as caught:
        compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    text = Path(caught.value.reproducer).read_text()
    assert "kiln.mangled" not in text and "kiln.target" in text and "loc(" in text


def test_invalid_ir_from_a_kiln_pass_stops_before_the_next_pass(monkeypatch):
    """Upstream passes are not verified one by one, but a Kiln pass's output is: IR it broke
    becomes a CompilationError naming the problem, not input to canonicalize."""
    from kiln import passes
    from kiln.lowering import pipeline

    def drop_terminator(op, pass_):
        def visit(inner):
            if inner.name == "gpu.return":
                inner.erase()
                return ir.WalkResult.INTERRUPT
            return ir.WalkResult.ADVANCE

        op.operation.walk(visit)

    from mlir import ir

    monkeypatch.setitem(passes._REGISTRY, "kiln-test-break",
                        passes.KilnPass("kiln-test-break", drop_terminator, "test: breaks IR"))
    monkeypatch.setattr(pipeline, "GPU_STAGE_PASSES", ("kiln-test-break", "canonicalize", "cse"))
    with pytest.raises(CompilationError, match="the 'gpu' stage failed") as caught:
        compile_kernel(SAXPY_IR, SAXPY, CompileOptions("sm_90a"))
    assert "terminator" in str(caught.value)


@pytest.mark.parametrize("verify_each", [True, False])
def test_a_kiln_pass_leaving_invalid_ir_fails_before_the_next_pass(monkeypatch, verify_each):
    """verify_each=False skips the verifier between upstream passes, never after a Kiln pass:
    invalid IR must not reach the next pass, which assumes valid input."""
    from mlir import ir

    from kiln import passes

    def drop_terminator(op, pass_):
        func = op.regions[0].blocks[0].operations[0]
        block = func.regions[0].blocks[0]
        block.operations[len(block.operations) - 1].erase()

    ran = []
    monkeypatch.setitem(passes._REGISTRY, "kiln-test-drop-terminator",
                        passes.KilnPass("kiln-test-drop-terminator", drop_terminator, "test"))
    monkeypatch.setitem(passes._REGISTRY, "kiln-test-record",
                        passes.KilnPass("kiln-test-record", lambda op, p: ran.append(1), "test"))
    with ir.Context():
        module = ir.Module.parse("func.func @f() { return }")
        pm = passes.build_pass_manager(["kiln-test-drop-terminator", "kiln-test-record"],
                                       timer=lambda name: contextlib.nullcontext(),
                                       verify_each=verify_each)
        with pytest.raises(ir.MLIRError):
            pm.run(module.operation)
    assert ran == []
