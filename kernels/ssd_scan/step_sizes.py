"""The SSD scan's step sizes on Triton: the discretisation (math: reference.discretize_dt) and the
chunks' cumulative log decay, forward and backward, one launch each.

    forward    dt_t = clamp(softplus(dt_raw_t + dt_bias), low, high)     (or the given dt as is)
               g_t  = sum of dt_s * A over the tokens s <= t of t's chunk   (float32, padded to whole chunks)
    backward   d dt_raw_t = d dt_t * sigmoid(dt_raw_t + dt_bias) * [low <= softplus(.) <= high]
               d dt_bias  = sum over tokens of d dt_raw

Written with torch these are about ten small launches a call (casts of a strided slice of in_proj's
output, the softplus, the clamp, a pad, a cumsum over a non-innermost dim, ...). softplus follows
torch's (threshold 20); the clamp passes the gradient where the bounds hold with equality, as
torch's clamp does. Tokens past the sequence (the last chunk's padding) have dt = 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached
from .._common import last_dim_contiguous

BLOCK_HEADS = 64  # heads per program (the SE hybrid's 64 in one)
BLOCK_ROWS_BWD = 64  # tokens per program of the backward (each writes one partial of d dt_bias)


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@launch_cached
@triton.jit
def _forward_kernel(
    DT_IN, BIAS, A, DT_OUT, G, T, H, NT, sib, sit, dt_low, dt_high,
    L: tl.constexpr, BH: tl.constexpr, DISCRETIZE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr,
):
    pid = tl.program_id(0)
    c, b = pid % NT, (pid // NT).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    rows = c * L + tl.arange(0, L)
    h_ok = heads < H
    ok = (rows < T)[:, None] & h_ok[None, :]
    dt = tl.load(DT_IN + b * sib + rows.to(tl.int64)[:, None] * sit + heads[None, :], mask=ok, other=0.0).to(tl.float32)
    if DISCRETIZE:
        if HAS_BIAS:
            dt += tl.load(BIAS + heads, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        dt = _softplus(dt)
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_low), dt_high)
        dt = tl.where(ok, dt, 0.0)
        tl.store(DT_OUT + (b * T + rows.to(tl.int64))[:, None] * H + heads[None, :], dt, mask=ok)
    a = tl.load(A + heads, mask=h_ok, other=0.0).to(tl.float32)
    g = tl.cumsum(dt * a[None, :], 0)
    tl.store(G + (b * NT * L + rows.to(tl.int64))[:, None] * H + heads[None, :], g, mask=h_ok[None, :])


@launch_cached
@triton.jit
def _backward_kernel(
    DDT, RAW, BIAS, DRAW, DBIAS_PARTS, rows_total, T, H, srb, srt, sdb, sdt, dt_low, dt_high,
    BR: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = heads < H
    ok = (rows < rows_total)[:, None] & h_ok[None, :]
    b, t = (rows // T).to(tl.int64), (rows % T).to(tl.int64)
    pre = tl.load(RAW + (b * srb + t * srt)[:, None] + heads[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        pre += tl.load(BIAS + heads, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    grad = tl.load(DDT + rows.to(tl.int64)[:, None] * H + heads[None, :], mask=ok, other=0.0) * tl.sigmoid(pre)
    if CLAMP:
        soft = _softplus(pre)
        grad = tl.where((soft >= dt_low) & (soft <= dt_high), grad, 0.0)
    grad = tl.where(ok, grad, 0.0)
    tl.store(DRAW + (b * sdb + t * sdt)[:, None] + heads[None, :], grad.to(DRAW.dtype.element_ty), mask=ok)
    tl.store(DBIAS_PARTS + pid * H + heads, tl.sum(grad, axis=0), mask=h_ok)


def _clamps(dt_limit: tuple[float, float]) -> bool:
    return tuple(dt_limit) != (0.0, float("inf"))


def _bounds(dt_limit: tuple[float, float]) -> tuple[float, float]:
    # Triton takes finite float arguments only; a bound that is not applied is never read.
    return float(dt_limit[0]), min(float(dt_limit[1]), 3.0e38)


def _block_heads(heads: int) -> int:
    return min(BLOCK_HEADS, max(16, triton.next_power_of_2(heads)))


def _forward(dt_in, bias, A, chunk, discretize, dt_limit):
    batch, seq, heads = dt_in.shape
    dt_in = last_dim_contiguous(dt_in)
    n_chunks = triton.cdiv(seq, chunk)
    g = torch.empty((batch, n_chunks * chunk, heads), dtype=torch.float32, device=dt_in.device)
    dt = torch.empty((batch, seq, heads), dtype=torch.float32, device=dt_in.device) if discretize else dt_in
    block = _block_heads(heads)
    low, high = _bounds(dt_limit)
    _forward_kernel[(batch * n_chunks, triton.cdiv(heads, block))](
        dt_in, bias if bias is not None else A, A, dt, g, seq, heads, n_chunks, dt_in.stride(0), dt_in.stride(1),
        low, high, L=chunk, BH=block, DISCRETIZE=discretize, HAS_BIAS=bias is not None, CLAMP=_clamps(dt_limit),
    )
    return dt, g


def chunk_log_decay(dt: torch.Tensor, A: torch.Tensor, chunk: int) -> torch.Tensor:
    """g [batch, T rounded up to chunks, heads] float32 of float32 step sizes dt [batch, T, heads]."""
    return _forward(dt, None, A, chunk, False, (0.0, float("inf")))[1]


def discretized_step_sizes(dt_raw: torch.Tensor, dt_bias: torch.Tensor | None, A: torch.Tensor,
                           dt_limit: tuple[float, float], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dt [batch, T, heads] float32, g) from raw step sizes (a strided slice is read in place):
    dt = clamp(softplus(dt_raw + dt_bias), *dt_limit), g as :func:`chunk_log_decay`."""
    return _forward(dt_raw, dt_bias, A, chunk, True, dt_limit)


def discretized_step_sizes_backward(ddt: torch.Tensor, dt_raw: torch.Tensor, dt_bias: torch.Tensor | None,
                                    dt_limit: tuple[float, float], ddt_raw: torch.Tensor) -> torch.Tensor | None:
    """Writes d dt_raw (of d dt [batch, T, heads] float32) into ``ddt_raw`` (shaped like dt_raw, a
    contiguous last dim); returns d dt_bias float32 (None without a bias)."""
    batch, seq, heads = dt_raw.shape
    dt_raw = last_dim_contiguous(dt_raw)
    if ddt_raw.shape != dt_raw.shape or ddt_raw.stride(-1) != 1:
        raise ValueError(f"discretized_step_sizes_backward: ddt_raw must be {tuple(dt_raw.shape)} with a contiguous last dim.")
    rows = batch * seq
    block = _block_heads(heads)
    grid = (triton.cdiv(rows, BLOCK_ROWS_BWD), triton.cdiv(heads, block))
    parts = torch.empty((grid[0], heads), dtype=torch.float32, device=ddt.device)
    low, high = _bounds(dt_limit)
    _backward_kernel[grid](
        ddt.contiguous(), dt_raw, dt_bias if dt_bias is not None else ddt, ddt_raw, parts, rows, seq, heads,
        dt_raw.stride(0), dt_raw.stride(1), ddt_raw.stride(0), ddt_raw.stride(1), low, high,
        BR=BLOCK_ROWS_BWD, BH=block, HAS_BIAS=dt_bias is not None,
        CLAMP=_clamps(dt_limit),
    )
    return parts.sum(0) if dt_bias is not None else None
