"""Writing stage artifacts (``KILN_DUMP_DIR``) and failing pipelines' reproducers to disk.

With ``KILN_DUMP_DIR=out`` a compile of ``saxpy`` for sm_90a leaves ``out/saxpy.kiln.mlir``,
``out/saxpy.gpu.mlir``, ``out/saxpy.nvvm.mlir``, ``out/saxpy.llvm.ll``, ``out/saxpy.ptx.ptx``
and, with ``ptxas``, ``out/saxpy.cubin.cubin``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from kiln import env

STAGE_EXTENSIONS = {
    "kiln": "mlir", "gpu": "mlir", "nvvm": "mlir", "rocdl": "mlir", "llvm": "ll",
    "ptx": "ptx", "cubin": "cubin", "sass": "sass", "amdgcn": "s", "obj": "o", "hsaco": "hsaco",
}


def dump_stage(kernel: str, stage: str, artifact: str | bytes) -> Path | None:
    """Write ``<kernel>.<stage>.<ext>`` under ``KILN_DUMP_DIR``; None when dumping is off."""
    directory = env.dump_dir()
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kernel}.{stage}.{STAGE_EXTENSIONS[stage]}"
    if isinstance(artifact, bytes):
        path.write_bytes(artifact)
    else:
        path.write_text(artifact)
    return path


def write_reproducer(kernel: str, stage: str, module_text: str) -> Path:
    """Save the input of a failed stage, in ``KILN_DUMP_DIR`` or a fresh temp dir."""
    directory = env.dump_dir()
    if directory is None:
        directory = Path(tempfile.mkdtemp(prefix="kiln-repro-"))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{kernel}.{stage}.repro.mlir"
    path.write_text(module_text)
    return path
