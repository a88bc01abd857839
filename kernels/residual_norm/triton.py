"""Triton kernels of :mod:`.reference`: the forward, one program per row, reads x and d once and
writes h and y (generate()'s decode step, where the two adds of each block were kernels of their
own, and the training norm without d); the backward of the norm without d (training)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached
from .._common import multiprocessors

# Programs of the backward per streaming multiprocessor: each loops over rows and keeps one float32
# dW partial; their partials are summed afterwards ([programs, N] float32: 2 MiB at N = 2048 on 132 SMs).
BWD_PROGRAMS_PER_SM = 2
INTERPRET_BWD_PROGRAMS = 3  # a few programs, several rows each, in the CPU interpreter


@launch_cached
@triton.jit
def _add_rms_norm_kernel(X, D, W, H, Y, sx, sd, sh, sy, N, eps, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    h = tl.load(X + row * sx + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        h = (h.to(tl.float32) + tl.load(D + row * sd + cols, mask=ok, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + row * sh + cols, h, mask=ok)
    hf = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps)
    y = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) * (hf * inv_rms)
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=ok)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h, y) of the reference for x, delta [..., N] (rows with a contiguous last dim); h is None
    without delta (it would be x)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    deltas = delta.reshape(-1, n) if delta is not None else rows
    h = torch.empty_like(rows) if delta is not None else rows
    y = torch.empty_like(rows)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows.shape[0],)](
        rows, deltas, weight, h, y, rows.stride(0), deltas.stride(0), h.stride(0), y.stride(0), n, float(eps),
        BLOCK=block, HAS_DELTA=delta is not None, num_warps=min(16, max(1, block // 256)),
    )
    return (h.view(x.shape) if delta is not None else None), y.view(x.shape)


@launch_cached
@triton.jit
def _rms_norm_bwd_kernel(X, W, DY, DX, DW_PARTS, sx, sdy, sdx, rows, N, eps, programs,
                         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, rows, programs):
        r = tl.cast(row, tl.int64)  # (a Python int in the interpreter)
        x = tl.load(X + r * sx + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + r * sdy + cols, mask=ok, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        x_hat = x * inv_rms
        g = dy * w
        dx = inv_rms * (g - x_hat * (tl.sum(g * x_hat, 0) / N))
        tl.store(DX + r * sdx + cols, dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * x_hat
    tl.store(DW_PARTS + pid * N + cols, dw, mask=ok)


def rms_norm_backward_triton(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float):
    """(dx, dweight) of y = RMSNorm(x) with weight (the reference without d), the inverse RMS
    recomputed from x; dweight summed over rows in float32 and rounded to weight's dtype."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    dys = dy.reshape(-1, n)
    dx = torch.empty_like(rows)
    per_device = BWD_PROGRAMS_PER_SM * multiprocessors(x.device) if x.is_cuda else INTERPRET_BWD_PROGRAMS
    programs = max(1, min(rows.shape[0], per_device))
    parts = torch.empty((programs, n), device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(n)
    _rms_norm_bwd_kernel[(programs,)](
        rows, weight, dys, dx, parts, rows.stride(0), dys.stride(0), dx.stride(0), rows.shape[0], n, float(eps), programs,
        BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return dx.view(x.shape), parts.sum(0).to(weight.dtype)
