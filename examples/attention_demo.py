"""Kiln's attention demo (``make demo``): one prefill kernel family, both vendors, every stage.

1. Compiles the causal GQA bf16 prefill for NVIDIA ``sm_90a`` (TMA + WGMMA, warp-specialised)
   and AMD ``gfx950`` (the cluster-scheduled MFMA kernel), printing each target's stages,
   resources and, for gfx950, the declared cluster schedule with the live VGPRs at each cluster.
2. Runs it and checks it against a float64 numpy reference: on the GPU when one is present
   (sm_90a), otherwise in Kiln's CPU interpreter (both targets' kernels, toy size).

Run it with ``make demo`` (or ``python examples/attention_demo.py`` inside the venv).
"""

from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np

from kiln.kernels.attention import compile_prefill, prefill
from kiln.runtime.cuda import cuda_available

HEAD_DIM, GROUP = 64, 4  # query heads per KV head


def reference(q, k, v) -> np.ndarray:
    """Causal (bottom-right aligned) GQA attention in float64: q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D]."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    sq, sk, hq, hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k = np.repeat(k, hq // hkv, axis=2)
    v = np.repeat(v, hq // hkv, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    visible = np.arange(sk)[None, :] <= (np.arange(sq) + sk - sq)[:, None]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


def report(ck) -> None:
    print(f"== prefill for {ck.target.name}")
    for stage, artifact in ck.asm.items():
        unit = "bytes" if isinstance(artifact, bytes) else "chars"
        print(f"  {stage:<8} {len(artifact):>9} {unit}")
    for key, value in ck.metadata.items():
        if key != "compile_ms":
            print(f"  {key:<20} {value}")
    recipes = getattr(ck, "recipes", None)
    if recipes:
        print("  cluster schedule (declared recipe per cluster):")
        for cluster, recipe in sorted(recipes.items()):
            print(f"    C{cluster}: {recipe}")
    print()


def random_inputs(rng, batch, seq, kv_heads):
    shape_q, shape_kv = (batch, seq, kv_heads * GROUP, HEAD_DIM), (batch, seq, kv_heads, HEAD_DIM)
    return tuple(rng.standard_normal(s).astype(ml_dtypes.bfloat16)
                 for s in (shape_q, shape_kv, shape_kv))


def check(name: str, out, q, k, v) -> bool:
    ref = reference(q, k, v)
    out = np.asarray(out, dtype=np.float64)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    ok = bool(np.isfinite(out).all() and err < 2e-2)  # bf16 inputs and output
    print(f"{name}: relative error vs float64 = {err:.2e} -> {'OK' if ok else 'FAIL'}")
    return ok


def main() -> int:
    for target in ("sm_90a", "gfx950"):
        report(compile_prefill("bf16", target=target, head_dim=HEAD_DIM, causal=True, group=GROUP))

    rng = np.random.default_rng()
    if cuda_available():
        q, k, v = random_inputs(rng, batch=2, seq=1000, kv_heads=2)
        out = prefill(q, k, v, causal=True, target="sm_90a")
        return 0 if check("sm_90a on the GPU (B=2, S=1000, Hq=8, Hkv=2)", out, q, k, v) else 1

    print("No CUDA GPU here: running both targets' kernels in Kiln's CPU interpreter instead.")
    q, k, v = random_inputs(rng, batch=1, seq=200, kv_heads=1)
    ok = True
    for target in ("sm_90a", "gfx950"):
        start = time.perf_counter()
        out = prefill(q, k, v, causal=True, target=target, backend="interpret")
        label = f"{target} interpreted (B=1, S=200, Hq=4, Hkv=1), {time.perf_counter() - start:.1f} s"
        ok &= check(label, out, q, k, v)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
