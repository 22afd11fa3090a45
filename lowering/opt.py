"""``kiln-opt``: run MLIR pipelines mixing upstream and Kiln passes, or one Kiln lowering stage.

Examples::

    kiln-opt k.mlir --pass-pipeline='builtin.module(kiln-fold-block-dim,canonicalize)'
    kiln-opt k.mlir --kiln-stage=gpu --target=gfx950      # then --kiln-stage=rocdl, ...
    kiln-opt k.nvvm.mlir --kiln-stage=ptx --target=sm_90a  # llvm/ptx/amdgcn print text

The result goes to stdout (or ``-o``); on failure the diagnostics go to stderr and the exit
status is 1. ``--list-passes`` prints Kiln's registered passes.
"""

from __future__ import annotations

import argparse
import sys

from mlir import ir

from kiln.core.errors import CompilationError, KilnError, KilnValueError
from kiln.core.options import CompileOptions
from kiln.lowering.compiler import stages_for
from kiln.lowering.pipeline import (CompileState, first_user_location, format_diagnostics,
                                    parse_module)
from kiln.passes import build_pass_manager, kiln_passes, split_pipeline
from kiln.signature import KernelSignature

MLIR_STAGES = ("gpu", "nvvm", "rocdl")
TEXT_STAGES = ("llvm", "ptx", "amdgcn")
SPLIT_MARKER = "// -----"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln-opt", description=__doc__.splitlines()[0])
    parser.add_argument("input", nargs="?", default="-", help="MLIR file ('-' = stdin)")
    parser.add_argument("--pass-pipeline", help="builtin.module(...) with upstream and kiln-* passes")
    parser.add_argument("--kiln-stage", choices=MLIR_STAGES + TEXT_STAGES,
                        help="run one Kiln lowering stage on its predecessor's output")
    parser.add_argument("--target", help="chip for --kiln-stage, e.g. sm_90a or gfx950")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--opt-level", type=int, default=3)
    parser.add_argument("--split-input-file", "-split-input-file", action="store_true",
                        help="process each '// -----' chunk separately (like mlir-opt)")
    parser.add_argument("--list-passes", action="store_true", help="list Kiln passes and exit")
    parser.add_argument("-o", "--output", default="-", help="output file ('-' = stdout)")
    return parser


def _kernel_name(module: ir.Module) -> str:
    names: list[str] = []

    def visit(op: ir.Operation):
        if op.name in ("gpu.func", "llvm.func") and not names and (
                "gpu.kernel" in op.attributes or op.name == "gpu.func"):
            names.append(ir.StringAttr(op.attributes["sym_name"]).value)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return names[0] if names else "kernel"


def run_stage(module: ir.Module, stage: str, target: str, num_warps: int, opt_level: int) -> str:
    """Run Kiln lowering ``stage`` for ``target`` on ``module`` (the previous stage's output).

    For text stages every text stage up to ``stage`` runs (``ptx`` needs no ``llvm``, but
    ``amdgcn`` compiles the ``llvm`` text), starting from the last MLIR stage's module.
    """
    options = CompileOptions(target, num_warps=num_warps, opt_level=opt_level)
    chip = options.chip
    stages = stages_for(chip)
    if stage not in stages:
        raise KilnValueError(f"stage {stage!r} is not a {chip.vendor} stage",
                             fix=f"use one of {', '.join(s for s in stages if s in MLIR_STAGES + TEXT_STAGES)}")
    name = _kernel_name(module)
    signature = KernelSignature(name, (), block=(options.block_size, 1, 1))
    state = CompileState(name, chip, options, signature, module, {})
    if stage in MLIR_STAGES:
        return stages[stage](state)
    for candidate, make in stages.items():
        if candidate in TEXT_STAGES:
            state.asm[candidate] = make(state)
            if candidate == stage:
                return state.asm[candidate]
    raise KilnValueError(f"stage {stage!r} produces no text", fix="pick a text stage")


def run(args: argparse.Namespace) -> str:
    """Run the pipeline or stage that parsed ``args`` ask for; return the output text."""
    if args.list_passes:
        return "".join(f"{p.name}: {p.description}\n" for p in kiln_passes().values())
    if bool(args.pass_pipeline) == bool(args.kiln_stage):
        raise KilnValueError("give exactly one of --pass-pipeline and --kiln-stage",
                             fix="e.g. --pass-pipeline='builtin.module(kiln-fold-block-dim)'")
    if args.kiln_stage and not args.target:
        raise KilnValueError("--kiln-stage needs --target", fix="add --target=sm_90a or --target=gfx950")
    text = sys.stdin.read() if args.input == "-" else open(args.input).read()
    chunks = text.split(SPLIT_MARKER) if args.split_input_file else [text]
    return f"\n{SPLIT_MARKER}\n".join(_run_one(args, chunk) for chunk in chunks)


def _run_one(args: argparse.Namespace, text: str) -> str:
    with ir.Context():
        module = parse_module("kiln-opt", text)
        if args.kiln_stage:
            return run_stage(module, args.kiln_stage, args.target, args.num_warps, args.opt_level)
        pm = build_pass_manager(split_pipeline(args.pass_pipeline))
        try:
            pm.run(module.operation)
        except ir.MLIRError as err:
            raise CompilationError("pass pipeline failed:\n" + format_diagnostics(err),
                                   loc=first_user_location(err)) from None
        return str(module)


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``kiln-opt``)."""
    args = _parser().parse_args(argv)
    try:
        output = run(args)
    except KilnError as err:
        # Locations from the IR file matter; the CLI's own frame (the default loc) does not.
        where = f"{err.loc}: " if isinstance(err, CompilationError) and err.loc else ""
        fix = f"\nFix: {err.fix}" if err.fix else ""
        print(f"kiln-opt: error: {where}{err.message}{fix}", file=sys.stderr)
        return 1
    if output and not output.endswith("\n"):
        output += "\n"
    if args.output == "-":
        sys.stdout.write(output)
    else:
        with open(args.output, "w") as handle:
            handle.write(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
