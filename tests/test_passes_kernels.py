"""Every kernel in kernels/ compiles through kiln-insert-waits and passes kiln-verify-waits,
on Kiln IR and (AMD) on the final assembly. Parametrised over the ``compile_*`` entry points
that exist when the tests run; each needs a row in ``ENTRY_CALLS``."""

import importlib
import inspect
import pkgutil

import ml_dtypes
import numpy as np
import pytest
from mlir import ir

import kiln
import kiln.kernels
import kiln.passes.insert_waits
from kiln.kernels.attention.prefill_gfx950 import PrefillGfx950Config, make_kernel
from kiln.lowering import isa_amdgpu
from kiln.lowering.compiler import compile_kernel
from kiln.core.options import CompileOptions
from kiln.passes import build_pass_manager
from kiln.passes.enclosing import gpu_funcs

# How to compile each entry point: the AMD target where the kernel has one (the assembly is
# proven too), else its only target (the Kiln IR proof alone). Small shapes keep it fast.
ENTRY_CALLS = {
    "kiln.kernels.attention.prefill_gfx950.compile_prefill_gfx950":
        lambda fn: fn(head_dim=64, dtype="bf16", causal=True),
    "kiln.kernels.attention.prefill_gfx950_fp8.compile_prefill_gfx950_fp8":
        lambda fn: fn(head_dim=128, causal=True),
    "kiln.kernels.attention.prefill.compile_prefill":
        lambda fn: fn("bf16", target="gfx950", head_dim=64),
    "kiln.kernels.attention.combine.compile_combine":
        lambda fn: fn(kiln.f32, head_dim=64, target="gfx950"),
    "kiln.kernels.attention.decode.compile_decode":  # paged pages arrive by TMA: NVIDIA only
        lambda fn: fn("bf16", target="sm_90a", head_dim=64),
    "kiln.kernels.attention.mla_decode.compile_mla_decode":  # TMA and WGMMA: sm_90a only
        lambda fn: fn(target="sm_90a"),
    "kiln.kernels.gemm.gfx950.compile_gfx950": lambda fn: fn("bf16", target="gfx950"),
    "kiln.kernels.gemm.compile_matmul": lambda fn: fn("bf16", target="gfx950"),
    "kiln.kernels.gemm.grouped_api.compile_grouped_matmul":
        lambda fn: fn("bf16", target="gfx950"),
    "kiln.kernels.gemm.fp8_api.compile_fp8_matmul":
        lambda fn: fn("f8e4m3", target="gfx950", trans_b=True, scales=("block", "block")),
    "kiln.kernels.gemm.fp8_gfx950.compile_fp8_gfx950":
        lambda fn: fn("f8e5m2", scales=("row", "col")),
    "kiln.kernels.gemm.gemv.compile_gemv": lambda fn: fn("bf16", "bf16", target="sm_90a"),
    "kiln.kernels.gemm.fp8_grouped_api.compile_grouped_fp8_matmul":
        lambda fn: fn("f8e4m3", target="gfx950", trans_b=True, scales=("block", "block")),
}


def _entry_points():
    found = []
    for info in pkgutil.walk_packages(kiln.kernels.__path__, "kiln.kernels."):
        if info.name == "kiln.kernels.torch_ops":  # needs torch (optional) and compiles nothing
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # a broken module is a failing test (the test re-raises), not a skip
            found.append(pytest.param(info.name, None, id=f"{info.name}[import]"))
            continue
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("compile_") and fn.__module__ == module.__name__:
                found.append(pytest.param(info.name, name, id=f"{info.name}.{name}"))
    return found


@pytest.mark.lower
@pytest.mark.parametrize("module_name,fn_name", _entry_points())
def test_kernel_waits_are_proven(module_name, fn_name):
    if fn_name is None:  # its import failed at collection: raise the error here
        importlib.import_module(module_name)
        pytest.fail(f"{module_name} failed to import at collection but not on the second try")
    entry = f"{module_name}.{fn_name}"
    if entry not in ENTRY_CALLS:
        pytest.fail(f"{entry} has no row in ENTRY_CALLS (tests/test_passes_kernels.py): add "
                    "one that compiles it for gfx950, or for its only target")
    ck = ENTRY_CALLS[entry](getattr(importlib.import_module(module_name), fn_name))
    with ir.Context():
        module = ir.Module.parse(ck.asm["gpu"])
        build_pass_manager(["kiln-insert-waits", "kiln-verify-waits"]).run(module.operation)
        assert str(module) == str(ir.Module.parse(ck.asm["gpu"])), "the pipeline left a gap to fill"
    if not ck.target.is_nvidia:
        isa_amdgpu.verify_waits(isa_amdgpu.parse(ck.asm["amdgcn"], ck.name), ck.name)


# The Hopper kernels on sm_90a: their wgmma.wait_group and mbarrier waits are proven on Kiln IR
# (the gfx950 rows above cover the same entry points' AMD kernels).
HOPPER_CALLS = {
    "gemm": lambda: importlib.import_module("kiln.kernels.gemm").compile_matmul(
        "bf16", target="sm_90a"),
    "prefill": lambda: importlib.import_module("kiln.kernels.attention.prefill").compile_prefill(
        "bf16", target="sm_90a", head_dim=64),
    "decode": lambda: importlib.import_module("kiln.kernels.attention.decode").compile_decode(
        "bf16", target="sm_90a", head_dim=64),
    "grouped_gemm": lambda: importlib.import_module("kiln.kernels.gemm").compile_grouped_matmul(
        "bf16", target="sm_90a"),
    "fp8_gemm": lambda: importlib.import_module("kiln.kernels.gemm").compile_matmul(
        "f8e4m3", target="sm_90a", trans_b=True, scales=("row", "col")),
    "fp8_gemm_block_pairs": lambda: importlib.import_module("kiln.kernels.gemm").compile_matmul(
        "f8e4m3", target="sm_90a", trans_b=True, scales=("block", "block"), block_n=128,
        stages=5, cluster_m=2),
    "fp8_grouped_gemm": lambda: importlib.import_module(
        "kiln.kernels.gemm").compile_grouped_matmul("f8e4m3", target="sm_90a", trans_b=True,
                                                    scales=("block", "block")),
}


@pytest.mark.lower
@pytest.mark.parametrize("name", sorted(HOPPER_CALLS))
def test_hopper_kernel_waits_are_proven(name):
    ck = HOPPER_CALLS[name]()
    text = ck.asm["gpu"]
    assert "nvgpu.tma.async.load" in text  # the proof below is about TMA and wgmma waits
    with ir.Context():
        module = ir.Module.parse(text)
        build_pass_manager(["kiln-insert-waits", "kiln-verify-waits"]).run(module.operation)
        assert str(module) == str(ir.Module.parse(text)), "the pipeline left a gap to fill"


def _prefill_without_waits(head_dim: int) -> tuple[str, object]:
    """The gfx950 prefill's Kiln IR with its hand-placed waits and kiln.manual_waits removed."""
    config = PrefillGfx950Config(head_dim=head_dim)
    x = np.empty((1, head_dim), ml_dtypes.bfloat16)
    i32 = np.zeros(2, np.int32)
    traced = make_kernel(config).trace(x, x, x, x, np.empty((1, 1), np.float32), i32, i32,
                                       np.zeros(1, np.float32), 1, 1, 1.0, -1, -1, 1,
                                       target="gfx950", num_warps=8)
    with ir.Context():
        module = ir.Module.parse(traced.module_asm)
        waits = []
        for func in gpu_funcs(module.operation):
            del func.attributes["kiln.manual_waits"]

            def collect(op):
                if op.name == "rocdl.s.waitcnt":
                    waits.append(op)
                return ir.WalkResult.ADVANCE

            func.walk(collect, ir.WalkOrder.PRE_ORDER)
        assert waits
        for op in waits:
            op.erase()
        return str(module), traced.signature


@pytest.mark.lower
def test_prefill_gfx950_waits_are_placed_in_one_walk(monkeypatch):
    """Automatic placement on the whole gfx950 prefill (DMA staircases, transposed-read
    staircases, loop-carried tiles): one placing walk and one confirming walk, and the
    assembly-level proof agrees with every wait placed."""
    walks = []

    class CountingAnalysis(kiln.passes.insert_waits.WaitAnalysis):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            walks.append(self.placed)

    monkeypatch.setattr(kiln.passes.insert_waits, "WaitAnalysis", CountingAnalysis)
    text, signature = _prefill_without_waits(64)
    ck = compile_kernel(text, signature, CompileOptions("gfx950", num_warps=8))
    assert len(walks) == 2 and walks[0] > 0 and walks[1] == 0
    assert ck.asm["gpu"].count("rocdl.s.waitcnt") == walks[0]
