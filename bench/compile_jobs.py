"""The kernels ``bench/compile_time.py`` and ``bench/nvptx_pipeline.py`` compile: ``k`` holds
the library's compile entry points and ``saxpy_compile`` (a small user kernel), which the
benchmarks' ``JOBS`` expressions name (``k.compile_matmul('bf16', target='sm_90a')``).

Importing this module imports Kiln and the library: ``compile_time``'s child process times
that import apart from the compile. :func:`serial_amd_codegen` makes AMD compiles run their
code generation and the work beside it one after the other (``compile_time --serial-llvm``:
the same-run baseline of the overlap).
"""

import types

import numpy as np

import kiln
from kiln.kernels.attention import compile_mla_decode, compile_prefill
from kiln.kernels.attention.combine import compile_combine
from kiln.kernels.attention.decode import compile_decode
from kiln.kernels.attention.decode_config import DecodeConfig
from kiln.kernels.gemm import compile_matmul
from kiln.kernels.gemm.grouped_api import compile_grouped_matmul


@kiln.kernel(num_threads="BLOCK")
def saxpy(x: kiln.Tensor[kiln.f32], y: kiln.Tensor[kiln.f32], n: kiln.i32, a: kiln.f32,
          BLOCK: kiln.constexpr):
    i = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if i < n:
        y[i] = a * x[i] + y[i]


def serial_amd_codegen() -> None:
    """Make AMD compiles do their work one step after the other, as before the overlap: no
    second process for the object (``make_obj`` emits it), and ``beside()`` then LLVM's work on
    the compiling thread (the same steps and artifacts)."""
    import functools

    from kiln.lowering import amd

    amd._emit_beside = functools.partial(amd._emit_beside, threaded=False)
    amd._start_object_process = lambda state, work: None


def saxpy_compile(target):
    x = np.zeros(16, np.float32)
    return saxpy.compile(x, x, 16, 2.0, BLOCK=256, target=target)


k = types.SimpleNamespace(compile_prefill=compile_prefill, compile_combine=compile_combine,
                          compile_decode=compile_decode, DecodeConfig=DecodeConfig,
                          compile_matmul=compile_matmul,
                          compile_grouped_matmul=compile_grouped_matmul,
                          compile_mla_decode=compile_mla_decode, saxpy_compile=saxpy_compile)
