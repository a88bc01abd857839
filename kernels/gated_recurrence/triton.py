"""Triton forward and backward of the gated linear recurrence (math: see reference.py).

    h_t = g_t * h_{t-1} + (1 - g_t) * x_t,   state zeroed before the update at every restart
                                            ((start_position + t) % chunk_size == 0)

Layout: x, g, h are viewed as [batch, seq, channels] (every trailing dimension is a channel).
A program owns BLOCK_N contiguous channels of one *segment* of SEG consecutive time steps and runs
the recurrence sequentially through it in fp32 registers; segments run in parallel.

* Chunked (RAT, chunk_size <= MAX_DIRECT_CHUNK): segments are aligned to chunk starts, so every
  segment but the first begins with a restart and needs no carry: one pass.
* Otherwise (RAT+, or long chunks): three passes. (1) each segment reports its end state from a
  zero start and the product of its (restart-masked) gates; (2) a short sequential pass per
  channel turns these into the state entering every segment; (3) the segments rerun from there.

Backward is the reverse recurrence on the adjoint a_t = dL/dh_t (total):

    a_t = dh_t + geff_{t+1} a_{t+1},   geff_t = 0 at a restart, g_t elsewhere
    dx_t = (1 - g_t) a_t,   dg_t = a_t (hprev_t - x_t),   d initial_state = geff_0 a_0

with hprev_t = h_{t-1} (0 at a restart, initial_state at t = 0), read back from the saved output.
It reuses the segment structure, scanning each segment from its end.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._grid import folded, split_program_id
from ..._compat.triton_launch import launch_cached

MAX_DIRECT_CHUNK = 128  # longer chunks go through the three-pass path (bounded unrolled loops)
GENERAL_SEGMENT = 64
BLOCK_N = 512  # channels per program: 8 per thread at 2 warps (16-byte bf16 accesses)
NUM_WARPS = 2
STEP_UNROLL = 8  # time steps unrolled per loop iteration (compile time grows with it)
CARRY_BLOCK_N = 64
CARRY_UNROLL = 32


@launch_cached
@triton.jit
def _recurrence_fwd_kernel(
    X, G, H, INIT, SUM_STATE, SUM_GATE,
    T, N, start, L, shift, num_seg,
    CHUNKED: tl.constexpr, INIT_MODE: tl.constexpr, SUMMARY: tl.constexpr,
    SEG: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):
    # INIT_MODE: 0 none, 1 INIT [B, N] feeds segment 0 only, 2 INIT [B, num_seg, N] per segment.
    seg, b = split_program_id(num_seg)
    b = b.to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    t0 = seg * SEG - shift
    if INIT_MODE == 1:
        h = tl.load(INIT + b * N + cols, mask=tl.where(seg == 0, cmask, False), other=0.0).to(tl.float32)
    elif INIT_MODE == 2:
        h = tl.load(INIT + (b * num_seg + seg) * N + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_N], dtype=tl.float32)
    prod = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
    for i0 in range(0, SEG, UNROLL):  # partly unrolled: loads of UNROLL steps in flight, short compile
        for u in tl.static_range(UNROLL):
            t = t0 + i0 + u
            valid = (t >= 0) & (t < T)
            m = tl.where(valid, cmask, False)  # (block & scalar bools gives int32 in the interpreter)
            offs = (b * T + t) * N + cols
            x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            g = tl.load(G + offs, mask=m, other=1.0).to(tl.float32)  # g = 1, x = 0 keeps h outside [0, T)
            if CHUNKED:
                restart = valid & (((start + t) % L) == 0)
                h = tl.where(restart, 0.0, h)
                if SUMMARY:
                    prod = tl.where(restart, 0.0, prod)
            h = g * h + (1.0 - g) * x
            if SUMMARY:
                prod = prod * g
            else:
                tl.store(H + offs, h.to(H.dtype.element_ty), mask=m)
    if SUMMARY:
        out = (b * num_seg + seg) * N + cols
        tl.store(SUM_STATE + out, h, mask=cmask)
        tl.store(SUM_GATE + out, prod, mask=cmask)


@triton.jit
def _compose(a1, b1, a2, b2):
    # (a1, b1) then (a2, b2): c -> a2 (a1 c + b1) + b2
    return a1 * a2, a2 * b1 + b2


@launch_cached
@triton.jit
def _carry_kernel(
    SUM_STATE, SUM_GATE, INIT, CARRY, N, num_seg,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):
    """State entering each segment: c_0 = init, c_{s+1} = P_s c_s + E_s (REVERSE: from the last segment).

    UNROLL segments at a time are composed by a small associative scan, so the sequential chain
    has num_seg / UNROLL memory round trips instead of num_seg.
    """
    pid_n, b = split_program_id(tl.cdiv(N, BLOCK_N))
    b = b.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_INIT:
        c = tl.load(INIT + b * N + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        c = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows_local = tl.arange(0, UNROLL)
    for s0 in range(0, num_seg, UNROLL):
        rows = s0 + rows_local
        if REVERSE:
            idx = num_seg - 1 - rows
            idx_next = idx - 1
        else:
            idx = rows
            idx_next = rows + 1
        ok = rows < num_seg
        mask = ok[:, None] & cmask[None, :]
        offs = (b * num_seg + idx)[:, None] * N + cols[None, :]
        p = tl.load(SUM_GATE + offs, mask=mask, other=1.0)
        e = tl.load(SUM_STATE + offs, mask=mask, other=0.0)
        pa, eb = tl.associative_scan((p, e), 0, _compose)
        after = pa * c[None, :] + eb  # state leaving each segment of this group
        first = (b * num_seg + idx)[:, None] * N + cols[None, :]
        tl.store(CARRY + first, tl.broadcast_to(c[None, :], (UNROLL, BLOCK_N)), mask=mask & (rows_local == 0)[:, None])
        nxt = (b * num_seg + idx_next)[:, None] * N + cols[None, :]
        tl.store(CARRY + nxt, after, mask=mask & (rows + 1 < num_seg)[:, None])
        c = tl.sum(tl.where((rows_local == UNROLL - 1)[:, None], after, 0.0), axis=0)


@launch_cached
@triton.jit
def _recurrence_bwd_kernel(
    X, G, H, INIT, DH, DX, DG, DINIT, CARRY, SUM_ACC, SUM_GATE,
    T, N, start, L, shift, num_seg,
    CHUNKED: tl.constexpr, HAS_INIT: tl.constexpr, HAS_CARRY: tl.constexpr, SUMMARY: tl.constexpr,
    SEG: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):
    seg, b = split_program_id(num_seg)
    b = b.to(tl.int64)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    t0 = seg * SEG - shift
    # acc = geff_{t+1} a_{t+1}: what the future contributes to the adjoint at t.
    if HAS_CARRY:
        acc = tl.load(CARRY + (b * num_seg + seg) * N + cols, mask=cmask, other=0.0)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    prod = tl.full([BLOCK_N], 1.0, dtype=tl.float32)
    for i0 in range(0, SEG, UNROLL):
        for u in tl.static_range(UNROLL):
            t = t0 + (SEG - 1 - i0 - u)
            valid = (t >= 0) & (t < T)
            m = tl.where(valid, cmask, False)  # (block & scalar bools gives int32 in the interpreter)
            offs = (b * T + t) * N + cols
            dh = tl.load(DH + offs, mask=m, other=0.0).to(tl.float32)
            g = tl.load(G + offs, mask=m, other=1.0).to(tl.float32)
            a = dh + acc
            restart = valid & (((start + t) % L) == 0) & CHUNKED
            if not SUMMARY:
                x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
                hprev = tl.load(H + offs - N, mask=tl.where(t > 0, m, False), other=0.0).to(tl.float32)
                if HAS_INIT:
                    hprev += tl.load(INIT + b * N + cols, mask=tl.where(t == 0, m, False), other=0.0).to(tl.float32)
                hprev = tl.where(restart, 0.0, hprev)
                tl.store(DX + offs, ((1.0 - g) * a).to(DX.dtype.element_ty), mask=m)
                tl.store(DG + offs, (a * (hprev - x)).to(DG.dtype.element_ty), mask=m)
            geff = tl.where(restart, 0.0, g)
            acc = geff * a
            if SUMMARY:
                prod = prod * geff
    if SUMMARY:
        out = (b * num_seg + seg) * N + cols
        tl.store(SUM_ACC + out, acc, mask=cmask)
        tl.store(SUM_GATE + out, prod, mask=cmask)
    elif HAS_INIT:
        tl.store(DINIT + b * N + cols, acc.to(DINIT.dtype.element_ty), mask=tl.where(t0 <= 0, cmask, False))


def _plan(seq: int, chunk_size: int, start_position: int) -> tuple[int, int, int, bool]:
    """(segment length, shift, number of segments, direct) for a sequence of ``seq`` steps."""
    if 0 < chunk_size <= MAX_DIRECT_CHUNK:
        seg = chunk_size * max(1, GENERAL_SEGMENT // chunk_size)
        first_boundary = (-start_position) % chunk_size  # local index of the first restart
        shift = (seg - first_boundary) % seg  # segment 1 starts exactly at that restart
        return seg, shift, triton.cdiv(seq + shift, seg), True
    return GENERAL_SEGMENT, 0, triton.cdiv(seq, GENERAL_SEGMENT), False


def scan_grid(batch: int, channels: int, num_seg: int) -> tuple[int, int]:
    """(batch x segments, channel blocks), segments fastest: a batch past 65,535 would not fit
    grid axes 1 or 2."""
    return folded(num_seg, batch, triton.cdiv(channels, BLOCK_N))


def carry_grid(batch: int, channels: int) -> tuple[int]:
    """batch x channel blocks on grid axis 0, channel blocks fastest."""
    return folded(triton.cdiv(channels, CARRY_BLOCK_N), batch)


def _launch_forward(x, g, chunk_size, start_position, init, out_dtype=None):
    batch, seq, channels = x.shape
    h = torch.empty(x.shape, device=x.device, dtype=out_dtype or x.dtype)
    seg, shift, num_seg, direct = _plan(seq, chunk_size, start_position)
    grid = scan_grid(batch, channels, num_seg)
    common = dict(CHUNKED=chunk_size > 0, SEG=seg, BLOCK_N=BLOCK_N, UNROLL=math.gcd(seg, STEP_UNROLL), num_warps=NUM_WARPS)
    args = (seq, channels, start_position, max(chunk_size, 1), shift, num_seg)
    if direct or num_seg == 1:
        _recurrence_fwd_kernel[grid](x, g, h, init if init is not None else x, x, x, *args,
                                     INIT_MODE=0 if init is None else 1, SUMMARY=False, **common)
        return h
    sum_state = torch.empty(batch, num_seg, channels, device=x.device, dtype=torch.float32)
    sum_gate = torch.empty_like(sum_state)
    _recurrence_fwd_kernel[grid](x, g, h, x, sum_state, sum_gate, *args, INIT_MODE=0, SUMMARY=True, **common)
    carry = torch.empty_like(sum_state)
    _carry_kernel[carry_grid(batch, channels)](
        sum_state, sum_gate, init if init is not None else x, carry, channels, num_seg,
        HAS_INIT=init is not None, REVERSE=False, BLOCK_N=CARRY_BLOCK_N, UNROLL=CARRY_UNROLL, num_warps=2,
    )
    _recurrence_fwd_kernel[grid](x, g, h, carry, x, x, *args, INIT_MODE=2, SUMMARY=False, **common)
    return h


def _launch_backward(x, g, h, init, dh, chunk_size, start_position):
    batch, seq, channels = x.shape
    dx, dg = torch.empty_like(x), torch.empty_like(g)
    dinit = torch.empty_like(init) if init is not None else None
    seg, shift, num_seg, direct = _plan(seq, chunk_size, start_position)
    grid = scan_grid(batch, channels, num_seg)
    common = dict(CHUNKED=chunk_size > 0, HAS_INIT=init is not None, SEG=seg, BLOCK_N=BLOCK_N, UNROLL=math.gcd(seg, STEP_UNROLL), num_warps=NUM_WARPS)
    args = (seq, channels, start_position, max(chunk_size, 1), shift, num_seg)
    init_ptr = init if init is not None else x
    dinit_ptr = dinit if dinit is not None else x
    if direct or num_seg == 1:
        _recurrence_bwd_kernel[grid](x, g, h, init_ptr, dh, dx, dg, dinit_ptr, x, x, x, *args,
                                     HAS_CARRY=False, SUMMARY=False, **common)
        return dx, dg, dinit
    sum_acc = torch.empty(batch, num_seg, channels, device=x.device, dtype=torch.float32)
    sum_gate = torch.empty_like(sum_acc)
    _recurrence_bwd_kernel[grid](x, g, h, init_ptr, dh, dx, dg, dinit_ptr, x, sum_acc, sum_gate, *args,
                                 HAS_CARRY=False, SUMMARY=True, **common)
    carry = torch.empty_like(sum_acc)
    _carry_kernel[carry_grid(batch, channels)](
        sum_acc, sum_gate, x, carry, channels, num_seg,
        HAS_INIT=False, REVERSE=True, BLOCK_N=CARRY_BLOCK_N, UNROLL=CARRY_UNROLL, num_warps=2,
    )
    _recurrence_bwd_kernel[grid](x, g, h, init_ptr, dh, dx, dg, dinit_ptr, carry, x, x, *args,
                                 HAS_CARRY=True, SUMMARY=False, **common)
    return dx, dg, dinit


class _GatedRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, chunk_size, start_position, initial_state, float32_out=False):
        shape = x.shape
        x3 = x.contiguous().view(shape[0], shape[1], -1)
        g3 = g.contiguous().view(shape[0], shape[1], -1)
        init = initial_state.contiguous().view(shape[0], -1) if initial_state is not None else None
        h3 = _launch_forward(x3, g3, chunk_size, start_position, init, torch.float32 if float32_out else None)
        ctx.save_for_backward(x3, g3, h3, init)
        ctx.config = (chunk_size, start_position, shape, initial_state is not None and initial_state.shape)
        return h3.view(shape)

    @staticmethod
    def backward(ctx, dh):
        x3, g3, h3, init = ctx.saved_tensors
        chunk_size, start_position, shape, init_shape = ctx.config
        dh3 = dh.contiguous().view(x3.shape)
        dx, dg, dinit = _launch_backward(x3, g3, h3, init, dh3, chunk_size, start_position)
        dinit = dinit.view(init_shape) if dinit is not None else None
        return dx.view(shape), dg.view(shape), None, None, dinit, None


def gated_recurrence_triton(
    x: torch.Tensor,
    g: torch.Tensor,
    chunk_size: int = 0,
    start_position: int = 0,
    initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton path of :func:`hf_hybrid.kernels.gated_recurrence.gated_recurrence` (differentiable in x, g
    and initial_state). x, g: [batch, seq, ...] with equal shapes; accumulates in fp32; returns x's dtype."""
    if x.dim() < 2:
        raise ValueError(f"gated_recurrence: x must be [batch, seq, ...], got shape {tuple(x.shape)}.")
    if x.shape[1] == 0 or x.numel() == 0:
        return x.clone()
    return _GatedRecurrence.apply(x, g, int(chunk_size), int(start_position), initial_state)
