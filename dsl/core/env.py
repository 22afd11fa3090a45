"""Every environment variable Kiln reads, in one place.

Read them through these functions (not ``os.environ``) so the set stays documented. A value
that is set but not one the variable accepts raises :class:`~kiln.core.errors.KilnValueError` naming
the variable and what it takes (an empty value counts as unset). Flags accept ``1``/``true``/
``yes``/``on`` and ``0``/``false``/``no``/``off`` (any case).

================================  ======================================================
``KILN_CACHE_DIR``                on-disk compile cache (default ``~/.cache/kiln``); must be
                                  owned by you and not writable by group/others
``KILN_NO_CACHE`` (flag)          never read or write the compile cache
``KILN_DUMP_DIR=dir``             write ``<kernel>.<target>.<key>.<stage>.<ext>`` for every stage
``KILN_SHOW_STACKTRACE`` (flag)   keep Kiln's own frames in error tracebacks
``KILN_INTERPRET_CHECK_BOUNDS``   (flag) bounds checks in the CPU interpreter (default on)
``KILN_INTERPRET_TIMEOUT``        seconds (a finite number > 0, default 60) a blocked
                                  interpreter context waits before a deadlock error
``CUDA_ROOT`` / ``CUDA_HOME``     CUDA toolkit used for ``ptxas`` (cubin and ``-v`` report)
``KILN_PTXAS``                    explicit ``ptxas`` path (overrides ``CUDA_ROOT``); a path
                                  that is not an executable file fails the cubin stage,
                                  ``none`` skips it
``KILN_LD_LLD``                   explicit ``ld.lld`` path for AMD ``hsaco`` linking (same rule)
``KILN_CUOBJDUMP``                explicit ``cuobjdump`` path (SASS schedule check; same rule)
``KILN_ROCM_RUNTIME``             path of ``libmlir_rocm_runtime.so`` for AMD launches
``KILN_LAUNCH_BLOCKING`` (flag)   synchronise after every CUDA launch and raise its error
``KILN_LAUNCHER``                 how CUDA kernels launch: ``native`` (default: the C shim,
                                  else ctypes), ``ctypes`` (``cuLaunchKernel`` by ctypes) or
                                  ``mlir`` (the ExecutionEngine host launcher)
``KILN_NVPTX_PIPELINE``           how LLVM IR becomes PTX: ``fast`` (default: LLVM's C API,
                                  O3 without the function-level SCCP), ``o3`` (C API,
                                  ``default<O3>``) or ``mlir`` (``gpu-module-to-binary``)
``KILN_SCALARIZE_STRUCTS`` (flag)  NVIDIA: carry the 128-register WGMMA accumulators a loop
                                  rebuilds as scalars (``kiln-scalarize-structs``; default on)
``KILN_CC``                       C compiler for the native launch shim (default ``cc``);
                                  ``none``: never build it (the ctypes launcher)
``KILN_CXX``                      C++ compiler for the torch bridge (default ``c++``);
                                  ``none``: never build it (torch's Python paths)
``KILN_JOINT_OUTPUTS`` (flag)     a library call's fresh torch outputs in one allocation
                                  through the torch bridge (default on; off: one each)
``KILN_FUZZ_EXAMPLES=N``          kernels ``tests/test_fuzz.py`` generates (long fuzzing runs)
================================  ======================================================
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _invalid(name: str, value: str, accepts: str) -> Exception:
    # Imported here: kiln.core.errors imports this module.
    from .errors import KilnValueError

    return KilnValueError(f"environment variable {name}={value!r} is not valid: it takes {accepts}",
                          fix=f"set {name} to {accepts}, or unset it")


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _invalid(name, os.environ[name], "1/true/yes/on or 0/false/no/off")


def _path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value) if value else None


def cache_dir() -> Path:
    return _path("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln"


def cache_disabled() -> bool:
    return _flag("KILN_NO_CACHE")


def dump_dir() -> Path | None:
    return _path("KILN_DUMP_DIR")


def show_stacktrace() -> bool:
    return _flag("KILN_SHOW_STACKTRACE")


def interpret_check_bounds() -> bool:
    return _flag("KILN_INTERPRET_CHECK_BOUNDS", default=True)


def interpret_timeout() -> float:
    value = os.environ.get("KILN_INTERPRET_TIMEOUT", "").strip()
    if value == "":
        return 60.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    # An infinite or NaN timeout would let a deadlocked kernel hang the interpreter forever.
    if not (math.isfinite(seconds) and seconds > 0):
        raise _invalid("KILN_INTERPRET_TIMEOUT", os.environ["KILN_INTERPRET_TIMEOUT"],
                       "a number of seconds, finite and > 0 (e.g. 60)")
    return seconds


def fuzz_examples(default: int) -> int:
    """Kernels ``tests/test_fuzz.py`` generates (``KILN_FUZZ_EXAMPLES``; CI uses ``default``)."""
    value = os.environ.get("KILN_FUZZ_EXAMPLES", "").strip()
    if value == "":
        return default
    # isdecimal, not isdigit: int() refuses digits such as "²" that isdigit accepts.
    if not (value.isascii() and value.isdecimal()) or int(value) < 1:
        raise _invalid("KILN_FUZZ_EXAMPLES", os.environ["KILN_FUZZ_EXAMPLES"],
                       "a positive whole number of kernels (e.g. 2000)")
    return int(value)


def cuda_root() -> Path | None:
    return _path("CUDA_ROOT") or _path("CUDA_HOME")


def ptxas_override() -> Path | None:
    return _path("KILN_PTXAS")


def ld_lld_override() -> Path | None:
    return _path("KILN_LD_LLD")


def cuobjdump_override() -> Path | None:
    return _path("KILN_CUOBJDUMP")


def rocm_runtime_override() -> Path | None:
    return _path("KILN_ROCM_RUNTIME")


def launch_blocking() -> bool:
    return _flag("KILN_LAUNCH_BLOCKING")


LAUNCHERS = ("native", "ctypes", "mlir")


def launcher() -> str:
    """``KILN_LAUNCHER``: one of :data:`LAUNCHERS` (default ``native``)."""
    value = os.environ.get("KILN_LAUNCHER", "").strip().lower()
    if value == "":
        return "native"
    if value not in LAUNCHERS:
        raise _invalid("KILN_LAUNCHER", os.environ["KILN_LAUNCHER"], " or ".join(LAUNCHERS))
    return value


NVPTX_PIPELINES = ("fast", "o3", "mlir")


def nvptx_pipeline() -> str:
    """``KILN_NVPTX_PIPELINE``: one of :data:`NVPTX_PIPELINES` (default ``fast``)."""
    value = os.environ.get("KILN_NVPTX_PIPELINE", "").strip().lower()
    if value == "":
        return "fast"
    if value not in NVPTX_PIPELINES:
        raise _invalid("KILN_NVPTX_PIPELINE", os.environ["KILN_NVPTX_PIPELINE"],
                       " or ".join(NVPTX_PIPELINES))
    return value


def scalarize_structs() -> bool:
    """``KILN_SCALARIZE_STRUCTS``: run ``kiln-scalarize-structs`` before the NVVM lowering."""
    return _flag("KILN_SCALARIZE_STRUCTS", default=True)


def c_compiler() -> str | None:
    """``KILN_CC`` (default ``cc``); None when set to ``none``."""
    value = os.environ.get("KILN_CC", "").strip()
    if value.lower() == "none":
        return None
    return value or "cc"


def cxx_compiler() -> str | None:
    """``KILN_CXX`` (default ``c++``); None when set to ``none``."""
    value = os.environ.get("KILN_CXX", "").strip()
    if value.lower() == "none":
        return None
    return value or "c++"


def joint_outputs() -> bool:
    """``KILN_JOINT_OUTPUTS`` (default on): a library call's fresh torch outputs share one
    allocation (the torch bridge's joint makers)."""
    return _flag("KILN_JOINT_OUTPUTS", default=True)

