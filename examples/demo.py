"""Kiln's main demo: one kernel, two vendors, every stage inspectable.

Compiles an RMS-norm kernel (a ``kiln.range`` loop with a loop-carried sum, ``rsqrt``, a masked
tail through ``if``) for NVIDIA ``sm_90a`` and AMD ``gfx950``, prints each target's stages and
resource usage, and runs the NVIDIA build on the GPU when one is present, checking it against a
float64 numpy reference. Without a GPU it says so and stops after compiling.

Run it with ``make demo`` (or ``python examples/demo.py`` inside the venv).
"""

from __future__ import annotations

import sys

import numpy as np

import kiln
from kiln import f32, i32
from kiln.runtime.cuda import cuda_available


@kiln.kernel(num_threads="BLOCK")  # BLOCK threads per block on NVIDIA and AMD alike
def rms_norm(x: kiln.Tensor[f32, 2], w: kiln.Tensor[f32, 1], y: kiln.Tensor[f32, 2],
             rows: i32, cols: i32, eps: f32, BLOCK: kiln.constexpr):
    """One thread per row: y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w."""
    row = kiln.block_id(0) * kiln.block_dim(0) + kiln.thread_id(0)
    if row < rows:
        total = kiln.cast(0.0, f32)
        for c in kiln.range(0, cols):
            v = x[row, c]
            total = total + v * v
        inv = kiln.rsqrt(total / kiln.cast(cols, f32) + eps)
        for c in kiln.range(0, cols):
            y[row, c] = x[row, c] * inv * w[c]


def reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * w.astype(np.float64)


def random_inputs(rng: np.random.Generator, rows: int, cols: int):
    """``x [rows, cols]`` and ``w [cols]`` from ``rng``, and ``y`` poisoned with NaN (every
    element must be written)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    return x, w, np.full_like(x, np.nan)


def stage_table(ck) -> str:
    lines = [f"  {'stage':<8} {'size':>10}  first line"]
    for stage, text in ck.asm.items():
        if isinstance(text, bytes):
            first = f"<{len(text)} bytes of binary>"
        else:
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:60]
        lines.append(f"  {stage:<8} {len(text):>10}  {first}")
    return "\n".join(lines)


def main() -> int:
    rng = np.random.default_rng()
    rows, cols, eps, block = 1000, 512, 1e-6, 128
    x, w, y = random_inputs(rng, rows, cols)

    for target in ("sm_90a", "gfx950"):
        ck = rms_norm.compile(x, w, y, rows, cols, eps, BLOCK=block, target=target)
        print(f"== rms_norm for {target}: stages")
        print(stage_table(ck))
        print(f"== rms_norm for {target}: resources")
        for key, value in ck.metadata.items():
            print(f"  {key:<16} {value}")
        print()

    if not cuda_available():
        print("No CUDA GPU here: compiled for both targets and stopped (run on a GPU to launch).")
        return 0
    grid = ((rows + block - 1) // block,)
    rms_norm[grid](x, w, y, rows, cols, eps, BLOCK=block, target="sm_90a")
    ref = reference(x, w, eps)
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    ok = bool(np.isfinite(y).all() and err < 1e-5)
    print(f"Ran on the GPU: relative error vs float64 numpy = {err:.2e} -> {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
