"""Private directories for state Kiln reads back (the compile cache, the autotune store).

Whoever can write such a directory decides what Kiln later loads and launches, so it is used
only when it is this user's and nobody else can write it:

- :func:`private_dir` creates a missing directory (and its missing parents) with mode 0700. A
  directory owned by another user, writable by group or others, or unusable (not a directory,
  no permission) is refused: one :class:`~kiln.core.errors.CacheWarning` names it and the fix, and
  the caller goes on without it.
- :func:`read_owned` reads a regular file only if this user owns it (no symlinks followed).
- :func:`write_atomic` writes a temporary file beside the target, then ``os.replace``: readers
  and writers killed half-way never leave a torn file visible.
- :func:`warn_once` reports each problem once per process (the dump directory's too).

Example::

    root = private_dir(Path("/tmp/kiln-cache"), "compile cache", "KILN_CACHE_DIR")
    if root is not None:
        write_atomic(root / "entry.json", b"{}")
        assert read_owned(root / "entry.json") == b"{}"
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import warnings
from pathlib import Path

from kiln.core import env
from kiln.core.errors import CacheWarning

_warned: set = set()


def warn_once(reason, message: str, category: type[Warning] = CacheWarning) -> None:
    """Issue ``message`` (a CacheWarning unless ``category`` says otherwise) the first time
    ``reason`` (any hashable) is seen in this process."""
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(message, category, stacklevel=3)


def _uid() -> int | None:
    getuid = getattr(os, "getuid", None)  # absent on Windows: no ownership to check
    return getuid() if getuid is not None else None


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents with mode 0700 (existing ones are left as they are)."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first
            pass


def private_dir(path: Path, purpose: str, variable: str) -> Path | None:
    """``path``, created 0700 if missing, or None (with one warning) if it is not safe to use.

    ``purpose`` ("compile cache") and ``variable`` ("KILN_CACHE_DIR") word the warning.
    """
    own = f"set {variable} to a directory you own"
    try:
        make_private_dirs(path)
        info = os.stat(path)
    except OSError as err:
        warn_once(("unusable", str(path)),
                  f"kiln: cannot use {path} as the {purpose} ({err.strerror or err}); "
                  f"running without it. Fix: make it a writable directory or {own}")
        return None
    uid = _uid()
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem, fix = "is not a directory", own
    elif uid is not None and info.st_uid != uid:
        problem, fix = f"is owned by uid {info.st_uid}, not by you (uid {uid})", own
    elif uid is not None and info.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
        fix = f"chmod 700 {path}, or {own}"
    if problem is None:
        return path
    warn_once(("untrusted", str(path)),
              f"kiln: not using {path} as the {purpose}: it {problem}, so another user could "
              f"plant entries in it; running without it. Fix: {fix}")
    return None


class UntrustedFile(ValueError):
    """A file :func:`read_owned` refuses: a symlink, not a regular file, or another user's."""


def read_owned(path: Path) -> bytes:
    """The bytes of ``path``; UntrustedFile if it is a symlink or not a regular file this user
    owns, FileNotFoundError if missing."""
    try:
        # O_NONBLOCK: opening a FIFO planted in place of a file must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        if err.errno == errno.ELOOP:  # what O_NOFOLLOW gives for a symlink
            raise UntrustedFile(f"{path} is a symlink") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        uid = _uid()
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFile(f"{path} is not a regular file")
        if uid is not None and info.st_uid != uid:
            raise UntrustedFile(f"{path} is owned by uid {info.st_uid}, not by you")
        return handle.read()


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (mode 0600) in one step; OSError if it cannot."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:24]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def cache_root() -> Path:
    """The cache directory (``KILN_CACHE_DIR``, default ``~/.cache/kiln``)."""
    return env.cache_dir()


def usable_root() -> Path | None:
    """:func:`cache_root` if the cache is on and the directory is safe to use, else None (one
    CacheWarning says why). The compile cache and the autotune store live under it."""
    if env.cache_disabled():
        return None
    return private_dir(cache_root(), "compile cache", "KILN_CACHE_DIR")
