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


# Cases of a throwaway suite run by the fork format: (file, source, lit's verdict).
FORKED_CASES = [
    ("prints.py", 'print("hello", __name__)\n# CHECK: hello __main__\n', "PASS"),
    ("wrong_check.py", 'print("hello")\n# CHECK: goodbye\n', "FAIL"),
    ("raises.py", 'print("hello")\nraise RuntimeError("boom")\n# CHECK: hello\n', "FAIL"),
    ("aborts.py", 'import os, sys\nprint("hello")\nsys.stdout.flush()\nos.abort()\n'
                  '# CHECK: hello\n', "FAIL"),
    ("fails_as_expected.py", 'import sys\nprint("to stderr", file=sys.stderr)\nsys.exit(3)\n'
                             '# CHECK: to stderr\n', "PASS"),
    ("passes_unexpectedly.py", 'print("fine")\n# CHECK: fine\n', "FAIL"),
]


@pytest.mark.lit
def test_forked_run_lines_report_failures_like_fresh_processes(tmp_path):
    """A wrong CHECK, an exception, a crash and a `not` that succeeds fail; the child's
    stdout, stderr (2>&1) and exit status reach FileCheck and `not` as a fresh process's would."""
    (tmp_path / "lit.cfg.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(LIT_DIR)!r})\n"
        "from fork_format import ForkShTest\n"
        "import llvm\n"
        "config.name = 'forked'\nconfig.suffixes = ['.py']\nconfig.excludes = ['lit.cfg.py']\n"
        "config.test_source_root = os.path.dirname(__file__)\n"
        "config.environment['PATH'] = os.path.join(llvm.__path__[0], 'bin') + os.pathsep + "
        "os.environ.get('PATH', '')\n"
        "config.substitutions.append(('%python', sys.executable))\n"
        "config.test_format = ForkShTest([sys.executable],\n"
        "                                [sys.executable, '-m', 'kiln.lowering.opt'])\n")
    for name, source, _ in FORKED_CASES:
        run = "not %python %s 2>&1" if name.startswith(("fails_", "passes_")) else "%python %s"
        (tmp_path / name).write_text(f"# RUN: {run} | FileCheck %s\n{source}")
    runner = "from lit.main import main; main()"
    done = subprocess.run([sys.executable, "-c", runner, "-a", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    verdicts = dict(line.split(": forked :: ")[::-1] for line in done.stdout.splitlines()
                    if ": forked :: " in line)
    assert {name.split(" ")[0]: v for name, v in verdicts.items()} == {
        name: verdict for name, _, verdict in FORKED_CASES}, done.stdout + done.stderr
    assert done.stdout.count("(forked; exit") >= len(FORKED_CASES)
    assert "RuntimeError: boom" in done.stdout and "(forked; exit signal 6)" in done.stdout
