"""Writing stage artifacts (``KILN_DUMP_DIR``) and failing pipelines' reproducers to disk.

Every file of one compile starts with ``<kernel>.<target>.<key>``, ``key`` being 8 hex digits of
the compile-cache key (that names the disk cache's entry directory), so neither two targets nor
two specialisations of one kernel overwrite each other's dumps. With ``KILN_DUMP_DIR=out`` a compile
of ``saxpy`` for sm_90a leaves ``out/saxpy.sm_90a.3f1c09ab.kiln.mlir``, ``....gpu.mlir``,
``....nvvm.mlir``, ``....llvm.ll``, ``....ptx.ptx`` and, with ``ptxas``, ``....cubin.cubin``.
A directory that cannot be written is one warning; compiling goes on without the dumps.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from kiln.core import env
from kiln.core.trusted_dir import warn_once

STAGE_EXTENSIONS = {
    "kiln": "mlir", "gpu": "mlir", "nvvm": "mlir", "rocdl": "mlir", "llvm": "ll",
    "ptx": "ptx", "cubin": "cubin", "sass": "sass", "amdgcn": "s", "obj": "o", "hsaco": "hsaco",
}


def dump_prefix(kernel: str, target: str, key: str) -> str:
    """``<kernel>.<target>.<key[:8]>``, the start of every file name one compile dumps.

    Example: ``dump_prefix("saxpy", "gfx950", "3f1c09ab...")`` is ``"saxpy.gfx950.3f1c09ab"``.
    """
    return f"{kernel}.{target}.{key[:8]}"


def ir_key(kiln_ir: str, options_key: str) -> str:
    """A key for a compile that has no cache key: the hash of its IR and options."""
    return hashlib.sha256(f"{options_key}\n{kiln_ir}".encode()).hexdigest()


def _write(directory: Path, name: str, artifact: str | bytes) -> Path | None:
    """``directory/name`` written, or None (and one warning per directory) when it cannot be."""
    path = directory / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if isinstance(artifact, bytes):
            path.write_bytes(artifact)
        else:
            path.write_text(artifact)
    except OSError as err:
        warn_once(("dump", directory),
                  f"KILN_DUMP_DIR={directory} cannot be written ({err.strerror or err}); "
                  "compiling goes on without dumping stages: point KILN_DUMP_DIR at a "
                  "writable folder or unset it", UserWarning)
        return None
    return path


def dump_stage(prefix: str, stage: str, artifact: str | bytes) -> Path | None:
    """Write ``<prefix>.<stage>.<ext>`` under ``KILN_DUMP_DIR``; None when dumping is off or
    the directory is unusable."""
    directory = env.dump_dir()
    if directory is None:
        return None
    return _write(directory, f"{prefix}.{stage}.{STAGE_EXTENSIONS[stage]}", artifact)


def write_reproducer(prefix: str, stage: str, module_text: str) -> Path:
    """Save the input of a failed stage as ``<prefix>.<stage>.repro.mlir`` in ``KILN_DUMP_DIR``,
    else (unset or unusable) in a fresh temp dir."""
    directory = env.dump_dir()
    name = f"{prefix}.{stage}.repro.mlir"
    path = _write(directory, name, module_text) if directory is not None else None
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="kiln-repro-")) / name
        path.write_text(module_text)
    return path
