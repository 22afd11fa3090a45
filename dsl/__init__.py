"""Kiln: write GPU kernels in Python, compile them through MLIR for NVIDIA and AMD GPUs."""

from .dtypes import (DType, bf16, dtype, f8e4m3, f8e5m2, f16, f32, f64, i1, i8, i16, i32, i64,
                     index)
from .errors import (CompilationError, InternalError, KilnError, KilnTypeError, KilnValueError,
                     LaunchError, ResourceError, TargetError, UnsupportedError)

__version__ = "0.1.0"
