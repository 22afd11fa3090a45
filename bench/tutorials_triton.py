"""Triton peers of the tutorials (bench/tutorials.py), following the designs of Triton's own
tutorials (01 vector add, 02 fused softmax, 03 matrix multiplication, 05 layer norm, 06 fused
attention, 08 grouped GEMM), written from their public description. Imported only where Triton
is installed (the GPU machine)."""

from types import SimpleNamespace

import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, in_stride, out_stride, n_rows, n_cols,
                   BLOCK: tl.constexpr):
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        cols = tl.arange(0, BLOCK)
        x = tl.load(in_ptr + row * in_stride + cols, mask=cols < n_cols, other=-float("inf"))
        z = x - tl.max(x, axis=0)
        num = tl.exp(z)
        tl.store(out_ptr + row * out_stride + cols, num / tl.sum(num, axis=0),
                 mask=cols < n_cols)


@triton.jit
def layernorm_kernel(X, Y, W, B, Mean, Rstd, stride, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    X += row * stride
    Y += row * stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        acc += tl.load(X + cols, mask=cols < N, other=0.).to(tl.float32)
    mean = tl.sum(acc, axis=0) / N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < N, other=0.).to(tl.float32)
        x = tl.where(cols < N, x - mean, 0.)
        acc += x * x
    rstd = 1 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    for off in range(0, N, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask)
        b = tl.load(B + cols, mask=mask)
        x = tl.load(X + cols, mask=mask, other=0.).to(tl.float32)
        tl.store(Y + cols, (x - mean) * rstd * w + b, mask=mask)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, s_am, s_bk, s_cm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = a_ptr + rm[:, None] * s_am + rk[None, :]
    b_p = b_ptr + rk[:, None] * s_bk + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        a = tl.load(a_p, mask=(rm[:, None] < M) & (rk[None, :] < K - k * BK), other=0.0)
        b = tl.load(b_p, mask=(rk[:, None] < K - k * BK) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_p += BK
        b_p += BK * s_bk
    x = acc + tl.load(bias_ptr + rn, mask=rn < N)[None, :]
    z = (x + 0.044715 * x * x * x) * 1.5957691216057308
    y = x / (1.0 + tl.exp(-z))
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :], y.to(tl.bfloat16),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_problem(torch, size: int, generator) -> SimpleNamespace:
    """One ``size``-cubed bf16 problem of the matmul tutorial, drawn from ``generator``: ``a``,
    ``b``, ``bias``, bf16 outputs ``c`` (Kiln's) and ``ref`` (Triton's), ``product`` (a @ b
    in f32), ``want`` (GELU(product + bias)), ``flops``, and ``triton()``, which runs
    :func:`matmul_kernel` (Triton's tutorial design, 128 x 256 x 64 tiles) into ``ref``."""
    m = n = k = size
    a = torch.randn(m, k, device="cuda", generator=generator).to(torch.bfloat16)
    b = torch.randn(k, n, device="cuda", generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=generator)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.empty_like(c)
    product = a.float() @ b.float()
    x = product + bias
    want = 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    grid = (triton.cdiv(m, 128) * triton.cdiv(n, 256),)

    def run_triton():
        matmul_kernel[grid](a, b, bias, ref, m, n, k, a.stride(0), b.stride(0), ref.stride(0),
                            BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3)
    return SimpleNamespace(m=m, n=n, k=k, a=a, b=b, bias=bias, c=c, ref=ref, product=product,
                           want=want, flops=2.0 * m * n * k, triton=run_triton)


@triton.jit
def _attention_inner(acc, l_i, m_i, q, k_ptr, v_ptr, stride, qk_scale, lo, hi, offs_m, offs_n,
                     offs_d, BN: tl.constexpr, MASK: tl.constexpr):
    for start_n in range(lo, hi, BN):
        start_n = tl.multiple_of(start_n, BN)
        rows = start_n + offs_n
        k = tl.load(k_ptr + rows[None, :] * stride + offs_d[:, None])
        qk = tl.dot(q, k)
        if MASK:
            qk = qk * qk_scale + tl.where(offs_m[:, None] >= rows[None, :], 0, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk -= m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] * stride + offs_d[None, :])
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def attention_kernel(Q, K, V, O, stride, qk_scale, N_CTX, H, D: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    b, h = tl.program_id(1) // H, tl.program_id(1) % H
    base = b.to(tl.int64) * N_CTX * stride + h * D
    offs_m = start_m * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * stride + offs_d[None, :])
    m_i = tl.zeros([BM], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BM], dtype=tl.float32) + 1.0
    acc = tl.zeros([BM, D], dtype=tl.float32)
    if CAUSAL:
        hi = start_m * BM
    else:
        hi = N_CTX
    acc, l_i, m_i = _attention_inner(acc, l_i, m_i, q, K + base, V + base, stride, qk_scale, 0,
                                     hi, offs_m, offs_n, offs_d, BN, False)
    if CAUSAL:
        acc, l_i, m_i = _attention_inner(acc, l_i, m_i, q, K + base, V + base, stride, qk_scale,
                                         hi, hi + BM, offs_m, offs_n, offs_d, BN, True)
    acc = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * stride + offs_d[None, :], acc.to(tl.bfloat16))


@triton.jit
def grouped_matmul_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, G, N, K, NUM_SM: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tile = tl.program_id(0)
    last = 0
    n_n = tl.cdiv(N, BN)
    for g in range(G):
        lo = tl.load(offs_ptr + g)
        hi = tl.load(offs_ptr + g + 1)
        tiles = tl.cdiv(hi - lo, BM) * n_n
        while tile >= last and tile < last + tiles:
            local = tile - last
            rm = lo + (local // n_n) * BM + tl.arange(0, BM)
            rn = (local % n_n) * BN + tl.arange(0, BN)
            rk = tl.arange(0, BK)
            a_p = a_ptr + rm[:, None] * K + rk[None, :]
            b_p = b_ptr + (g * K + rk[:, None]).to(tl.int64) * N + rn[None, :]
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BK)):
                a = tl.load(a_p, mask=(rm[:, None] < hi) & (rk[None, :] < K - k * BK), other=0.0)
                b = tl.load(b_p, mask=(rk[:, None] < K - k * BK) & (rn[None, :] < N), other=0.0)
                acc = tl.dot(a, b, acc)
                a_p += BK
                b_p += BK * N
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16),
                     mask=(rm[:, None] < hi) & (rn[None, :] < N))
            tile += NUM_SM
        last += tiles
