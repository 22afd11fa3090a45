"""The layer contract (docs/architecture.md): every import, function-level ones included, goes
down the stack core -> dsl -> passes -> backends -> runtime -> interpreter -> library. The facade
``kiln/__init__`` and ``kiln.cli`` may import every layer; only the library and the CLI import
the facade."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it holds (pyproject's package-dir).
PACKAGE_DIRS = {"dsl": "kiln", "passes": "kiln.passes", "lowering": "kiln.lowering",
                "kernels": "kiln.kernels"}
# Lowest first: a module may import its own layer and the ones before it.
LAYERS = ("core", "dsl", "passes", "backends", "runtime", "interpreter", "facade", "library")
EXEMPT = {"kiln.cli"}  # the command line drives every layer


def layer_of(module: str) -> str | None:
    """The layer of a ``kiln`` module, None for a module outside Kiln."""
    if module != "kiln" and not module.startswith("kiln."):
        return None
    prefixes = (("kiln.core", "core"), ("kiln.passes", "passes"), ("kiln.lowering", "backends"),
                ("kiln.runtime", "runtime"), ("kiln.interpreter", "interpreter"),
                ("kiln.kernels", "library"))
    for prefix, layer in prefixes:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "facade" if module == "kiln" else "dsl"


def module_files(root: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``) for every module under ``root``."""
    found = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = package.split(".") + list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def import_edges(root: Path, *, in_functions: bool = False) -> list[tuple[str, str, int, str]]:
    """(module, file:line, line, imported module) for every import statement of every module,
    at any depth (with ``in_functions``, only those inside a function); ``from package import
    name`` counts as importing ``package.name`` when that is a module."""
    modules = module_files(root)
    edges = []
    for module, (path, is_package) in modules.items():
        here = module.split(".") if is_package else module.split(".")[:-1]
        tree = ast.parse(path.read_text(), str(path))
        nested = {id(inner) for fn in ast.walk(tree)
                  if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for inner in ast.walk(fn) if inner is not fn}
        for node in ast.walk(tree):
            if in_functions and id(node) not in nested:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            edges.extend((module, where, node.lineno, t) for t in dict.fromkeys(targets))
    return edges


def violations(edges) -> list[str]:
    """Every edge that goes up the stack (or into the facade from below the library)."""
    found = []
    for module, where, _, target in edges:
        source, dest = layer_of(module), layer_of(target)
        if dest is None or source is None or module in EXEMPT or source == "facade":
            continue
        if LAYERS.index(dest) > LAYERS.index(source):
            found.append(f"{where}: {module} ({source}) imports {target} ({dest})")
    return found


def test_the_tree_keeps_the_layer_contract():
    assert violations(import_edges(ROOT)) == []


# Kiln imports inside functions that stay, each for its reason; everything else imports at the
# top, so the graph above is the import order. The library's own are left to its runtime work.
LATE_IMPORTS = {
    ("kiln.core.env", "kiln.core.errors"),  # errors reads env at import; env raises its errors
    ("kiln", "kiln.interpreter"),  # the facade installs it lazily: 17 modules no compile needs
}


def test_kiln_modules_import_each_other_at_the_top():
    late = {(m, t) for m, _, _, t in import_edges(ROOT, in_functions=True)
            if layer_of(t) is not None and layer_of(m) != "library"}
    assert late <= LATE_IMPORTS, sorted(late - LATE_IMPORTS)


def test_the_scan_sees_every_layer():
    layers = {layer_of(m) for m in module_files(ROOT)}
    assert layers == set(LAYERS)


@pytest.mark.parametrize("source, target, bad", [
    ("kiln.kernel", "kiln.lowering.compiler", True),       # dsl -> backends
    ("kiln.passes.verify_waits", "kiln.lowering.pipeline", True),
    ("kiln.lowering.compiler", "kiln.runtime.cache", True),
    ("kiln.runtime.launch", "kiln.interpreter", True),
    ("kiln.core.errors", "kiln.tensor", True),            # core -> dsl
    ("kiln.tensor", "kiln", True),                         # the facade pulls in every layer
    ("kiln.lowering.compiler", "kiln.passes", False),
    ("kiln.interpreter.run", "kiln.runtime.launch", False),
    ("kiln.kernels.gemm", "kiln", False),
    ("kiln", "kiln.kernels", False),                       # the facade is exempt
    ("kiln.cli", "kiln.lowering.compiler", False),
    ("kiln.tensor", "numpy", False),
])
def test_a_synthetic_edge_is_judged_by_the_layer_order(source, target, bad):
    assert bool(violations([(source, "x.py:1", 1, target)])) is bad


def test_a_planted_back_edge_names_its_module_and_line(tmp_path):
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "dsl" / "__init__.py").write_text("from . import kernel\n")
    (tmp_path / "dsl" / "kernel.py").write_text(
        "import numpy\n\n\ndef compile():\n    from kiln.lowering import compiler\n")
    (tmp_path / "lowering" / "compiler.py").write_text("from kiln import kernel\n")
    found = violations(import_edges(tmp_path))
    assert found == ["dsl/kernel.py:5: kiln.kernel (dsl) imports kiln.lowering.compiler "
                     "(backends)"]
    late = import_edges(tmp_path, in_functions=True)
    assert [(m, where, t) for m, where, _, t in late] == [
        ("kiln.kernel", "dsl/kernel.py:5", "kiln.lowering.compiler")]
