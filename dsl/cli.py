"""The ``kiln`` command line: compile a kernel from a Python file and print one stage or a report.

Examples::

    kiln compile examples/demo.py:rms_norm --target gfx950 --emit amdgcn -D BLOCK=128
    kiln compile saxpy.py:saxpy --target sm_90a --emit ptx -o saxpy.ptx
    kiln compile saxpy.py:saxpy --target sm_90a --report
    kiln compile k.py:k --arg x=bf16:2 --arg n=i32 ...   # types for unannotated parameters

The file is imported with its folder first on ``sys.path`` (as ``python FILE.py`` runs it), so
it may import its sibling modules. Parameters are specialised from their annotations
(``kiln.Tensor[f32, 2]``, ``i32``...): tensors become placeholder arrays of that dtype and rank
(rank 1 when not annotated), so no data is needed. ``--arg NAME=DTYPE[:RANK]`` types an
unannotated parameter (a rank makes it a tensor); ``-D NAME=VALUE`` sets a constexpr (VALUE is a
Python literal, else a string).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

import numpy as np

from .core import dtypes
from .core.errors import KilnError, KilnValueError
from .kernel import JITKernel
from kiln.core.profile import format_profile, summarise


def _load_kernel(spec: str):
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise KilnValueError(f"expected FILE.py:KERNEL, got {spec!r}",
                             fix="write e.g. kiln compile examples/demo.py:rms_norm")
    path = Path(path_text)
    if not path.is_file():
        raise KilnValueError(f"no such file: {path}", fix="check the path before ':'")
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # sibling imports work, as under ``python FILE.py``
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module  # kernels look up their globals through the module
    module_spec.loader.exec_module(module)
    kernel = getattr(module, name, None)

    if not isinstance(kernel, JITKernel):
        raise KilnValueError(f"{path} has no @kiln.kernel named {name!r}",
                             fix="name a function decorated with @kiln.kernel")
    return kernel


def _parse_define(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise KilnValueError(f"-D expects NAME=VALUE, got {text!r}", fix="write e.g. -D BLOCK=128")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def _parse_arg_type(text: str) -> tuple[str, dtypes.DType, int | None]:
    name, sep, rest = text.partition("=")
    if not sep:
        raise KilnValueError(f"--arg expects NAME=DTYPE[:RANK], got {text!r}",
                             fix="write e.g. --arg x=f32:2 or --arg n=i32")
    dtype_text, _, rank = rest.partition(":")
    return name, dtypes.dtype(dtype_text), int(rank) if rank else None


def placeholder_args(kernel, arg_types: dict[str, tuple[dtypes.DType, int | None]],
                     defines: dict) -> tuple[list, dict]:
    """Positional placeholders for ``kernel``'s run-time parameters and its constexpr values."""
    args, constexprs = [], {}
    for param in kernel.params:
        if param.kind == "constexpr":
            if param.name not in defines:
                raise KilnValueError(f"constexpr {param.name!r} has no value",
                                     fix=f"pass -D {param.name}=VALUE")
            constexprs[param.name] = defines[param.name]
            continue
        dtype, rank = arg_types.get(param.name, (None, None))
        if param.kind in ("tensor", "tensormap"):
            spec = param.spec
            rank = rank or getattr(spec, "rank", None) or len(getattr(spec, "box", ())) or 1
            args.append(np.empty((1,) * rank, dtype=(dtype or spec.dtype).numpy))
        elif param.kind == "scalar":
            args.append((dtype or param.spec).numpy.type(1))
        elif dtype is None:
            raise KilnValueError(f"parameter {param.name!r} has no annotation",
                                 fix=f"annotate it in the kernel, or pass --arg {param.name}=f32:1")
        elif rank:
            args.append(np.empty((1,) * rank, dtype=dtype.numpy))
        else:
            args.append(dtype.numpy.type(1))
    unknown = set(defines) - set(constexprs)
    if unknown:
        raise KilnValueError(f"-D names no constexpr parameter: {', '.join(sorted(unknown))}",
                             fix="define only the kernel's kiln.constexpr parameters")
    return args, constexprs


def format_report(ck) -> str:
    """Stages with their sizes, every metadata entry, then where the compile spent its time
    (wall and CPU ms per step, from ``metadata["compile_profile"]``), as aligned tables."""
    lines = [f"kernel {ck.name} for {ck.target.name}", "stages:"]
    for stage, artifact in ck.asm.items():
        unit = "bytes" if isinstance(artifact, bytes) else "chars"
        lines.append(f"  {stage:<8} {len(artifact):>9} {unit}")
    lines.append("resources:")
    for key, value in ck.metadata.items():
        if key not in ("cluster_live_vgprs", "compile_profile"):
            lines.append(f"  {key:<16} {value}")
    live = ck.metadata.get("cluster_live_vgprs")
    if live:  # estimated from the assembly by kiln.lowering.isa_amdgpu
        lines.append("live VGPRs at cluster start (estimate):")
        lines.extend(f"  {cluster:<8} {count:>4}" for cluster, count in live.items())
    profile = ck.metadata.get("compile_profile")
    if profile:
        parts = summarise(profile)
        beside = parts.pop("beside")
        lines.append("compile wall ms by part (beside: Python work overlapped with LLVM or "
                     "ptxas, inside their parts):")
        lines.append("  " + " | ".join(f"{part} {ms:.1f}" for part, ms in parts.items())
                     + f" | beside {beside:.1f}")
        lines.append("compile profile (CPU ms include ptxas/ld.lld; from the first compile "
                     "when the kernel came from the cache):")
        lines.extend(format_profile(profile))
    return "\n".join(lines)


def _compile_command(ns: argparse.Namespace) -> int:
    kernel = _load_kernel(ns.kernel)
    defines = dict(_parse_define(d) for d in ns.define)
    arg_types = {name: (dtype, rank) for name, dtype, rank in map(_parse_arg_type, ns.arg)}
    args, constexprs = placeholder_args(kernel, arg_types, defines)
    ck = kernel.compile(*args, target=ns.target, num_warps=ns.num_warps, **constexprs)
    if ns.report:
        text: str | bytes = format_report(ck) + "\n"
    else:
        if ns.emit not in ck.asm:
            raise KilnValueError(f"no stage {ns.emit!r} for {ck.target.name}",
                                 fix=f"use one of {', '.join(ck.asm)}")
        text = ck.asm[ns.emit]
    if ns.output:
        Path(ns.output).write_bytes(text if isinstance(text, bytes) else text.encode())
    elif isinstance(text, bytes):
        raise KilnValueError(f"stage {ns.emit!r} is binary", fix="write it to a file with -o")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln kernel compiler")
    commands = parser.add_subparsers(dest="command", required=True)
    compile_parser = commands.add_parser("compile", help="compile FILE.py:KERNEL for a target")
    compile_parser.add_argument("kernel", help="FILE.py:KERNEL")
    compile_parser.add_argument("--target", default="sm_90a",
                                help="sm_80, sm_90a, sm_100a, gfx942, gfx950")
    compile_parser.add_argument("--emit", default="kiln",
                                help="stage to print: kiln, gpu, nvvm|rocdl, llvm, ptx|amdgcn, ...")
    compile_parser.add_argument("--num-warps", type=int, default=None)
    compile_parser.add_argument("-D", "--define", action="append", default=[],
                                metavar="NAME=VALUE", help="constexpr value")
    compile_parser.add_argument("--arg", action="append", default=[], metavar="NAME=DTYPE[:RANK]",
                                help="type of an unannotated parameter")
    compile_parser.add_argument("--report", action="store_true",
                                help="print stages and resource metadata instead of a stage")
    compile_parser.add_argument("-o", "--output", help="write the stage to this file")
    ns = parser.parse_args(argv)
    try:
        return _compile_command(ns)
    except KilnError as err:
        print(f"kiln: error: {_describe(err)}", file=sys.stderr)
        return 1


def _describe(err: KilnError) -> str:
    """The full message when it points into the user's file; else message and Fix only."""
    if err.loc is not None and Path(err.loc.filename).suffix == ".py":
        return str(err)
    return err.message + (f"\nFix: {err.fix}" if err.fix else "")


if __name__ == "__main__":
    sys.exit(main())
