"""Triton kernel of :mod:`.reference`: one program per row reads x and d once and writes h and y
(forward only: it serves generate()'s decode step, where the two adds of each block were kernels
of their own)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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
