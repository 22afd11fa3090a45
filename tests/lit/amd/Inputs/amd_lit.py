"""Helpers for the AMD lit tests: a ``TEST:`` header per case and the lines of a compiled
kernel's stages that FileCheck looks at."""

import re

import numpy as np

import kiln


def case(fn):
    """Print ``TEST: <name>`` then run the case (upstream MLIR Python lit-test style)."""
    print(f"TEST: {fn.__name__}")
    fn()
    return fn


def show(compiled, kiln_ops=(), isa=()):
    """Print the Kiln IR lines naming any of ``kiln_ops`` and the ISA lines matching ``isa``."""
    for line in compiled.asm["kiln"].splitlines():
        if any(op in line for op in kiln_ops):
            print("KILN:", re.sub(r"\s+loc\(.*\)$", "", line.strip()))
    for line in compiled.asm["amdgcn"].splitlines():
        if any(re.search(pattern, line) for pattern in isa):
            print("ISA:", line.strip())
    print("SCRATCH:", compiled.metadata["scratch_bytes"])


def arrays(*specs):
    """Placeholder arrays ``(dtype, rank)`` for specialising a kernel."""
    return [np.empty((2,) * rank, kiln.dtype(dtype).numpy) for dtype, rank in specs]
