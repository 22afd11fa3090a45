"""The CPU interpreter: runs Kiln IR on numpy, one CTA at a time, with race and bounds checks.

Entry point: :func:`interpret_kernel` (what ``kernel.interpret[grid](...)`` calls). See
``docs/interpreter.md`` for the design and its limits.
"""

from .plan import semantics
from .run import TensorMapArg, interpret_kernel

__all__ = ["interpret_kernel", "semantics", "TensorMapArg"]
