"""Launch-argument checks shared by the GPU launch (``kiln.runtime.launch``) and the CPU
interpreter (``kiln.interpreter``), so both refuse the same grids and scalars with the
same :class:`~kiln.core.errors.KilnError`.

Example::

    normalize_grid(4) == (4, 1, 1)
    normalize_grid(2.5)                    # KilnTypeError: grid dimension 0 is float
    check_int_argument("n", 2**33, "i32")  # KilnValueError: n = 8589934592 is outside i32
    check_float_argument("eps", "1e-5", "f32")  # KilnTypeError: eps must be a number
"""

from __future__ import annotations

import operator

import numpy as np

from .core.errors import KilnTypeError, KilnValueError

GRID_LIMITS = (2**31 - 1, 65535, 65535)  # every CUDA device since compute capability 3.0
# Signed range of each integer dtype a kernel scalar may have (i1 takes bools or 0/1).
_INT_RANGES = {"i1": (0, 1), "i8": (-2**7, 2**7 - 1), "i16": (-2**15, 2**15 - 1),
               "i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1),
               "index": (-2**63, 2**63 - 1)}


def normalize_grid(grid) -> tuple[int, int, int]:
    """``grid`` (an int or 1 to 3 ints) as three ints in ``1..GRID_LIMITS``; a
    KilnTypeError for a non-integer dimension, a KilnValueError for a bad count or size."""
    kind = type(grid)
    if kind is tuple and len(grid) == 3:  # the common cases, checked without loops
        x, y, z = grid
        if (type(x) is int and type(y) is int and type(z) is int and 0 < x <= GRID_LIMITS[0]
                and 0 < y <= GRID_LIMITS[1] and 0 < z <= GRID_LIMITS[2]):
            return grid
    elif kind is int and 0 < grid <= GRID_LIMITS[0]:
        return grid, 1, 1
    elif kind is tuple and len(grid) == 1:
        x = grid[0]
        if type(x) is int and 0 < x <= GRID_LIMITS[0]:
            return x, 1, 1
    # Sequences (tuples, lists, torch.Size, 1-D arrays) give the dimensions; anything else is one.
    iterable = hasattr(grid, "__iter__") and not isinstance(grid, (str, bytes))
    dims = tuple(grid) if iterable else (grid,)
    if not 1 <= len(dims) <= 3:
        raise KilnValueError(f"grid must have 1 to 3 dimensions, got {grid!r}",
                             fix="pass grid=(gx,), (gx, gy) or (gx, gy, gz)")
    out = []
    for axis, (value, limit) in enumerate(zip(dims + (1,) * (3 - len(dims)), GRID_LIMITS)):
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)
        except TypeError:
            raise KilnTypeError(f"grid dimension {axis} is {value!r} ({type(value).__name__}), "
                                "not an int",
                                fix="compute the grid with integer arithmetic, e.g. "
                                    "(n + 255) // 256") from None
        if not 1 <= value <= limit:
            raise KilnValueError(f"grid dimension {axis} is {value}; it must be in 1..{limit}",
                                 fix="make every grid dimension at least 1 (skip the launch "
                                     "when there is no work)")
        out.append(value)
    return out[0], out[1], out[2]


def check_int_argument(name: str, value, dtype: str) -> int:
    """``value`` as a Python int within the range of the scalar parameter's ``dtype``
    (KilnTypeError for a non-integer, KilnValueError naming ``name`` when it does not fit)."""
    try:
        # numpy.bool_ has no __index__, but specialisation takes it as an i1 like a bool.
        number = int(value) if isinstance(value, np.bool_) else operator.index(value)
    except TypeError:
        raise KilnTypeError(f"argument {name!r} must be an integer ({dtype}), got "
                            f"{type(value).__name__}", fix=f"pass int({name})") from None
    lo, hi = _INT_RANGES.get(dtype, (None, None))
    if lo is not None and not lo <= number <= hi:
        raise KilnValueError(f"argument {name!r} = {number} is outside the range of {dtype} "
                             f"[{lo}, {hi}]", fix=f"pass a value that fits {dtype}, or declare "
                                                  f"{name} with a wider integer type")
    return number


def check_float_argument(name: str, value, dtype: str) -> float:
    """``value`` as a Python float for a float scalar parameter of ``dtype`` (KilnTypeError
    naming ``name`` for anything that is not a number: ``float("1e-5")`` would parse a str)."""
    if not isinstance(value, (str, bytes)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise KilnTypeError(f"argument {name!r} must be a number ({dtype}), got "
                        f"{type(value).__name__}", fix="pass a Python or numpy float")
