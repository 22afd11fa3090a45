"""The native launch shim (``native_launch.c`` + ``native_guard.c``): built at first use, cached,
checked, loaded.

:func:`native_module` returns the shim's extension module, or None when it cannot be had (no
C compiler, no Python headers, ``KILN_CC=none``, a failed build): the launcher then calls the
driver through ctypes (:mod:`kiln.runtime.driver_launch`), slower by about a microsecond.

The shim is content-addressed: its key hashes the C sources, the compiler (path and
``--version``) and the Python build (version, ABI suffix, headers). It lives in the compile
cache's owner-only directory (``<cache>/native/<key>.so`` beside ``<key>.json``, which records
the key, size and SHA-256 of the library) under the same trust model (docs/lowering.md, "Trust
model"): files not owned by you or that are symlinks are not read, a library whose size or
digest does not match its record, or a record of another key, is never loaded but rebuilt
(one :class:`~kiln.core.errors.CacheWarning`). The checked bytes themselves are what is
loaded: they are copied to a fresh private file first, so a swap after the check loads
nothing unchecked. Without a usable cache the shim is built in a private temporary directory
once per process.

Example::

    shim = native_module()
    if shim is not None:
        shim.launch(record_address)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from kiln.core import env
from kiln.core.trusted_dir import (UntrustedFile, make_private_dirs, read_owned, usable_root,
                                   warn_once, write_atomic)

# The shim's sources: the header first, then the files compiled into the one module.
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("native_launch.h", "native_launch.c", "native_guard.c",
                             "native_call.c"))
MODULE_NAME = "_kiln_launch"
RECORD_FORMAT = "kiln-native-shim/1"
BUILD_TIMEOUT_S = 60


@functools.lru_cache(maxsize=1)
def native_module():
    """The loaded shim for this process (built or read from the cache once), or None."""
    return load_shim(env.c_compiler())


def load_shim(compiler: str | None, root: Path | None = None):
    """The shim built by ``compiler`` (None: no shim), cached under ``root`` (default: the
    compile cache's ``native/`` directory, when usable). Not memoised: for tests."""
    if compiler is None or not all(path.exists() for path in SOURCES):
        return None
    identity = compiler_identity(compiler)
    include = sysconfig.get_paths()["include"]
    if identity is None or not (Path(include) / "Python.h").exists():
        return None
    command = [compiler, "-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}",
               *(str(path) for path in SOURCES if path.suffix == ".c")]
    return load_extension(Extension(MODULE_NAME, SOURCES, command, (identity, include),
                                    "native launch shim"), root)


@dataclasses.dataclass(frozen=True)
class Extension:
    """A native module built from ``sources`` by ``command`` (``-o <file>`` is appended);
    ``key_parts``: what else the binary depends on (compiler identity, headers, libraries);
    ``what``: its name in warnings; ``timeout_s``: the most its build may take."""

    module_name: str
    sources: tuple
    command: list
    key_parts: tuple
    what: str
    timeout_s: float = BUILD_TIMEOUT_S


def load_extension(ext: Extension, root: Path | None = None, build: bool = True):
    """``ext``'s module: loaded from the cache under ``root`` (default: the compile cache's
    ``native/`` directory, when usable) when its record checks out, else built (and
    recorded); None when it cannot be built or loaded (one warning), or with ``build=False``
    when it is not in the cache."""
    source = b"".join(b"%d:%s" % (len(data), data) for data in (p.read_bytes() for p in
                                                                 ext.sources))
    key = shim_key(source, *ext.key_parts)
    if root is None:
        base = usable_root()
        root = None if base is None else base / "native"
    if root is None:
        if not build:
            return None
        with tempfile.TemporaryDirectory(prefix="kiln-native-") as private:
            built = _build(ext, Path(private), key)
            return None if built is None else _load(ext, built.read_bytes(), Path(private))
    make_private_dirs(root)
    data = _cached(ext, root, key)
    if data is None:
        if not build:
            return None
        built = _build(ext, root, key)
        if built is None:
            return None
        data = built.read_bytes()
        try:
            write_atomic(root / f"{key}.json", json.dumps(_record(key, data)).encode())
        except OSError as err:
            warn_once(("native-record", str(root)), f"kiln: cannot record the {ext.what} "
                      f"in {root} ({err}); it is rebuilt next time")
    return _load(ext, data, root)


def compiler_identity(compiler: str) -> str | None:
    """``compiler``'s resolved path and ``--version`` output, or None when it does not run."""
    path = shutil.which(compiler)
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{os.path.realpath(path)}\n{version}"


def shim_key(source: bytes, identity: str, include: str, *extra: str) -> str:
    """SHA-256 of the shim's source, the compiler and the Python build it is made for (and
    ``extra``: what else the binary depends on)."""
    digest = hashlib.sha256()
    for part in (source, identity.encode(), sys.version.encode(),
                 str(sysconfig.get_config_var("EXT_SUFFIX")).encode(), include.encode(),
                 *(part.encode() for part in extra)):
        digest.update(f"{len(part)}:".encode())
        digest.update(part)
    return digest.hexdigest()


def _record(key: str, data: bytes) -> dict:
    return {"format": RECORD_FORMAT, "key": key, "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def _cached(ext: Extension, root: Path, key: str) -> bytes | None:
    """The cached library of ``key`` if its record and bytes check out, else None."""
    try:
        record = json.loads(read_owned(root / f"{key}.json"))
        data = read_owned(root / f"{key}.so")
    except FileNotFoundError:
        return None
    except (UntrustedFile, OSError, ValueError) as err:
        warn_once(("native-untrusted", str(root)),
                  f"kiln: not loading the cached {ext.what} in {root} ({err}); "
                  "rebuilding it")
        return None
    if record != _record(key, data):
        warn_once(("native-corrupt", str(root)),
                  f"kiln: the cached {ext.what} {root / key}.so does not match its "
                  "record (corrupt or foreign); rebuilding it")
        return None
    return data


def _build(ext: Extension, directory: Path, key: str) -> Path | None:
    """Compile ``ext`` to ``directory/<key>.so`` (replacing any file there), or None."""
    target = directory / f"{key}.so"
    fd, scratch = tempfile.mkstemp(dir=directory, prefix=f".{key[:16]}.", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([*ext.command, "-o", scratch], capture_output=True, text=True,
                       timeout=ext.timeout_s, check=True)
        os.chmod(scratch, 0o600)
        os.replace(scratch, target)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        warn_once(("native-build", ext.what, ext.command[0]),
                  f"kiln: could not build the {ext.what} with {ext.command[0]} "
                  f"({str(detail).strip()[:300]}); using the slower path without it")
        _unlink(scratch)
        return None
    return target


def _load(ext: Extension, data: bytes, directory: Path):
    """Load checked library bytes from a fresh private copy (removed once loaded)."""
    fd, private = tempfile.mkstemp(dir=directory, prefix=".load.", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        loader = importlib.machinery.ExtensionFileLoader(ext.module_name, private)
        spec = importlib.util.spec_from_file_location(ext.module_name, private, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except ImportError as err:
        warn_once(("native-load", ext.what, str(directory)), f"kiln: could not load the "
                  f"{ext.what} ({err}); using the slower path without it")
        return None
    finally:
        _unlink(private)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
