"""A lit format that runs ``%python``/``%kiln-opt`` RUN lines in a fork of the lit worker.

Every lit test used to start a fresh Python that spent ~0.45 s importing Kiln, MLIR and numpy
before doing ~50 ms of work. lit.cfg.py imports Kiln before lit forks its workers, so a test
whose every RUN line is ``[not] %python|%kiln-opt ARGS [2>&1] | FileCheck ARGS`` runs here as
``os.fork()`` of the worker: the child (its own process, as isolated as before: its crashes,
globals and MLIR contexts die with it) redirects fds 0-2, takes the test's environment and
working directory, runs the script (as ``__main__``) or ``kiln-opt``'s ``main``, and exits;
its output goes to FileCheck. Any other RUN line, ``--timeout``, or ``--param fork=0`` runs
the test through lit's shell exactly as :class:`lit.formats.ShTest` does.
"""

import gc
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import traceback

import lit.Test
import lit.TestRunner
import lit.formats
import lit.util

from kiln.lowering import opt as kiln_opt


class ForkShTest(lit.formats.ShTest):
    """ShTest whose ``%python``/``%kiln-opt`` pipelines into FileCheck run in a fork.

    ``python_cmd`` and ``opt_cmd`` are the token lists ``%python`` and ``%kiln-opt`` expand to.
    """

    def __init__(self, python_cmd, opt_cmd):
        super().__init__()
        self.python_cmd = list(python_cmd)
        self.opt_cmd = list(opt_cmd)

    def execute(self, test, lit_config):
        if (not hasattr(os, "fork") or lit_config.maxIndividualTestTime
                or lit_config.params.get("fork", "1") == "0" or test.config.unsupported
                or lit_config.noExecute):
            return super().execute(test, lit_config)
        script = lit.TestRunner.parseIntegratedTestScript(test)
        if isinstance(script, lit.Test.Result):
            return script
        tmp_dir, tmp_base = lit.TestRunner.getTempPaths(test)
        script = lit.TestRunner.applySubstitutions(
            script, lit.TestRunner.getDefaultSubstitutions(test, tmp_dir, tmp_base),
            {feature: True for feature in test.config.available_features},
            recursion_limit=test.config.recursiveExpansionLimit)
        commands = [self._parse(line) for line in script]
        if not commands or None in commands:
            return super().execute(test, lit_config)
        log = []
        for command in commands:
            ok, text = self._run(test, *command)
            log.append(text)
            if not ok:
                return lit.Test.Result(lit.Test.FAIL, "\n".join(log))
        return lit.Test.Result(lit.Test.PASS, "\n".join(log))

    def _parse(self, line):
        """``(negate, kind, args, merge_stderr, filecheck_args)`` or None (not a fork case)."""
        match = re.fullmatch(lit.TestRunner.kPdbgRegex, line)
        line = (match.group(2) if match else line).strip()
        try:
            tokens = shlex.split(line)
        except ValueError:
            return None
        negate = tokens[:1] == ["not"]
        tokens = tokens[negate:]
        if "|" not in tokens:
            return None
        bar = tokens.index("|")
        left, filecheck = tokens[:bar], tokens[bar + 1:]
        merge = left[-1:] == ["2>&1"]
        left = left[:-1] if merge else left
        if filecheck[:1] != ["FileCheck"] or "|" in filecheck:
            return None
        for kind, prefix in (("opt", self.opt_cmd), ("python", self.python_cmd)):
            if left[:len(prefix)] == prefix and len(left) > len(prefix):
                args = left[len(prefix):]
                if any(re.search(r"[<>&;$`*?]", arg) for arg in args) or (
                        kind == "python" and args[0].startswith("-")):
                    return None  # a redirection, glob or interpreter flag: lit's shell runs it
                return negate, kind, args, merge, filecheck[1:]
        return None

    def _run(self, test, negate, kind, args, merge, filecheck_args):
        env = dict(test.config.environment)
        cwd = os.path.dirname(test.getExecPath())
        with tempfile.TemporaryDirectory(prefix="kiln-lit-") as tmp:
            out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            status = _fork_and_run(kind, args, env, cwd, out_path,
                                   out_path if merge else err_path)
            with open(out_path, "rb") as handle:
                out = handle.read()
            err = b""
            if not merge and os.path.exists(err_path):
                with open(err_path, "rb") as handle:
                    err = handle.read()
        crashed = status < 0
        ok = not crashed and ((status != 0) if negate else (status == 0))
        shown = " ".join(["not"] * negate + [kind] + args)
        text = (f"$ {shown}  (forked; exit {'signal ' + str(-status) if crashed else status})\n"
                f"# stdout:\n{out.decode(errors='replace')}"
                + (f"# stderr:\n{err.decode(errors='replace')}" if err else ""))
        if not ok:
            return False, text
        filecheck = lit.util.which("FileCheck", env.get("PATH", ""))
        done = subprocess.run([filecheck or "FileCheck", *filecheck_args], input=out,
                              capture_output=True, env=env, cwd=cwd)
        text += (f"$ FileCheck {' '.join(filecheck_args)}  (exit {done.returncode})\n"
                 + done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace"))
        return done.returncode == 0, text


def _fork_and_run(kind, args, env, cwd, out_path, err_path):
    """Run one command in a fork; its exit status, or minus the signal that ended it."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the child's collections skip the objects it inherits (and leave them shared)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(kind, args, env, cwd, out_path, err_path)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _child(kind, args, env, cwd, out_path, err_path):
    """The forked child's work: redirect, run like a fresh process would, return its status."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(out_path, flags, 0o600), 1)
    os.dup2(os.open(err_path, flags, 0o600), 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    try:
        if kind == "opt":
            sys.argv = ["kiln-opt", *args]
            code = kiln_opt.main(args)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
            code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child reports everything, as python would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code)
