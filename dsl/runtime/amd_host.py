"""The AMD host launcher: the same ``kiln_launch`` module as :mod:`kiln.runtime.host`, carrying a
``#gpu.object<#rocdl.target<chip = "gfx950">, bin = "<hsaco>">`` and linked against MLIR's ROCm
runtime wrappers (``libmlir_rocm_runtime.so``, which is not shipped with the MLIR wheel).

The module is generated and verified everywhere (see :func:`amd_host_llvm_ir`); launching needs
ROCm: the runtime library is found through ``KILN_ROCM_RUNTIME`` or under ``/opt/rocm/lib``.

Example::

    text = amd_host_llvm_ir(sig, get_target("gfx950"), hsaco_bytes)
    assert "mgpuLaunchKernel" in text
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from mlir import ir
from mlir.dialects import gpu, llvm

from kiln.core import env
from kiln.core.errors import LaunchError
from kiln.runtime.host import HostLauncher, build_host_module, lower_host_module
from kiln.signature import KernelSignature
from kiln.core.targets import Target

_ROCM_RUNTIME_NAME = "libmlir_rocm_runtime.so"
_ROCM_SEARCH_DIRS = (Path("/opt/rocm/lib"), Path("/opt/rocm/llvm/lib"))


def amd_kernel_object(target: Target, hsaco: bytes):
    """``#gpu.object`` holding a linked AMDGPU code object (``hsaco``) for ``target``."""
    # No typed Python builder exists for #rocdl.target.
    rocdl_target = ir.Attribute.parse(f'#rocdl.target<chip = "{target.name}">')
    return gpu.ObjectAttr.get(rocdl_target, int(gpu.CompilationTarget.Binary), bytes(hsaco))


def amd_host_llvm_ir(signature: KernelSignature, target: Target, hsaco: bytes) -> str:
    """Build, lower and verify the AMD host module; returns its LLVM IR (no ROCm needed)."""
    with ir.Context(), ir.Location.unknown():
        module = build_host_module(signature, amd_kernel_object(target, hsaco))
        lower_host_module(module)
        module.operation.verify()
        return llvm.translate_module_to_llvmir(module.operation)


def rocm_runtime_library() -> Path:
    """Path of a loadable ``libmlir_rocm_runtime.so``, else LaunchError naming KILN_ROCM_RUNTIME."""
    override = env.rocm_runtime_override()
    candidates = [override] if override else [d / _ROCM_RUNTIME_NAME for d in _ROCM_SEARCH_DIRS]
    fix = ("install ROCm with MLIR's runtime wrappers and set KILN_ROCM_RUNTIME=/path/to/"
           f"{_ROCM_RUNTIME_NAME}; without it AMD kernels can be compiled but not launched")
    for path in candidates:
        if path.is_file():
            try:
                ctypes.CDLL(str(path))  # probe: a missing libamdhip64 must not reach the JIT
            except OSError as err:
                raise LaunchError(f"cannot load the ROCm runtime {path}: {err}", fix=fix)
            return path
    raise LaunchError(f"no {_ROCM_RUNTIME_NAME} found (looked at "
                      f"{', '.join(str(p) for p in candidates)})", fix=fix)


def build_amd_launcher(signature: KernelSignature, target: Target, hsaco: bytes) -> HostLauncher:
    """A :class:`~kiln.runtime.host.HostLauncher` for an AMD kernel (needs ROCm)."""
    runtime = rocm_runtime_library()
    return HostLauncher(signature, lambda: amd_kernel_object(target, hsaco), [str(runtime)])
