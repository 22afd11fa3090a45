"""The ``kiln compile`` command line: stages, reports, constexprs, argument types and errors."""

import subprocess
import sys
import textwrap

import pytest

from kiln.cli import main
from kiln.lowering import nvptx_llvm

pytestmark = pytest.mark.lower

KERNEL_SOURCE = textwrap.dedent('''
    import kiln
    from kiln import f32, i32

    @kiln.kernel
    def scale(x: kiln.Tensor[f32], n: i32, a: f32, BLOCK: kiln.constexpr):
        i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
        if i < n:
            x[i] = a * x[i]

    @kiln.kernel
    def untyped(x, n):
        i = kiln.thread_id(0)
        if i < n:
            x[i] = x[i] + 1.0
''')


@pytest.fixture
def kernel_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    path = tmp_path / "scale_kernels.py"
    path.write_text(KERNEL_SOURCE)
    return path


def test_emit_amdgcn_with_constexpr(kernel_file, capsys):
    assert main(["compile", f"{kernel_file}:scale", "--target", "gfx950", "--emit", "amdgcn",
                 "-D", "BLOCK=128"]) == 0
    out = capsys.readouterr().out
    assert '.amdgcn_target "amdgcn-amd-amdhsa--gfx950"' in out
    assert "v_lshl_add_u32" in out  # block_id * 128 + thread_id folded into one instruction


def test_emit_ptx_to_file(kernel_file, tmp_path):
    out = tmp_path / "scale.ptx"
    assert main(["compile", f"{kernel_file}:scale", "--target", "sm_90a", "--emit", "ptx",
                 "-D", "BLOCK=256", "-o", str(out)]) == 0
    assert ".target sm_90a" in out.read_text()


def test_report_lists_stages_and_resources(kernel_file, capsys):
    assert main(["compile", f"{kernel_file}:scale", "--target", "gfx942", "--report",
                 "-D", "BLOCK=64"]) == 0
    out = capsys.readouterr().out
    assert "kernel scale for gfx942" in out
    for key in ("amdgcn", "vgpr_count", "sgpr_count", "scratch_bytes", "lds_bytes"):
        assert key in out


def _profile_rows(out: str) -> dict[str, tuple[float, float]]:
    """step -> (wall ms, cpu ms) from the report's compile profile table."""
    table = out.split("compile profile", 1)[1].splitlines()[2:]
    rows = {}
    for line in table:
        name, wall, cpu = line.split()
        rows[name] = (float(wall), float(cpu))
    return rows


@pytest.mark.parametrize("target, steps", [
    ("sm_90a", ["cache-lookup", "trace", "parse", "gpu", "gpu.passes",
                "gpu.passes.kiln-insert-waits", "gpu.snapshot", "gpu.copy",  # proof: the copy
                "nvvm", "nvvm.passes", "nvvm.copy", "llvm", "ptx", "ptx.passes", "cubin",
                *(["ptx.translate", "ptx.link", "ptx.codegen"]  # LLVM through its C API
                  if nvptx_llvm.pipeline_for(3) is not None else [])]),
    ("gfx950", ["cache-lookup", "trace", "parse", "gpu", "rocdl", "rocdl.passes", "llvm",
                "amdgcn", "amdgcn.optimize", "amdgcn.emit", "amdgcn.beside", "amdgcn.beside.gpu",
                "amdgcn.beside.rocdl", "amdgcn.check", "amdgcn.check.verify-waits", "obj",
                "obj.emit", "hsaco"]),
])
def test_report_profiles_every_step(kernel_file, capsys, target, steps):
    assert main(["compile", f"{kernel_file}:scale", "--target", target, "--report",
                 "-D", "BLOCK=64"]) == 0
    rows = _profile_rows(capsys.readouterr().out)
    assert set(steps) <= set(rows), set(steps) - set(rows)
    if target == "sm_90a":  # the printed modules, LLVM IR and the wait proof: beside ptxas,
        made = {f"{at}.{stage}" for at in ("cubin.ptxas", "text") for stage in  # or after
                ("kiln", "gpu", "nvvm", "llvm", "kiln-verify-rings")}  # insert-waits proved
        assert len(made & set(rows)) == 5, set(rows)
    top = [name for name in rows if "." not in name and name != "total"]
    assert all(rows[name][0] >= 0 and rows[name][1] >= 0 for name in rows)
    assert rows["total"][0] == pytest.approx(sum(rows[n][0] for n in top), abs=0.1 * len(top))
    assert rows["trace"][1] > 0 and rows["gpu"][0] > 0


def test_arg_types_for_unannotated_parameters(kernel_file, capsys):
    assert main(["compile", f"{kernel_file}:untyped", "--arg", "x=bf16:1", "--arg", "n=i32"]) == 0
    assert "memref<?xbf16" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--target", "sm_90a"], "constexpr 'BLOCK' has no value"),
    (["-D", "BLOCK=1", "-D", "WIDTH=4"], "-D names no constexpr parameter: WIDTH"),
    (["-D", "BLOCK=1", "--target", "gfx1200"], "unknown target 'gfx1200'"),
    (["-D", "BLOCK=1", "--emit", "sass"], "no stage 'sass' for sm_90a"),
])
def test_errors_exit_1_with_fix(kernel_file, capsys, argv, message):
    assert main(["compile", f"{kernel_file}:scale", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Fix:" in err


def test_unannotated_without_arg_type_is_an_error(kernel_file, capsys):
    assert main(["compile", f"{kernel_file}:untyped"]) == 1
    assert "parameter 'x' has no annotation" in capsys.readouterr().err


def test_kernel_file_imports_its_sibling_modules(tmp_path, monkeypatch, capsys):
    """Like ``python FILE.py``, the kernel file's folder is on sys.path while it is imported."""
    monkeypatch.setenv("KILN_NO_CACHE", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "cli_sibling_consts.py").write_text("SCALE = 3.5\n")
    (tmp_path / "cli_sibling_kernel.py").write_text(textwrap.dedent('''
        import kiln
        from kiln import f32
        from cli_sibling_consts import SCALE

        @kiln.kernel
        def scaled(x: kiln.Tensor[f32]):
            i = kiln.thread_id(0)
            x[i] = x[i] * SCALE
    '''))
    assert main(["compile", f"{tmp_path / 'cli_sibling_kernel.py'}:scaled", "--emit", "kiln"]) == 0
    assert "3.5" in capsys.readouterr().out


def test_console_script_runs(kernel_file):
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "compile", f"{kernel_file}:scale",
                           "-D", "BLOCK=32", "--emit", "kiln"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "gpu.func @scale" in done.stdout and "scf.if" in done.stdout


@pytest.mark.parametrize("target", ["sm_90a", "gfx950"])
def test_report_splits_the_wall_time_by_part(kernel_file, capsys, target):
    assert main(["compile", f"{kernel_file}:scale", "--target", target, "--report",
                 "-D", "BLOCK=64"]) == 0
    out = capsys.readouterr().out
    line = out.split("compile wall ms by part", 1)[1].splitlines()[1]
    parts = {name: float(ms) for name, ms in (cell.strip().rsplit(" ", 1)
                                              for cell in line.split("|"))}
    assert set(parts) == {"cache key", "trace", "Kiln passes", "MLIR", "LLVM", "ptxas",
                          "other", "beside"}
    assert parts["trace"] > 0 and parts["MLIR"] > 0 and parts["LLVM"] > 0
    beside = parts.pop("beside")
    total = _profile_rows(out)["total"][0]
    assert sum(parts.values()) == pytest.approx(total, abs=0.5)
    assert 0 < beside <= parts["LLVM" if target == "gfx950" else "ptxas"] + 0.5 or \
        target == "sm_90a" and parts["ptxas"] == 0  # no ptxas: the driver compiles the PTX


def test_summarise_takes_kilns_passes_out_of_their_stages():
    from kiln.core.profile import summarise

    entries = [("cache-lookup", 5.0, 5.0), ("trace", 100.0, 99.0), ("parse", 1.0, 1.0),
               ("gpu", 60.0, 60.0), ("gpu.passes", 50.0, 50.0),
               ("gpu.passes.kiln-insert-waits", 30.0, 30.0), ("nvvm", 40.0, 40.0),
               ("nvvm.passes.kiln-tma-l2-hints", 2.0, 2.0), ("llvm", 1.0, 1.0),
               ("ptx", 200.0, 200.0), ("ptx.passes", 90.0, 90.0), ("cubin", 300.0, 310.0),
               ("cubin.ptxas", 299.0, 309.0), ("cubin.ptxas.gpu", 20.0, 20.0),
               ("check-sass", 7.0, 7.0)]
    assert summarise(entries) == {"cache key": 5.0, "trace": 101.0, "Kiln passes": 32.0,
                                  "MLIR": 69.0, "LLVM": 200.0, "ptxas": 300.0, "other": 7.0,
                                  "beside": 20.0}
