"""Triton KV-shift (math: reference.py): one pass forward, one pass backward over [tokens, head_dim]
tiles of one (row, head), the gate recomputed from its logits, instead of a concatenation, a
sigmoid and four element-wise passes (and their saved intermediates) per tensor.

Backward, from out_t = x_t + a_t (x_{t-1} - x_t):
    dx_t      = (1 - a_t) dout_t + a_{t+1} dout_{t+1}      (a_T = 0: nothing after the last token)
    dlogits_t = a_t (1 - a_t) sum_d dout_t (x_{t-1} - x_t)
    dprevious = a_0 dout_0
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._grid import folded, split_program_id
from ..._compat.triton_launch import launch_cached

BLOCK_T = 32  # tokens per program: [32, 128] float32 tiles
NUM_WARPS = 8  # the backward holds four such tiles: 4 warps spill on sm_90


@triton.jit
def _rows(X, P, b, h, t, d, T, D, sxb, sxt, sxh, spb, sph, HAS_PREV: tl.constexpr):
    """(x_t, x_{t-1}) as float32 [BLOCK_T, BLOCK_D] tiles; x_{-1} = previous (or 0), rows >= T are 0."""
    cols = d[None, :] < D
    base = X + b * sxb + h * sxh + d[None, :]
    x = tl.load(base + t[:, None] * sxt, mask=(t[:, None] < T) & cols, other=0.0).to(tl.float32)
    before = t - 1
    xp = tl.load(base + before[:, None] * sxt, mask=(before[:, None] >= 0) & (before[:, None] < T) & cols, other=0.0)
    xp = xp.to(tl.float32)
    if HAS_PREV:
        prev = tl.load(P + b * spb + h * sph + d, mask=d < D, other=0.0).to(tl.float32)
        xp = tl.where(t[:, None] == 0, prev[None, :], xp)
    return x, xp


@launch_cached
@triton.jit
def _fwd_kernel(X, L, P, O, T, H, D, sxb, sxt, sxh, slb, slt, slh, spb, sph, sob, sot, soh,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PREV: tl.constexpr):
    tile, pid = split_program_id(tl.cdiv(T, BLOCK_T))
    b, h = (pid // H).to(tl.int64), (pid % H).to(tl.int64)
    t = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # t * stride passes 2**31 in long rows
    d = tl.arange(0, BLOCK_D)
    x, xp = _rows(X, P, b, h, t, d, T, D, sxb, sxt, sxh, spb, sph, HAS_PREV)
    a = tl.sigmoid(tl.load(L + b * slb + h * slh + t * slt, mask=t < T, other=0.0).to(tl.float32))
    out = x + a[:, None] * (xp - x)
    tl.store(O + b * sob + h * soh + t[:, None] * sot + d[None, :], out.to(O.dtype.element_ty),
             mask=(t[:, None] < T) & (d[None, :] < D))


@launch_cached
@triton.jit
def _bwd_kernel(X, L, P, DO, DX, DL, DP, T, H, D, sxb, sxt, sxh, slb, slt, slh, spb, sph, sdb, sdt, sdh,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PREV: tl.constexpr):
    tile, pid = split_program_id(tl.cdiv(T, BLOCK_T))
    b, h = (pid // H).to(tl.int64), (pid % H).to(tl.int64)
    t = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # t * stride passes 2**31 in long rows
    d = tl.arange(0, BLOCK_D)
    cols = d[None, :] < D
    x, xp = _rows(X, P, b, h, t, d, T, D, sxb, sxt, sxh, spb, sph, HAS_PREV)
    gates = L + b * slb + h * slh
    a = tl.sigmoid(tl.load(gates + t * slt, mask=t < T, other=0.0).to(tl.float32))
    a_next = tl.where(t + 1 < T, tl.sigmoid(tl.load(gates + (t + 1) * slt, mask=t + 1 < T, other=0.0).to(tl.float32)), 0.0)
    grads = DO + b * sdb + h * sdh + d[None, :]
    do = tl.load(grads + t[:, None] * sdt, mask=(t[:, None] < T) & cols, other=0.0).to(tl.float32)
    do_next = tl.load(grads + (t[:, None] + 1) * sdt, mask=(t[:, None] + 1 < T) & cols, other=0.0).to(tl.float32)
    dx = (1.0 - a)[:, None] * do + a_next[:, None] * do_next
    # DX shares x's strides (a fresh tensor of x's layout); DL is contiguous [B, T, H].
    tl.store(DX + b * sxb + h * sxh + t[:, None] * sxt + d[None, :], dx.to(DX.dtype.element_ty), mask=(t[:, None] < T) & cols)
    dl = a * (1.0 - a) * tl.sum(do * (xp - x), 1)
    tl.store(DL + (b * T + t) * H + h, dl.to(DL.dtype.element_ty), mask=t < T)
    if HAS_PREV:
        if tile == 0:
            # Only token 0 reads previous: its row of a * dout.
            dp = tl.sum(tl.where(t[:, None] == 0, a[:, None] * do, 0.0), 0)
            tl.store(DP + b * spb + h * sph + d, dp.to(DP.dtype.element_ty), mask=d < D)


def _grid(x: torch.Tensor):
    """Every (batch x head row, tile of BLOCK_T tokens) pair on grid axis 0, tiles fastest:
    batch x heads passes axis 1's limit of 65,535 at large batch."""
    batch, seq, heads, _ = x.shape
    return folded(triton.cdiv(seq, BLOCK_T), batch * heads)


def _prev_strides(previous: torch.Tensor | None) -> tuple[int, int]:
    return (previous.stride(0), previous.stride(1)) if previous is not None else (0, 0)


def kv_shift_forward(x: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    previous = previous.contiguous() if previous is not None else None
    batch, seq, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _fwd_kernel[_grid(x)](
        x, logits, previous if previous is not None else x, out, seq, heads, dim,
        x.stride(0), x.stride(1), x.stride(2), logits.stride(0), logits.stride(1), logits.stride(2),
        *_prev_strides(previous), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(dim), HAS_PREV=previous is not None, num_warps=NUM_WARPS,
    )
    return out


def kv_shift_backward(x, logits, previous, dout):
    """(dx in x's dtype, dlogits [B, T, H] in logits' dtype, dprevious in previous' dtype or None)."""
    x = x.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    previous = previous.contiguous() if previous is not None else None
    batch, seq, heads, dim = x.shape
    dx = torch.empty_like(x)
    dlogits = torch.empty(batch, seq, heads, dtype=logits.dtype, device=x.device)
    dprevious = torch.empty_like(previous) if previous is not None else None
    if x.numel():
        _bwd_kernel[_grid(x)](
            x, logits, previous if previous is not None else x, dout, dx, dlogits,
            dprevious if dprevious is not None else dx, seq, heads, dim,
            x.stride(0), x.stride(1), x.stride(2), logits.stride(0), logits.stride(1), logits.stride(2),
            *_prev_strides(previous), dout.stride(0), dout.stride(1), dout.stride(2),
            BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(dim), HAS_PREV=previous is not None, num_warps=NUM_WARPS,
        )
    elif dprevious is not None:
        dprevious.zero_()
    return dx, dlogits, dprevious
