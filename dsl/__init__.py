"""Kiln: write GPU kernels in Python, compile them through MLIR for NVIDIA and AMD GPUs."""

from .core.dtypes import (DType, bf16, dtype, f8e4m3, f8e5m2, f16, f32, f64, i1, i8, i16, i32, i64,
                          index)
from .core.errors import (CompilationError, InternalError, KilnError, KilnTypeError, KilnValueError,
                          LaunchError, ResourceError, TargetError, UnsupportedError)

# kiln.core.dtypes / kiln.core.errors / kiln.core.env: the core modules, kept as attributes of the facade.
from .core import __version__, dtypes, env, errors

# The tracing DSL (see kiln.kernel for the user guide).
from . import builder, values
from .builder import current_target
from .annotations import TensorMap, constexpr
from .kernel import JITKernel, KilnFunc, TracedKernel, func, kernel, set_default_target
from .ops import (abs, barrier, block_dim, block_id, cast, exp, exp2, fence, fma, global_id,
                  lane_id, log, log2, maximum, minimum, num_blocks, rcp, rsqrt, sqrt, thread_id,
                  warp_id, where)
from .printing import print
from .threads import ThreadCountWarning
from .shared import SharedTensor, shared
from .struct import struct
from .tensor import Tensor, TensorRef
from .trace_runtime import MAX_UNROLLED_ITERATIONS, TracedRange as range, static_range
from .values import Handle, Value
from .vectors import pack, unpack, vector_concat, vector_constant, vector_slice

max = maximum
min = minimum

# Hardware-concept modules: kiln.layout / kiln.swizzle (layout algebra), kiln.wgmma, and the
# instruction families of kiln.nvidia / kiln.amd under their old names (kiln.tma is
# kiln.nvidia.tma, kiln.nvidia_asm is kiln.nvidia.sync, kiln.amd_asm is kiln.amd.sched, ...).
from . import layout, swizzle, wgmma
from .nvidia import cp_async, dsmem, ldmatrix, mbarrier, tma
from .nvidia import wgmma as _wgmma_ops  # noqa: F401 - declares the WGMMA ops (kiln.core.ops)
from .nvidia.fastmath import tanh_approx
from .nvidia import sync as nvidia_asm
from .amd import buffer as amd_buffer, loader
from .amd import sched as amd_asm
from .layout import Layout, ThreadValueLayout, make_layout
from .swizzle import ComposedSwizzle, Swizzle, SwizzledLayout

# Tiles and tensor-core atoms (kiln.mma registry; importing kiln.mfma registers the AMD atoms),
# NVIDIA sm_80 loads (ldmatrix, cp.async), AMD LDS/buffer/DMA and the rocdl intrinsic wrappers.
from . import global_tile, mfma, mma, reg_tile, shared_tile, shuffle, tiles
from .amd.loader import TiledMmaLoader
from .mma import TiledMma
from .autotune import autotune
from .shared import DynamicSharedTensor, dynamic_shared
from .tiles import GlobalTile, RegTile, SharedTile
from .tile_copy import copy, load
from .tile_reduce import cluster_rank, reduce
from .tile_gemm import accumulator, gemm
from .pipeline import pipeline
from .tile_cases import cases
from .tile_handoff import Turns, release

# Cluster scheduling annotations (the kiln-cluster-schedule / kiln-insert-waits passes read them).
# ``kiln.cluster`` is the context manager; the module stays importable as ``kiln.cluster`` only
# through ``from kiln.cluster import ...``.
from .cluster import ClusterRecipe, cluster, consumer_drain, manual_waits
from .core.errors import (DeadlockError, OutOfBoundsError, RaceError, ScheduleError,
                          ScheduleWarning, WaitError)

# The upper layers behind @kiln.kernel (docs/architecture.md): the dsl declares kiln.driver.Driver
# and the facade installs the runtime's compile and launch and the interpreter.
from . import driver as _driver
from .runtime.cache import compile_specialisation as _compile_specialisation
from .runtime.launch import launch as _launch
from .runtime.launch_fast import guarded_launcher as _guarded_launcher
from .runtime.launch_fast import specialized_launcher as _specialized_launcher



def _interpret_kernel(*args, **kwargs):
    """``kiln.interpreter.interpret_kernel``, imported on the first interpreted launch."""
    from .interpreter import interpret_kernel  # start-up cost: its op tables, unused by compiles

    return interpret_kernel(*args, **kwargs)


_driver.install(_driver.Driver(compile=_compile_specialisation, launch=_launch,
                               specialized_launcher=_specialized_launcher,
                               interpret=_interpret_kernel, guarded_launcher=_guarded_launcher))

# ``import kiln.tma`` / ``from kiln.amd_asm import ...``: the old module paths name the moved
# family modules.
import sys as _sys

for _old, _module in (("tma", tma), ("mbarrier", mbarrier), ("cp_async", cp_async),
                      ("ldmatrix", ldmatrix), ("nvidia_asm", nvidia_asm), ("amd_asm", amd_asm),
                      ("amd_buffer", amd_buffer), ("loader", loader)):
    _sys.modules[f"{__name__}.{_old}"] = _module
del _sys, _old, _module
