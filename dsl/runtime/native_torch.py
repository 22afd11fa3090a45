"""The torch bridge (``native_torch.cpp``): fresh torch tensors, tensor guards and tensor views
made in C++, built at first use against the imported torch wheel, cached, checked, loaded.

A library call's host time is mostly torch's: a fresh output through ``torch.empty_like`` costs
2.1-3.9 µs on an H200 host (Python argument parsing, the dispatcher, the caching allocator, the
wrapper object), a guard reads each tensor's attributes through Python. The bridge does the
same in C++ on the tensor's own metadata (1.0-1.9 µs a fresh tensor in the same runs, the
allocator's share about 0.5; a five-tensor guard 0.18 µs instead of 1.25;
``bench/host_alloc.py``, docs/kernels.md). :func:`torch_bridge`'s ``empty_maker(template,
shape, fallback)`` is a C callable giving a fresh contiguous tensor of ``shape`` with the
template's dtype and device (from its storage's allocator: the caching allocator, so streams
and CUDA-graph pools behave as for ``torch.empty``; with torch's deterministic fill of new
memory on it calls ``fallback``);
``tensor_guard(tensors)`` is a C check that tensors are laid out as these (type, shape, strides,
dtype, device, dispatch keys); ``TORCH_VIEW`` is a capsule the launch shim reads tensors with
(``native_launch.h``).

It is built with ``KILN_CXX`` (default ``c++``; ``none``: no bridge) against torch's headers
and libraries, and cached like the launch shim (:mod:`kiln.runtime.native`, same trust model);
its key adds the torch version and the paths of its headers and libraries. Without a compiler,
headers, a usable cache (``KILN_NO_CACHE``: a build per process would cost more than it
saves) or a torch whose tensor object is laid out as the bridge expects (checked when it
loads), :func:`torch_bridge` is None and callers keep their Python paths.

Example::

    bridge = torch_bridge()
    if bridge is not None:
        make = bridge.empty_maker(x.new_empty(()), (4, 8), lambda: x.new_empty((4, 8)))
        y = make()            # a fresh [4, 8] tensor like x
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from kiln.core import env
from kiln.core.trusted_dir import usable_root
from kiln.runtime.native import Extension, compiler_identity, load_extension, native_module

SOURCES = (Path(__file__).with_name("native_torch.cpp"),)
MODULE_NAME = "_kiln_torch"
BUILD_TIMEOUT_S = 300  # C++ against ATen's headers: 4 s on an idle H200 host, minutes on a busy one


def torch_bridge(build: bool = True):
    """The loaded bridge for this process, or None; only once torch is imported (it never
    imports torch). ``build=False`` (a launch path that must not pay a first build, about a
    second): only a bridge loaded already or found in the cache (looked for once)."""
    if _LOADED:
        return _LOADED[0]
    if "torch" not in sys.modules or (not build and _PROBED):
        return None
    bridge = load_bridge(env.cxx_compiler(), build=build)
    if bridge is None and not build:
        _PROBED.append(True)
        return None
    use_bridge(bridge)
    return bridge


def use_bridge(bridge) -> None:
    """Make ``bridge`` (a loaded bridge, or None for torch's Python paths) what
    :func:`torch_bridge` returns and what the launch shim reads tensors with, from now on
    (plans and launchers made before keep what they took). For A/B benches and tests.
    Example: ``use_bridge(None)``."""
    _LOADED[:] = [bridge]
    shim = native_module()
    if bridge is not None:
        import torch

        bridge.set_out_of_memory_error(getattr(torch, "OutOfMemoryError", RuntimeError))
    if shim is not None and hasattr(shim, "set_torch_view") and \
            (bridge is None or getattr(shim, "TORCH_VIEW_BYTES", None) == bridge.VIEW_BYTES):
        shim.set_torch_view(None if bridge is None else bridge.TORCH_VIEW)


def why_not_loaded() -> str | None:
    """Why :func:`torch_bridge` gives no bridge in this process (one line, naming the fix),
    or None when it gives one. Example: ``print(why_not_loaded() or "bridge loaded")``."""
    if _LOADED and _LOADED[0] is not None:
        return None
    if "torch" not in sys.modules:
        return "torch is not imported"
    compiler = env.cxx_compiler()
    if compiler is None:
        return "KILN_CXX=none turns it off"
    if usable_root() is None:
        return ("no usable compile cache (KILN_NO_CACHE, or KILN_CACHE_DIR not a private "
                "directory of yours): the bridge is only built into the cache")
    if compiler_identity(compiler) is None:
        return f"no C++ compiler {compiler!r} (set KILN_CXX)"
    if _LOADED:
        return "turned off (use_bridge(None)), or its build or load failed (see the warning)"
    return "not built yet: torch_bridge() builds it"


_LOADED: list = []  # [the bridge or None] once built or refused
_PROBED: list = []  # [True] once a cache-only look found nothing


def load_bridge(compiler: str | None, root: Path | None = None, build: bool = True):
    """The bridge built by ``compiler`` (None: no bridge) for the imported torch, cached under
    ``root`` (default: the compile cache's ``native/`` directory; ``build=False``: only from
    there). Not memoised: for tests."""
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)  # None: no torch, or a stand-in module
    if compiler is None or where is None or not SOURCES[0].exists():
        return None
    if root is None and usable_root() is None:
        return None  # no cache: a build per process (seconds) would cost more than it saves
    identity = compiler_identity(compiler)
    package = Path(where).parent
    include, lib = package / "include", package / "lib"
    python_include = sysconfig.get_paths()["include"]
    if identity is None or not (include / "ATen" / "EmptyTensor.h").exists() or \
            not (Path(python_include) / "Python.h").exists():
        return None
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}", f"-I{python_include}",
               str(SOURCES[0]), f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch_python",
               f"-Wl,-rpath,{lib}"]
    key_parts = (identity, python_include, str(torch.__version__), str(include), str(lib),
                 str(abi))
    extension = Extension(MODULE_NAME, SOURCES, command, key_parts, "torch bridge",
                          BUILD_TIMEOUT_S)
    return load_extension(extension, root, build)
