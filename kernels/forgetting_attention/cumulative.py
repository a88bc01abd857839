"""c = cumsum(log f) per head and sequence, and its gradient, as one Triton scan each.

``reference.cumulative_log_forget_by_head`` states the math and stays the oracle (and the path on
CPU and under torch.compile). Here one program per (head, sequence) walks the sequence in blocks of
``BLOCK`` tokens, scanning each block and carrying the running total in float32, so a packed sequence
starts from zero like a batch row (the reference's float64 pass over the packed row is not needed).
The forward reads log f where it lies ([tokens, heads], any float dtype) and writes c head-major
([heads, tokens], the attention kernels' layout); the backward is the reverse scan of dc back into
log f's layout and dtype.

Why: through torch the forward is a transposing copy and a scan, the backward two flips, a scan and a
copy, each a full pass over [tokens, heads]; one scan kernel each way does the same work in a
fraction of the GPU time (`python -m benchmarks.profile`). Its host cost per call is a little higher
than torch's (the autograd Function's Python), which only shows where nothing else keeps the GPU busy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._grid import split_program_id
from ..._compat.triton_launch import launch_cached
from .reference import row_boundaries

BLOCK = 2048  # tokens per scan step


@launch_cached
@triton.jit
def _scan_kernel(X, Y, CU, H, stride_xt, stride_xh, stride_yt, stride_yh, BLOCK: tl.constexpr,
                 REVERSE: tl.constexpr):
    """Y[t, h] = sum of X[s, h] over s <= t (REVERSE: s >= t) within t's sequence, float32."""
    h, seq = split_program_id(H)  # heads fastest: their columns of a row are adjacent
    start = tl.load(CU + seq)
    end = tl.load(CU + seq + 1)
    offs = tl.arange(0, BLOCK)
    carry = tl.zeros([], dtype=tl.float32)
    for i in range(tl.cdiv(end - start, BLOCK)):
        if REVERSE:
            t = end - (i + 1) * BLOCK + offs
            ok = t >= start
        else:
            t = start + i * BLOCK + offs
            ok = t < end
        t64 = t.to(tl.int64)
        x = tl.load(X + t64 * stride_xt + h * stride_xh, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + t64 * stride_yt + h * stride_yh, (tl.cumsum(x, 0, reverse=REVERSE) + carry).to(Y.dtype.element_ty),
                 mask=ok)
        carry += tl.sum(x, 0)


def scan_grid(heads: int, sequences: int) -> tuple[int]:
    """(sequence, head) pairs on grid axis 0, heads fastest: a packed batch may hold more than
    the 65,535 sequences grid axis 1 allows."""
    return (heads * sequences,)


def _scan(x: torch.Tensor, y: torch.Tensor, cu: torch.Tensor, heads: int, x_strides, y_strides, reverse: bool):
    block = BLOCK if x.is_cuda else 16
    _scan_kernel[scan_grid(heads, cu.numel() - 1)](x, y, cu, heads, *x_strides, *y_strides, BLOCK=block, REVERSE=reverse, num_warps=8)
    return y


class _CumulativeLogForget(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_f, cu):
        batch, seq, heads = log_f.shape
        flat = log_f.reshape(batch * seq, heads)  # a view for the [batch, seq, heads] layouts that occur
        c = torch.empty(heads, batch * seq, device=log_f.device, dtype=torch.float32)
        ctx.save_for_backward(cu)
        ctx.meta = (log_f.shape, log_f.dtype)
        return _scan(flat, c, cu, heads, flat.stride(), (c.stride(1), c.stride(0)), reverse=False)

    @staticmethod
    def backward(ctx, dc):
        (cu,) = ctx.saved_tensors
        shape, dtype = ctx.meta
        dc = dc.contiguous()
        d_log_f = torch.empty(shape, device=dc.device, dtype=dtype)
        flat = d_log_f.view(shape[0] * shape[1], shape[2])
        _scan(dc, flat, cu, shape[2], (dc.stride(1), dc.stride(0)), flat.stride(), reverse=True)
        return d_log_f, None


def cumulative_log_forget_by_head_triton(log_f: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """As ``reference.cumulative_log_forget_by_head``: c [heads, batch * seq] float32, restarting at
    every batch row or packed sequence (cu_seqlens, batch 1). Differentiable in log_f."""
    batch, seq, _ = log_f.shape
    if cu_seqlens is None:
        cu = row_boundaries(batch, seq, log_f.device)
    else:
        cu = cu_seqlens.to(device=log_f.device, dtype=torch.int32)
    return _CumulativeLogForget.apply(log_f, cu)
