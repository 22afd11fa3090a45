"""The kernel library as ``torch.library`` custom ops, and :func:`custom_op` for user kernels.

Importing this module imports torch and registers, in the ``kiln`` namespace, one custom op per
library entry point (``torch.ops.kiln.prefill``, ``decode``, ``decode_attention``,
``combine``, ``matmul``, ``grouped_matmul``). Each op's real implementation calls the entry
point; its fake (meta) implementation allocates outputs of the right shape, dtype and device
without running anything, so ``torch.compile(fullgraph=True)`` traces through the ops without
a graph break. No op mutates its inputs; every output is a fresh tensor. ``import kiln`` /
``import kiln.kernels`` never import torch: only this module does.

The Python wrappers below take the entry points' keywords (those a schema can carry) and call
``torch.ops.kiln.<name>``. Example::

    from kiln.kernels import torch_ops

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        return torch_ops.prefill(q, k, v, causal=True)
"""

# No ``from __future__ import annotations``: torch 2.4 infers op schemas from real annotations.
from typing import Callable, Optional

import torch

import kiln
from kiln.kernels.workspaces import separate_outputs

__all__ = ["prefill", "decode", "decode_attention", "combine", "matmul", "grouped_matmul",
           "custom_op"]

_TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _torch_dtype(name: Optional[str], default: torch.dtype) -> torch.dtype:
    """The torch dtype of a Kiln dtype name (``out_dtype`` arguments), ``default`` for None."""
    if name is None:
        return default
    key = kiln.dtype(name).name
    if key not in _TORCH_DTYPES:
        raise kiln.UnsupportedError(f"out_dtype {name!r} is not one of bf16, f16, f32",
                                    fix="pass out_dtype='bf16', 'f16' or 'f32'")
    return _TORCH_DTYPES[key]


def _dtype_name(dtype) -> Optional[str]:
    """A wrapper's ``out_dtype`` (Kiln dtype, name or torch dtype) as the name the schema holds."""
    return None if dtype is None else kiln.dtype(dtype).name


# --- prefill -------------------------------------------------------------------------------

@torch.library.custom_op("kiln::prefill", mutates_args=())
def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             window_left: int, window_right: int, chunk: int, sinks: Optional[torch.Tensor],
             scale: Optional[float], cu_seqlens_q: Optional[torch.Tensor],
             cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: Optional[int],
             max_seqlen_k: Optional[int], return_lse: bool, softcap: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln.kernels.attention import prefill as run

    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    with separate_outputs():  # an op's outputs may not share a storage
        out = run(q, k, v, causal=causal, window=window, chunk=chunk or None, sinks=sinks,
                  scale=scale, softcap=softcap, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                  max_seqlen_k=max_seqlen_k, return_lse=return_lse)
    return out if return_lse else (out, q.new_empty((0,), dtype=torch.float32))


@_prefill.register_fake
def _(q, k, v, causal, window_left, window_right, chunk, sinks, scale, cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse, softcap=0.0):
    if not return_lse:
        lse_shape = (0,)
    elif cu_seqlens_q is not None:  # ragged q [total, Hq, D]
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    # o takes v's head dim (DeepSeek's 192/128)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), \
        q.new_empty(lse_shape, dtype=torch.float32)


def prefill(q, k, v, *, causal=False, window=None, chunk=None, sinks=None, scale=None,
            softcap=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None, return_lse=False):
    """:func:`kiln.kernels.attention.prefill` as ``torch.ops.kiln.prefill`` (same keywords,
    the default target). A ragged batch is CUDA-graph capturable with ``max_seqlen_q`` (host
    ints, as FlashAttention's varlen call). Example:
    ``o, lse = prefill(q, k, v, causal=True, return_lse=True)``."""
    left, right = (-1, -1) if window is None else window
    o, lse = torch.ops.kiln.prefill(q, k, v, bool(causal), left, right, chunk or 0, sinks,
                                    scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, bool(return_lse), float(softcap or 0.0))
    return (o, lse) if return_lse else o


# --- decode --------------------------------------------------------------------------------

@torch.library.custom_op("kiln::decode", mutates_args=())
def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            page_table: torch.Tensor, seq_lens: torch.Tensor, num_splits: Optional[int],
            block_table: Optional[torch.Tensor], scale: Optional[float],
            sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kiln.kernels.attention import decode as run

    # Three allocations (an op's outputs may not alias): returned as they are.
    with separate_outputs():
        return run(q, k_cache, v_cache, page_table, seq_lens, num_splits=num_splits,
                   block_table=block_table, scale=scale, sinks=sinks)


@_decode.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale, sinks):
    from kiln.kernels.attention.decode_plan import partial_slots

    slots = partial_slots(tuple(q.shape), tuple(k_cache.shape), page_table.shape[1],
                          None if block_table is None else block_table.shape[3], num_splits)
    shape = (slots, *q.shape)
    return q.new_empty(shape, dtype=torch.float32), \
        q.new_empty(shape[:4], dtype=torch.float32), \
        q.new_empty(shape[1:4], dtype=torch.int32)


def decode(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None, block_table=None,
           scale=None, sinks=None):
    """:func:`kiln.kernels.attention.decode` as ``torch.ops.kiln.decode``: the split-KV
    partials ``(o_partial, lse_partial, split_counts)`` for :func:`combine` (page ids are not
    validated, as in :func:`decode_attention`). Example:
    ``o_p, lse_p, counts = decode(q, kc, vc, table, lens, num_splits=4)``."""
    return torch.ops.kiln.decode(q, k_cache, v_cache, page_table, seq_lens, num_splits,
                                 block_table, scale, sinks)


# --- decode_attention ----------------------------------------------------------------------

@torch.library.custom_op("kiln::decode_attention", mutates_args=())
def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      page_table: torch.Tensor, seq_lens: torch.Tensor,
                      num_splits: Optional[int], block_table: Optional[torch.Tensor],
                      scale: Optional[float], sinks: Optional[torch.Tensor],
                      fused_combine: Optional[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln.kernels.attention import decode_attention as run

    with separate_outputs():  # an op's outputs may not share a storage
        return run(q, k_cache, v_cache, page_table, seq_lens, num_splits=num_splits,
                   block_table=block_table, scale=scale, sinks=sinks,
                   fused_combine=fused_combine)


@_decode_attention.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, num_splits, block_table, scale, sinks,
      fused_combine):
    return q.new_empty(q.shape, dtype=torch.bfloat16), \
        q.new_empty(q.shape[:3], dtype=torch.float32)


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, *, num_splits=None,
                     block_table=None, scale=None, sinks=None, fused_combine=None):
    """:func:`kiln.kernels.attention.decode_attention` as ``torch.ops.kiln.decode_attention``:
    ``(o [B, Sq, Hq, D] bf16, lse [B, Sq, Hq] f32)``. It never validates page ids (no
    synchronisation, so it can be captured in a CUDA graph): check them beforehand with the
    entry point's ``validate=True``. Example: ``o, lse = decode_attention(q, kc, vc, table, lens)``.
    """
    return torch.ops.kiln.decode_attention(q, k_cache, v_cache, page_table, seq_lens,
                                           num_splits, block_table, scale, sinks, fused_combine)


# --- combine -------------------------------------------------------------------------------

@torch.library.custom_op("kiln::combine", mutates_args=())
def _combine(o_partial: torch.Tensor, lse_partial: torch.Tensor, split_counts: torch.Tensor,
             max_splits: int, out_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln.kernels.attention import combine as run

    with separate_outputs():  # an op's outputs may not share a storage
        return run(o_partial, lse_partial, split_counts, max_splits=max_splits,
                   out_dtype=out_dtype)


@_combine.register_fake
def _(o_partial, lse_partial, split_counts, max_splits, out_dtype):
    shape = tuple(o_partial.shape[1:])
    return o_partial.new_empty(shape, dtype=_torch_dtype(out_dtype, torch.bfloat16)), \
        o_partial.new_empty(shape[:3], dtype=torch.float32)


def combine(o_partial, lse_partial, split_counts, *, max_splits=32, out_dtype="bf16"):
    """:func:`kiln.kernels.attention.combine` as ``torch.ops.kiln.combine`` (no ``out=``: a
    custom op returns fresh tensors). Example: ``o, lse = combine(o_p, lse_p, counts)``."""
    return torch.ops.kiln.combine(o_partial, lse_partial, split_counts, int(max_splits),
                                  _dtype_name(out_dtype))


# --- matmul and grouped_matmul -------------------------------------------------------------

@torch.library.custom_op("kiln::matmul", mutates_args=())
def _matmul(a: torch.Tensor, b: torch.Tensor, trans_b: bool,
            out_dtype: Optional[str]) -> torch.Tensor:
    from kiln.kernels.gemm import matmul as run

    return run(a, b, trans_b=trans_b, out_dtype=out_dtype)


@_matmul.register_fake
def _(a, b, trans_b, out_dtype):
    n = b.shape[0] if trans_b else b.shape[1]
    return a.new_empty((a.shape[0], n), dtype=_torch_dtype(out_dtype, a.dtype))


def matmul(a, b, *, trans_b=False, out_dtype=None):
    """:func:`kiln.kernels.gemm.matmul` as ``torch.ops.kiln.matmul``: ``a @ b`` (``a @ b.T``
    with ``trans_b``). Example: ``c = matmul(x, w, trans_b=True)``."""
    return torch.ops.kiln.matmul(a, b, bool(trans_b), _dtype_name(out_dtype))


@torch.library.custom_op("kiln::grouped_matmul", mutates_args=())
def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, group_offsets: torch.Tensor,
                    trans_b: bool, out_dtype: Optional[str]) -> torch.Tensor:
    from kiln.kernels.gemm import grouped_matmul as run

    return run(a, b, group_offsets, trans_b=trans_b, out_dtype=out_dtype)


@_grouped_matmul.register_fake
def _(a, b, group_offsets, trans_b, out_dtype):
    n = b.shape[1] if trans_b else b.shape[2]
    return a.new_empty((a.shape[0], n), dtype=_torch_dtype(out_dtype, torch.bfloat16))


def grouped_matmul(a, b, group_offsets, *, trans_b=False, out_dtype=None):
    """:func:`kiln.kernels.gemm.grouped_matmul` as ``torch.ops.kiln.grouped_matmul`` (offsets
    are not validated: no synchronisation). Example: ``c = grouped_matmul(x, w, offs)``."""
    return torch.ops.kiln.grouped_matmul(a, b, group_offsets, bool(trans_b),
                                         _dtype_name(out_dtype))


# --- user kernels --------------------------------------------------------------------------

def custom_op(name: str, kernel, *, grid: Callable, outputs: dict, constexprs: dict = None,
              num_warps: Optional[int] = None, target: Optional[str] = None):
    """A ``torch.library`` custom op ``name`` (``"namespace::op"``) that launches ``kernel``
    (a ``@kiln.kernel``) on fresh outputs and returns them.

    ``outputs`` maps each of the kernel's output parameters (written, never read) to a function
    of the op's inputs returning the output's ``(shape, torch dtype)``; the op's inputs are the
    kernel's other run-time parameters, in order: tensors (unannotated or ``kiln.Tensor``
    parameters) and scalars (parameters annotated with a Kiln scalar type: ``kiln.i32`` is an
    int, ``kiln.f32`` a float). ``grid`` is a function of the inputs returning the launch grid;
    ``constexprs``, ``num_warps`` and ``target`` are passed to every launch. The op returns its
    one output, or a tuple in parameter order. Its fake implementation allocates the outputs
    (no launch), so ``torch.compile(fullgraph=True)`` traces it; CUDA tensors launch on the
    current stream (capturable in a CUDA graph once compiled), CPU tensors run in Kiln's
    interpreter. Example::

        @kiln.kernel(num_threads="BLOCK")
        def scale(x, y, n: kiln.i32, a: kiln.f32, BLOCK: kiln.constexpr):
            i = kiln.block_id(0) * BLOCK + kiln.thread_id(0)
            if i < n:
                y[i] = a * x[i]

        scale_op = custom_op("mylib::scale", scale, constexprs=dict(BLOCK=256),
                             outputs={"y": lambda x, n, a: (x.shape, x.dtype)},
                             grid=lambda x, n, a: (-(-n // 256),))
        y = scale_op(x, x.numel(), 2.0)     # torch.ops.mylib.scale(x, x.numel(), 2.0)
    """
    constexprs = dict(constexprs or {})
    params = [p for p in kernel.params if p.kind != "constexpr"]
    names = [p.name for p in params]
    unknown = sorted(set(outputs) - set(names))
    if unknown or not outputs:
        raise kiln.KilnValueError(f"outputs {unknown or '{}'} are not run-time parameters of "
                                  f"{kernel.name} ({', '.join(names)})",
                                  fix="name at least one of the kernel's output parameters")
    inputs = [p for p in params if p.name not in outputs]
    if not any(_schema_type(p) == "Tensor" for p in inputs):
        raise kiln.KilnValueError(f"{name} needs a tensor input: outputs are allocated like it",
                                  fix="keep at least one tensor parameter as an input")
    returns = "Tensor" if len(outputs) == 1 else \
        "(" + ", ".join("Tensor" for _ in outputs) + ")"
    schema = "(" + ", ".join(f"{_schema_type(p)} {p.name}" for p in inputs) + f") -> {returns}"
    order = [n for n in names if n in outputs]

    def allocate(args):
        like = next(a for a, p in zip(args, inputs) if _schema_type(p) == "Tensor")
        made = {}
        for out in order:
            shape, dtype = outputs[out](*args)
            made[out] = like.new_empty(tuple(shape), dtype=dtype)
        return made

    def result(made):
        tensors = tuple(made[n] for n in order)
        return tensors[0] if len(tensors) == 1 else tensors

    def real(*args):
        made = allocate(args)
        given = dict(zip((p.name for p in inputs), args))
        call = [made[n] if n in made else given[n] for n in names]
        options = {k: v for k, v in (("num_warps", num_warps), ("target", target)) if v} | \
            constexprs
        if all(not isinstance(x, torch.Tensor) or x.is_cuda for x in call):
            kernel[grid(*args)](*call, **options)
            return result(made)
        # CPU tensors: the outputs' arrays share their (fresh, contiguous) memory, which the
        # interpreter writes in place.
        kernel.interpret[grid(*args)](*(_host(x) for x in call), **options)
        return result(made)

    op = torch.library.custom_op(name, real, mutates_args=(), schema=schema)
    op.register_fake(lambda *args: result(allocate(args)))
    return op


def _host(x):
    """A CPU tensor as a numpy array sharing its memory (bf16 through ml_dtypes); others as is."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _schema_type(param) -> str:
    """The schema type of a kernel parameter: scalars by their Kiln dtype, else a tensor."""
    if param.kind != "scalar":
        return "Tensor"
    if param.spec.name == "i1":
        return "bool"
    return "float" if param.spec.name.startswith(("f", "bf")) else "int"
