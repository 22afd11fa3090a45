"""AMDGPU code generation through llvmlite, importing nothing of Kiln, so it also runs as a
script: an AMD compile emits its ELF object in a second process while the compiling one emits
the assembly (llvmlite makes one call at a time in a process, under its own lock, and each
emission is a whole code generation).

:func:`optimize` runs the O-level pipeline and prints the result (codegen rewrites the module
it emits, and emitting one module twice aborts the process); :func:`emit` compiles a fresh
parse of that text. The script starts (interpreter, llvmlite, target machine) while the
compiling process optimises, then reads the path of the optimised IR from stdin and emits its
object: the same steps on the same text, so the same bytes as an emission in-process.

Example::

    optimized = optimize(llvm_ir_text, "gfx950", 3)
    asm = emit(optimized, "gfx950", 3, assembly=True)

    # the script kiln.lowering.amd starts: exit status 0 once kernel.o is written
    echo kernel.opt.ll | python llvmlite_codegen.py gfx950 3 kernel.o
"""

from __future__ import annotations

import functools
import sys

TRIPLE = "amdgcn-amd-amdhsa"


@functools.lru_cache(maxsize=None)
def target_machine(chip: str, opt_level: int, verbose: bool = False):
    """llvmlite's AMDGPU target machine for ``chip`` (``verbose``: assembly comments on)."""
    import llvmlite.binding as llvmlite  # ~50 ms to import: only AMD compiles pay it
    llvmlite.initialize_all_targets()
    llvmlite.initialize_all_asmprinters()
    machine = llvmlite.Target.from_triple(TRIPLE).create_target_machine(
        cpu=chip, features="", opt=opt_level, reloc="pic", codemodel="default")
    if verbose:
        machine.set_asm_verbosity(True)
    return machine


def parse(text: str):
    """A verified llvmlite module of LLVM IR ``text`` (RuntimeError with LLVM's message)."""
    import llvmlite.binding as llvmlite

    module = llvmlite.parse_assembly(text)
    module.verify()
    return module


def optimize(text: str, chip: str, opt_level: int) -> str:
    """The text of ``text`` after LLVM's ``O<opt_level>`` pipeline for ``chip``."""
    import llvmlite.binding as llvmlite

    machine = target_machine(chip, opt_level)
    module = parse(text)
    try:
        tuning = llvmlite.create_pipeline_tuning_options(speed_level=opt_level)
        builder = llvmlite.create_pass_builder(machine, tuning)
        builder.getModulePassManager().run(module, builder)
        return str(module)
    finally:
        module.close()  # now, not whenever (and on whichever thread) GC runs


def emit(optimized: str, chip: str, opt_level: int, *, assembly: bool,
         verbose: bool = False) -> str | bytes:
    """The assembly text (``assembly``) or the ELF object of the optimised IR ``optimized``."""
    machine = target_machine(chip, opt_level, verbose)
    module = parse(optimized)
    try:
        return machine.emit_assembly(module) if assembly else machine.emit_object(module)
    finally:
        module.close()


def main(argv: list[str]) -> int:
    """``CHIP OPT_LEVEL OUT.o``, then the path of optimised IR on stdin: write its object to
    OUT.o (exit status 2 when stdin ends first: the compile gave up)."""
    chip, opt_level, target = argv[1], int(argv[2]), argv[3]
    target_machine(chip, opt_level)  # while the compiling process optimises
    source = sys.stdin.readline().strip()
    if not source:
        return 2
    with open(source) as handle:
        text = handle.read()
    try:
        obj = emit(text, chip, opt_level, assembly=False)
    except RuntimeError as err:  # LLVM's message; the compiling process emits it again
        print(err, file=sys.stderr)
        return 1
    with open(target, "wb") as handle:
        handle.write(obj)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
