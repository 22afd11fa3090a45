"""``bench/compile_ab.py``: variants compile cold from forked servers, each with its own
environment or code tree, and the JSON holds every variant's row and its ratio to the first."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.lower
@pytest.mark.slow  # two cold compiles in child processes
def test_two_variants_of_saxpy_side_by_side(tmp_path):
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(BENCH / "compile_ab.py"), "--variant", "head",
                           "--variant", "mlir:KILN_NVPTX_PIPELINE=mlir", "--variant",
                           f"tree@{BENCH.parent}", "--repeat", "1", "--json", str(out),
                           "saxpy_sm90"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result
    assert [v["name"] for v in result["variants"]] == ["head", "mlir", "tree"]
    assert result["variants"][1]["env"] == {"KILN_NVPTX_PIPELINE": "mlir"}
    assert result["variants"][2]["kiln"] == str(BENCH.parent / "dsl" / "__init__.py")
    (row,) = result["rows"]
    assert row["kernel"] == "saxpy_sm90" and set(row["ratio"]) == {"head", "mlir", "tree"}
    for variant in row["variants"].values():
        assert 0 < variant["compile_s"] < 60
        assert {"trace", "ptx", "cubin"} <= set(variant["stages"])
    assert row["ratio"]["head"] == 1.0
    assert result["host_ms"]["before"] > 0


def test_an_unknown_kernel_is_refused(monkeypatch, capsys):
    """In this process (a child would pay `import kiln` to parse its arguments): argparse's
    exit status 2 and the message, before any server starts."""
    monkeypatch.syspath_prepend(str(BENCH))
    import compile_ab

    with pytest.raises(SystemExit) as stop:
        compile_ab.main(["no_such_kernel"])
    assert stop.value.code == 2 and "unknown kernels" in capsys.readouterr().err
