"""Every environment variable Kiln reads, in one place.

Read them through these functions (not ``os.environ``) so the set stays documented:

============================  ==========================================================
``KILN_CACHE_DIR``            on-disk compile cache (default ``~/.cache/kiln``)
``KILN_NO_CACHE=1``           never read or write the compile cache
``KILN_DUMP_DIR=dir``         write ``<kernel>.<stage>.<ext>`` for every compile stage
``KILN_SHOW_STACKTRACE=1``    keep Kiln's own frames in error tracebacks
``KILN_INTERPRET_CHECK_BOUNDS``  bounds checks in the CPU interpreter (default on)
``KILN_INTERPRET_TIMEOUT``    seconds a blocked interpreter context waits before a deadlock error
``CUDA_ROOT`` / ``CUDA_HOME`` CUDA toolkit used for ``ptxas`` (cubin and ``-v`` report)
``KILN_PTXAS``                explicit ``ptxas`` path (overrides ``CUDA_ROOT``)
``KILN_LD_LLD``               explicit ``ld.lld`` path for AMD ``hsaco`` linking
``KILN_CUOBJDUMP``            explicit ``cuobjdump`` path (SASS schedule check; needs ``nvdisasm``)
``KILN_ROCM_RUNTIME``         path of ``libmlir_rocm_runtime.so`` for AMD launches
``KILN_LAUNCH_BLOCKING=1``    synchronise after every CUDA launch and raise its error (debug)
``KILN_FUZZ_EXAMPLES=N``      kernels ``tests/test_fuzz.py`` generates (long fuzzing runs)
============================  ==========================================================
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def cache_disabled() -> bool:
    return _flag("KILN_NO_CACHE")


def dump_dir() -> Path | None:
    value = os.environ.get("KILN_DUMP_DIR")
    return Path(value) if value else None


def show_stacktrace() -> bool:
    return _flag("KILN_SHOW_STACKTRACE")


def interpret_check_bounds() -> bool:
    return _flag("KILN_INTERPRET_CHECK_BOUNDS", default=True)


def interpret_timeout() -> float:
    return float(os.environ.get("KILN_INTERPRET_TIMEOUT") or 60.0)


def cuda_root() -> Path | None:
    value = os.environ.get("CUDA_ROOT") or os.environ.get("CUDA_HOME")
    return Path(value) if value else None


def ptxas_override() -> Path | None:
    value = os.environ.get("KILN_PTXAS")
    return Path(value) if value else None


def ld_lld_override() -> Path | None:
    value = os.environ.get("KILN_LD_LLD")
    return Path(value) if value else None


def cuobjdump_override() -> Path | None:
    value = os.environ.get("KILN_CUOBJDUMP")
    return Path(value) if value else None


def rocm_runtime_override() -> Path | None:
    value = os.environ.get("KILN_ROCM_RUNTIME")
    return Path(value) if value else None


def launch_blocking() -> bool:
    return _flag("KILN_LAUNCH_BLOCKING")


def fuzz_examples(default: int) -> int:
    """Kernels ``tests/test_fuzz.py`` generates (``KILN_FUZZ_EXAMPLES``; CI uses ``default``)."""
    value = os.environ.get("KILN_FUZZ_EXAMPLES")
    return int(value) if value else default
