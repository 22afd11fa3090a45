"""The docs' examples run: every ```` ```python runnable ```` block of ``docs/language.md``,
``docs/lowering.md``, ``docs/tiles.md`` and the library pages ``docs/library/*.md`` (which run the
kernels with ``backend="interpret"``) is executed, and a ```` ```text output ```` block
right after it must match what the block printed.

Blocks of one document run in order in one namespace (a later block may use an earlier block's
imports and kernels), each from its own file ``<dir>/<doc>_<n>/example.py``, so kernels have
source to trace and error messages show ``example.py:<line in the block>``. In expected output a
line ``...`` matches any number of lines. A block whose fence also says ``needs-ld.lld`` or
``needs-ptxas`` runs only where that tool is found; the others still run, and the test then
skips naming the blocks it could not check (``.ci/run`` installs ``ld.lld``). Nothing is
launched, even on a GPU machine: the CUDA probe is patched to report no GPU, so
``cuda_available()`` guards skip and launches raise ``LaunchError``. The compile cache goes to a temporary directory.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

import kiln.runtime.cuda
from kiln.lowering.tools import find_ld_lld, find_ptxas

DOCS = Path(__file__).resolve().parent.parent / "docs"
DOC_NAMES = ("language.md", "lowering.md", "tiles.md", "library/prefill.md", "library/decode.md",
             "library/combine.md", "library/matmul.md")
_FENCE = re.compile(r"^```(\w*)((?:[ \t]+[\w.-]+)*)[ \t]*$")
TOOLS = {"needs-ld.lld": find_ld_lld, "needs-ptxas": find_ptxas}  # fence word -> tool finder


def doc_blocks(text: str) -> list[tuple[int, str, str | None, tuple[str, ...]]]:
    """(line of the fence, code, expected output or None, ``needs-*`` words) for each runnable
    python block."""
    blocks, lines, i = [], text.splitlines(), 0
    fences = []  # (start line, language, words after it, body)
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match and match.group(1):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```")
            fences.append((i + 1, match.group(1), tuple(match.group(2).split()),
                           "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    for k, (line, language, words, body) in enumerate(fences):
        if language != "python" or words[:1] != ("runnable",):
            continue
        unknown = set(words[1:]) - set(TOOLS)
        assert not unknown, f"line {line}: unknown fence words {sorted(unknown)}"
        expected = None
        following = fences[k + 1] if k + 1 < len(fences) else None
        if following is not None and following[1:3] == ("text", ("output",)):
            expected = fences[k + 1][3]
        blocks.append((line, body + "\n", expected, words[1:]))
    return blocks


def output_matches(expected: str, actual: str) -> bool:
    """Line-wise equality (trailing spaces ignored) where an expected ``...`` line skips lines."""
    want = [line.rstrip() for line in expected.strip("\n").splitlines()]
    got = [line.rstrip() for line in actual.strip("\n").splitlines()]

    def match(w: int, g: int) -> bool:
        if w == len(want):
            return g == len(got)
        if want[w] == "...":
            return any(match(w + 1, k) for k in range(g, len(got) + 1))
        return g < len(got) and want[w] == got[g] and match(w + 1, g + 1)

    return match(0, 0)


def test_output_matching_rules():
    assert output_matches("a\n...\nd", "a\nb\nc\nd")
    assert output_matches("a\n...", "a")
    assert not output_matches("a\nd", "a\nb\nd")
    assert not output_matches("a\n...\ne", "a\nb\nd")


def test_doc_blocks_pairs_code_with_its_output():
    text = ("```python runnable\nprint(1)\n```\n```text output\n1\n```\n"
            "```python\nnot run\n```\n```python runnable needs-ld.lld\nx = 2\n```\n")
    assert doc_blocks(text) == [(1, "print(1)\n", "1", ()),
                                (10, "x = 2\n", None, ("needs-ld.lld",))]


def test_blocks_needing_a_missing_tool_are_skipped_by_name(tmp_path, monkeypatch):
    """Without ld.lld the other blocks still run (and must pass); the skip names the rest."""
    monkeypatch.setitem(TOOLS, "needs-ld.lld", lambda: None)
    monkeypatch.setitem(TOOLS, "needs-ptxas", lambda: "/bin/ptxas")
    blocks = [(1, "print(1)\n", "1", ()), (5, "raise RuntimeError\n", None, ("needs-ld.lld",)),
              (9, "print(3)\n", "3", ("needs-ptxas",))]
    with pytest.raises(pytest.skip.Exception, match=r"not run, their tool is missing: "
                                                    r"x\.md:5 \(needs-ld\.lld\)$"):
        _run_blocks("x.md", blocks, {}, tmp_path / "first", monkeypatch)
    blocks[2] = (9, "print(3)\n", "4", ("needs-ptxas",))
    with pytest.raises(AssertionError, match="x.md:9: output differs"):
        _run_blocks("x.md", blocks, {}, tmp_path / "second", monkeypatch)


@pytest.mark.lower
@pytest.mark.parametrize("doc", DOC_NAMES)
def test_doc_examples_run(doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_DUMP_DIR", raising=False)
    monkeypatch.delenv("KILN_SHOW_STACKTRACE", raising=False)
    monkeypatch.setattr(kiln.runtime.cuda, "_probe", lambda: "the docs examples are compile-only")
    blocks = doc_blocks((DOCS / doc).read_text())
    assert blocks, f"{doc} has no runnable examples"
    namespace: dict = {"__name__": f"kiln_docs_{doc.split('.')[0]}"}
    environ = dict(os.environ)  # examples set and unset KILN_DUMP_DIR; undo a failed one's
    try:
        _run_blocks(doc, blocks, namespace, tmp_path, monkeypatch)
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)


def _run_blocks(doc, blocks, namespace, tmp_path, monkeypatch):
    not_run = []  # "<doc>:<line> (needs-...)" of blocks whose tool is missing
    for n, (line, code, expected, needs) in enumerate(blocks):
        missing = [word for word in needs if TOOLS[word]() is None]
        if missing:
            not_run.append(f"{doc}:{line} ({', '.join(missing)})")
            continue
        folder = tmp_path / f"{doc.split('.')[0]}_{n}"
        folder.mkdir(parents=True)
        path = folder / "example.py"
        path.write_text(code)
        monkeypatch.chdir(folder)
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            try:
                exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - our own docs
            except Exception as err:
                pytest.fail(f"{doc}:{line}: example raised {type(err).__name__}:\n{err}")
        printed = stdout.getvalue().replace(f"{folder}/", "")
        if expected is not None:
            assert output_matches(expected, printed), (
                f"{doc}:{line}: output differs.\n--- documented\n{expected}\n--- printed\n{printed}")
    if not_run:
        pytest.skip("the other examples pass; not run, their tool is missing: "
                    + "; ".join(not_run))


def _stage_row(text: str, stage_cell: str) -> list[str]:
    """The cells of lowering.md's stage-table row whose first cell is ``stage_cell``."""
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {stage_cell} |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_every_kiln_pass_is_documented_where_it_runs(capsys, monkeypatch):
    """``kiln-opt --list-passes`` and the docs cannot drift apart: passes.md names every
    registered pass, and each Kiln pass a lowering stage runs is in that stage's table row."""
    from types import SimpleNamespace

    from kiln.lowering.amd import rocdl_passes
    from kiln.lowering.nvidia import nvvm_passes
    from kiln.core.options import CompileOptions
    from kiln.lowering.pipeline import GPU_STAGE_PASSES
    from kiln.passes import kiln_passes
    from kiln.lowering.opt import main

    assert main(["--list-passes"]) == 0
    registered = {line.split(":")[0] for line in capsys.readouterr().out.splitlines()}
    assert registered == set(kiln_passes()) and len(registered) >= 8
    passes_md = (DOCS / "passes.md").read_text()
    assert sorted(p for p in registered if f"`{p}`" not in passes_md) == []
    lowering_md = (DOCS / "lowering.md").read_text()

    def kiln_names(pipeline) -> set[str]:
        names = set(re.findall(r"kiln-[a-z0-9-]+", " ".join(pipeline)))
        assert names <= registered, names - registered
        return names

    nvidia = CompileOptions("sm_90a", flush_denormals=True)
    monkeypatch.setenv("KILN_SCALARIZE_STRUCTS", "1")  # the nvvm stage with every optional pass
    amd = CompileOptions("gfx950")
    runs = [("`gpu`", 1, GPU_STAGE_PASSES), ("`gpu`", 2, GPU_STAGE_PASSES),
            ("`nvvm` / `rocdl`", 1, nvvm_passes(SimpleNamespace(options=nvidia,
                                                                target=nvidia.chip))),
            ("`nvvm` / `rocdl`", 2, rocdl_passes(SimpleNamespace(options=amd, target=amd.chip)))]
    from kiln.lowering.pipeline import VERIFY_RINGS
    runs += [("`gpu`", 1, [VERIFY_RINGS]), ("`gpu`", 2, [VERIFY_RINGS])]  # for verify-waits
    used = set()
    for stage_cell, column, pipeline in runs:
        cell = _stage_row(lowering_md, stage_cell)[column]
        cell = _stage_row(lowering_md, stage_cell)[1] if cell == "same" else cell
        names = kiln_names(pipeline)
        used |= names
        assert sorted(n for n in names if f"`{n}`" not in cell) == [], (stage_cell, column)
    assert used == registered  # every registered pass runs in some stage
