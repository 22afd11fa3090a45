"""Every kernel in kernels/ compiles through kiln-insert-waits and passes kiln-verify-waits,
on Kiln IR and (AMD) on the final assembly. Parametrised over the ``compile_*`` entry points
that exist when the tests run."""

import importlib
import inspect
import pkgutil

import pytest
from mlir import ir

import kiln.kernels
from kiln.lowering import isa_amdgpu
from kiln.passes import build_pass_manager


def _entry_points():
    found = []
    for info in pkgutil.walk_packages(kiln.kernels.__path__, "kiln.kernels."):
        try:
            module = importlib.import_module(info.name)
        except Exception as err:  # another engineer's module mid-edit: reported, not hidden
            found.append(pytest.param(info.name, None, marks=pytest.mark.skip(f"import failed: {err}")))
            continue
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("compile_") and fn.__module__ == module.__name__:
                found.append(pytest.param(info.name, name, id=f"{info.name}.{name}"))
    return found


def _target_for(module_name: str, fn) -> str:
    if "gfx" in module_name or "gfx" in fn.__name__:
        return "gfx950"
    return "sm_90a"


@pytest.mark.lower
@pytest.mark.parametrize("module_name,fn_name", _entry_points())
def test_kernel_waits_are_proven(module_name, fn_name):
    fn = getattr(importlib.import_module(module_name), fn_name)
    target = _target_for(module_name, fn)
    ck = fn("bf16", target=target)
    with ir.Context():
        module = ir.Module.parse(ck.asm["gpu"])
        build_pass_manager(["kiln-insert-waits", "kiln-verify-waits"]).run(module.operation)
        assert str(module) == str(ir.Module.parse(ck.asm["gpu"])), "the pipeline left a gap to fill"
    if not ck.target.is_nvidia:
        isa_amdgpu.verify_waits(isa_amdgpu.parse(ck.asm["amdgcn"], ck.name), ck.name)
