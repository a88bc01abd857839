"""Triton sigmoid output gate (math: reference.py): one read of z and y, one write, forward and
backward (dz = dout * y * s (1 - s), dy = dout * s, s recomputed), instead of a sigmoid pass, a
product pass and a saved sigmoid tensor."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached

BLOCK = 2048  # elements per program: a memory-bound pass, 8 bf16 per thread at 8 warps


@launch_cached
@triton.jit
def _fwd_kernel(Z, Y, O, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    z = tl.load(Z + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(O + offs, (tl.sigmoid(z) * y).to(O.dtype.element_ty), mask=ok)


@launch_cached
@triton.jit
def _bwd_kernel(Z, Y, DO, DZ, DY, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    z = tl.load(Z + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(z)
    tl.store(DZ + offs, (do * y * s * (1.0 - s)).to(DZ.dtype.element_ty), mask=ok)
    tl.store(DY + offs, (do * s).to(DY.dtype.element_ty), mask=ok)


class _SigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, y):
        z, y = z.contiguous(), y.contiguous()
        out = torch.empty_like(y)
        n = y.numel()
        _fwd_kernel[(triton.cdiv(n, BLOCK),)](z, y, out, n, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(z, y)
        return out

    @staticmethod
    def backward(ctx, dout):
        z, y = ctx.saved_tensors
        dz, dy = torch.empty_like(z), torch.empty_like(y)
        n = y.numel()
        _bwd_kernel[(triton.cdiv(n, BLOCK),)](z, y, dout.contiguous(), dz, dy, n, BLOCK=BLOCK, num_warps=8)
        return dz, dy


def sigmoid_gate_triton(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _SigmoidGate.apply(z, y)
