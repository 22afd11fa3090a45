"""bench/RESULTS.md is generated from bench/results/*.json and up to date; every results file
carries the metadata that says what ran where (CPU only: no GPU stack is imported)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench(monkeypatch):
    """The bench helpers, imported the way the scripts import them (bench/ on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import results_io
    import results_page

    return results_io, results_page


def test_the_page_is_generated_from_the_committed_json(bench):
    _, page = bench
    assert page.main(["--check"]) == 0, "run: python bench/results_page.py"


def test_a_stale_page_fails_the_check(bench, monkeypatch, tmp_path, capsys):
    _, page = bench
    stale = tmp_path / "RESULTS.md"
    monkeypatch.setattr(page, "PAGE", stale)
    stale.write_text(page.render(page.load_results()) + "an edit by hand\n")
    assert page.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert page.main([]) == 0 and page.main(["--check"]) == 0


def test_every_results_file_says_what_ran_where_and_when(bench):
    io, _ = bench
    files = sorted((BENCH / "results").glob("*.json"))
    assert {json.loads(f.read_text())["benchmark"] for f in files} >= {
        "decode", "attention", "combine", "gemm", "launch_overhead"}
    for path in files:
        doc = json.loads(path.read_text())
        assert set(io.REQUIRED_FIELDS) <= doc.keys(), path
        for field in ("device", "commit", "command", "source"):
            assert isinstance(doc[field], str) and doc[field], (path, field)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]), path
        assert doc["rows"] and all(isinstance(row, dict) for row in doc["rows"]), path
        assert path.name == io.canonical_name(doc), path


def test_a_benchmark_run_writes_the_metadata_and_the_page_prints_its_ratios(bench, tmp_path,
                                                                           monkeypatch):
    io, page = bench
    monkeypatch.setattr(sys, "argv", [str(BENCH / "gemm.py"), "--json", "out.json"])
    rows = [{"m": 8192, "n": 8192, "k": 8192, "kiln_tflops": 650.0, "cublas_tflops": 700.0}]
    io.write_results(str(tmp_path / "gemm.json"), "gemm", rows, sweep=[])
    doc = json.loads((tmp_path / "gemm.json").read_text())
    assert set(io.REQUIRED_FIELDS) <= doc.keys() and doc["source"] == "measured"
    assert doc["command"] == "python bench/gemm.py --json out.json"
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH,
                          capture_output=True, text=True).stdout.strip()
    assert doc["commit"].split("+")[0] == (head or "unknown")
    section = "\n".join(page.table({**doc, "_file": "gemm.x.json"}))
    assert "| 8192×8192×8192 | 650 | 700 | 0.929 |" in section  # Kiln / cuBLAS computed


def test_the_page_generator_imports_no_gpu_stack():
    code = ("import sys, results_page; results_page.render(results_page.load_results()); "
            "assert not {'torch', 'kiln', 'numpy'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], cwd=BENCH, check=True)
