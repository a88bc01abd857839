"""Triton output gates (math: reference.py): one read of z and y, one write, forward and backward
(s = sigmoid(z) recomputed; sigmoid: dz = dout * y * s (1 - s), dy = dout * s; SiLU:
dz = dout * y * s (1 + z (1 - s)), dy = dout * z s), instead of an activation pass, a product pass
and a saved activation tensor."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached

BLOCK = 2048  # elements per program: a memory-bound pass, 8 bf16 per thread at 8 warps


@launch_cached
@triton.jit
def _fwd_kernel(Z, Y, O, n, BLOCK: tl.constexpr, SILU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    z = tl.load(Z + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
    act = z * tl.sigmoid(z) if SILU else tl.sigmoid(z)
    tl.store(O + offs, (act * y).to(O.dtype.element_ty), mask=ok)


@launch_cached
@triton.jit
def _bwd_kernel(Z, Y, DO, DZ, DY, n, BLOCK: tl.constexpr, SILU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    z = tl.load(Z + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(z)
    # d act / dz = s * factor
    if SILU:
        act, factor = z * s, 1.0 + z * (1.0 - s)
    else:
        act, factor = s, 1.0 - s
    tl.store(DZ + offs, (do * y * s * factor).to(DZ.dtype.element_ty), mask=ok)
    tl.store(DY + offs, (do * act).to(DY.dtype.element_ty), mask=ok)


def gate_forward_triton(z: torch.Tensor, y: torch.Tensor, silu: bool) -> torch.Tensor:
    """act(z) * y (act: SiLU if ``silu`` else sigmoid) for contiguous z, y of one shape."""
    out = torch.empty_like(y)
    n = y.numel()
    _fwd_kernel[(triton.cdiv(n, BLOCK),)](z, y, out, n, BLOCK=BLOCK, SILU=silu, num_warps=8)
    return out


def gate_backward_triton(z: torch.Tensor, y: torch.Tensor, dout: torch.Tensor, silu: bool):
    """(dz, dy) of gate_forward_triton for contiguous z, y, dout."""
    dz, dy = torch.empty_like(z), torch.empty_like(y)
    n = y.numel()
    _bwd_kernel[(triton.cdiv(n, BLOCK),)](z, y, dout, dz, dy, n, BLOCK=BLOCK, SILU=silu, num_warps=8)
    return dz, dy


class _OutputGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, y, silu: bool):
        z, y = z.contiguous(), y.contiguous()
        ctx.save_for_backward(z, y)
        ctx.silu = silu
        return gate_forward_triton(z, y, silu)

    @staticmethod
    def backward(ctx, dout):
        z, y = ctx.saved_tensors
        return (*gate_backward_triton(z, y, dout.contiguous(), ctx.silu), None)


def sigmoid_gate_triton(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _OutputGate.apply(z, y, False)
