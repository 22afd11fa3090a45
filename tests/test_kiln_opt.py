"""kiln-opt: mixed upstream/Kiln pipelines, single stages, and exit status 1 on errors."""

from pathlib import Path

from kiln.passes import split_pipeline
from kiln.lowering.opt import main

SAXPY = Path(__file__).parent / "lit" / "lowering" / "Inputs" / "saxpy.mlir"


def test_mixed_pipeline_folds_and_canonicalizes(capsys):
    assert main([str(SAXPY), "--pass-pipeline=builtin.module(kiln-fold-block-dim,canonicalize,cse)"]) == 0
    out = capsys.readouterr().out
    assert "gpu.block_dim" not in out and "arith.constant 128 : index" in out


def test_stages_chain_to_amdgcn(tmp_path, capsys):
    gpu, rocdl = tmp_path / "k.gpu.mlir", tmp_path / "k.rocdl.mlir"
    assert main([str(SAXPY), "--kiln-stage=gpu", "--target=gfx950", "--num-warps=2", "-o", str(gpu)]) == 0
    assert main([str(gpu), "--kiln-stage=rocdl", "--target=gfx950", "--num-warps=2", "-o", str(rocdl)]) == 0
    assert main([str(rocdl), "--kiln-stage=amdgcn", "--target=gfx950", "--num-warps=2"]) == 0
    out = capsys.readouterr().out
    assert "global_load_dword" in out and "s_endpgm" in out


def test_errors_exit_1_with_fix(capsys):
    assert main([str(SAXPY), "--pass-pipeline=builtin.module(no-such-pass)"]) == 1
    assert "Fix:" in capsys.readouterr().err
    assert main([str(SAXPY), "--kiln-stage=rocdl", "--target=sm_90a"]) == 1
    assert "stage 'rocdl' is not a nvidia stage" in capsys.readouterr().err
    assert main([str(SAXPY), "--kiln-stage=gpu"]) == 1
    assert "--kiln-stage needs --target" in capsys.readouterr().err


def test_split_pipeline_respects_nesting():
    assert split_pipeline("builtin.module(a,b{x=1 y=2},gpu.module(c,d))") == [
        "a", "b{x=1 y=2}", "gpu.module(c,d)"]
