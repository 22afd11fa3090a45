"""Run the lit suite (tests/lit) so that `pytest` alone covers the FileCheck tests."""

import subprocess
import sys
from pathlib import Path

import pytest

LIT_DIR = Path(__file__).parent / "lit"


@pytest.mark.lit
def test_lit_suite_passes():
    runner = "from lit.main import main; main()"  # the lit package has no __main__
    done = subprocess.run([sys.executable, "-c", runner, "-q", str(LIT_DIR)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
