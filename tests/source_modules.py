"""Loading kernels that live in files: the examples, and kernels a test writes to disk.

Kiln reads a kernel's source with ``inspect``, so kernels must come from real ``.py`` files; tests
that need a fresh file (to pin line numbers in error messages) write one and load it here.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """Import the Python file ``path`` as a module named ``name`` (default: its stem)."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module."""
    return load_module(EXAMPLES / f"{name}.py", f"kiln_example_{name}")


def write_kernel_module(directory: Path, name: str, source: str) -> ModuleType:
    """Write ``source`` (dedented) to ``directory/<name>.py`` and import it."""
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source).lstrip())
    return load_module(path)
