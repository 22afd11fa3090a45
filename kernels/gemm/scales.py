"""FP8 GEMM scales: the accepted forms, their checks, and the reference dequantisation.

FP8 operands are ``value * scale``; the GEMM computes ``(A * sa) @ (B * sb)^T`` with f32
accumulation. Three forms per operand (f32; the kind is read off the shape):

=================  ===============================  =====================================
kind               ``scale_a``                      ``scale_b`` (B stored N x K)
=================  ===============================  =====================================
per tensor         python float, 0-d or ``[1]``     python float, 0-d or ``[1]``
per row / column   ``[M]``: one per row of A        ``[N]``: one per column of C (row of B)
block (DeepSeek)   ``[M, ceil(K/128)]``: 1 x 128    ``[ceil(N/128), ceil(K/128)]``: 128 x 128
=================  ===============================  =====================================

Block scales go together (both operands); the other kinds combine freely. Example::

    sa = a_f32.reshape(m, -1, 128).abs().amax(-1) / 448        # [M, K/128]
    a8 = (a_f32 / sa.repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    c = matmul(a8, w8, scale_a=sa, scale_b=sw, trans_b=True)   # sw: [N/128, K/128]
"""

import numbers

import numpy as np

import kiln

from ..runtime import ArrayLib, contiguous, is_torch

FP8_DTYPES = ("f8e4m3", "f8e5m2")
SCALE_BLOCK = 128


def blocks(x: int) -> int:
    """Scale blocks of 128 covering ``x`` elements."""
    return -(-x // SCALE_BLOCK)


def is_fp8(name: str) -> bool:
    return name in FP8_DTYPES


def check_scales(scale_a, scale_b, *, m: int, n: int, k: int, like):
    """``(mode, scale_a, scale_b)``: the kinds (``("tensor"|"row"|"block", "tensor"|"col"|
    "block")``) and the scales as contiguous f32 arrays of ``like``'s kind (a python float
    becomes a one-element array). Raises :class:`kiln.KilnValueError` naming the argument for
    a missing scale, a wrong dtype or a shape that is none of the kinds."""
    a_mode, sa = scale_kind("scale_a", scale_a, {(m,): "row", (m, blocks(k)): "block"}, like,
                            f"[M]=[{m}] or [M, ceil(K/128)]=[{m}, {blocks(k)}]")
    b_mode, sb = scale_kind("scale_b", scale_b,
                            {(n,): "col", (blocks(n), blocks(k)): "block"}, like,
                            f"[N]=[{n}] or [ceil(N/128), ceil(K/128)]=[{blocks(n)}, "
                            f"{blocks(k)}]")
    if (a_mode == "block") != (b_mode == "block"):
        raise kiln.KilnValueError(f"scale_a is {a_mode} and scale_b is {b_mode}: block scales "
                                  "apply to both operands or neither",
                                  fix="pass block scales for both A ([M, ceil(K/128)]) and B "
                                      "([ceil(N/128), ceil(K/128)])")
    return (a_mode, b_mode), sa, sb


def refuse_scales(scale_a, scale_b, dtype: str) -> None:
    """Scales belong to FP8 inputs: refuse them for ``dtype`` (bf16/f16) operands."""
    if scale_a is not None or scale_b is not None:
        raise kiln.KilnValueError(f"scale_a / scale_b apply to FP8 inputs, but the operands are "
                                  f"{dtype}", fix="drop the scales, or pass f8e4m3 / f8e5m2 "
                                                  "operands")


def scale_kind(what: str, scale, shapes: dict, like, expected: str):
    """``(kind, array)`` of one scale: "tensor" for a float or a one-element array (as a
    contiguous ``[1]`` f32 array of ``like``'s kind), else ``shapes[scale.shape]`` (the array
    made contiguous); ``expected`` describes the accepted shapes in the error message."""
    if scale is None:
        raise kiln.KilnValueError(f"FP8 inputs require {what}",
                                  fix=f"pass {what}: a float (per tensor), a vector or block "
                                      "scales (see kiln.kernels.gemm.scales)")
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return "tensor", ArrayLib(like).asarray([float(scale)], "f32")
    if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
        raise kiln.KilnTypeError(f"{what} must be a float or an f32 array, got "
                                 f"{type(scale).__name__}", fix=f"pass {what} as a float32 array")
    if is_torch(scale) != is_torch(like):
        raise kiln.KilnTypeError(f"{what} and the operands must all be numpy arrays or all "
                                 "torch tensors", fix=f"move {what} to the operands' kind")
    if kiln.dtype(scale.dtype) is not kiln.f32:
        raise kiln.KilnTypeError(f"{what} must be float32, got {kiln.dtype(scale.dtype)}",
                                 fix=f"convert it, e.g. {what}.float()")
    shape = tuple(scale.shape)
    if int(np.prod(shape)) == 1 and len(shape) <= 1:
        return "tensor", contiguous(scale.reshape(1))
    if shape in shapes:
        return shapes[shape], contiguous(scale)
    raise kiln.KilnValueError(f"{what} has shape {list(shape)}, which is no scale kind here",
                              fix=f"pass a float, a one-element array, {expected}")
