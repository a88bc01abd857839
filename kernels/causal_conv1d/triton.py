"""Triton forward / backward of the depthwise causal conv1d (math: reference.py), and its decode step.

A program owns a [BLOCK_T tokens, BLOCK_C channels] tile of one sequence (channels last, so a row
of the tile is contiguous). The K taps are unrolled: out[t] = act(bias + sum_k w[k] x[t - K + 1 + k]),
where inputs before the sequence start come from the carried state (or are zero).

Backward in two passes, no atomics:
  1. dpre = dout * act'(pre) (pre recomputed from x), stored in x's dtype; per program a float32 partial
     sum of dweight[c, k] = sum_t dpre[t] x[t - K + 1 + k] and dbias[c] = sum_t dpre[t] (torch adds
     the few partials per channel afterwards: deterministic);
  2. dx[s] = sum_k w[k] dpre[s + K - 1 - k] (the transposed convolution).
The gradient of the carried state (its K - 1 used columns) is a few columns: done in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached
from .._backend import triton_interpreting
from .._grid import folded, split_program_id

# (tokens, channels, warps) of a tile, each direction its own: the fastest of a sweep at the SE
# hybrid's shape (docs/benchmarks/se_hybrid.md). Larger backward tiles at 2 warps spill registers.
FORWARD_TILE = (32, 128, 4)
BACKWARD_TILE = (64, 64, 2)
INTERPRET_TILE = (8, 32, 4)  # the CPU interpreter runs tiny shapes: several token blocks per test


def _tile(backward: bool) -> tuple[int, int, int]:
    if triton_interpreting():
        return INTERPRET_TILE
    return BACKWARD_TILE if backward else FORWARD_TILE


@triton.jit
def _tap(X, STATE, b, src, chans, tok_ok, chan_ok, T, sxb, sxt, ssb, ssc, K: tl.constexpr, HAS_STATE: tl.constexpr):
    """x at (possibly negative) positions src [BLOCK_T] for channels chans, float32 [BLOCK_T, BLOCK_C];
    negative positions read the carried state's column K + src (or zero without a state)."""
    inside = (src >= 0) & tok_ok
    ptrs = X + b * sxb + tl.maximum(src, 0).to(tl.int64)[:, None] * sxt + chans[None, :]
    val = tl.load(ptrs, mask=inside[:, None] & chan_ok[None, :], other=0.0).to(tl.float32)
    if HAS_STATE:
        before = (src < 0) & (src >= -(K - 1)) & tok_ok
        sptrs = STATE + b * ssb + chans[None, :] * ssc + tl.maximum(K + src, 0)[:, None]
        val += tl.load(sptrs, mask=before[:, None] & chan_ok[None, :], other=0.0).to(tl.float32)
    return val


@launch_cached
@triton.jit
def _conv_fwd(
    X, W, BIAS, STATE, OUT, T, Cn, sxb, sxt, ssb, ssc, sob, sot,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):
    pid_t, b = split_program_id(tl.cdiv(T, BT))
    b, pid_c = b.to(tl.int64), tl.program_id(1)
    toks = pid_t * BT + tl.arange(0, BT)
    chans = pid_c * BC + tl.arange(0, BC)
    tok_ok, chan_ok = toks < T, chans < Cn
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        w = tl.load(W + chans * K + k, mask=chan_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * _tap(X, STATE, b, toks - (K - 1) + k, chans, tok_ok, chan_ok, T, sxb, sxt, ssb, ssc, K, HAS_STATE)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    optrs = OUT + b * sob + toks.to(tl.int64)[:, None] * sot + chans[None, :]
    tl.store(optrs, acc.to(OUT.dtype.element_ty), mask=tok_ok[:, None] & chan_ok[None, :])


@launch_cached
@triton.jit
def _conv_bwd_pre(
    X, W, BIAS, STATE, DOUT, DPRE, DW_PART, DB_PART, T, Cn, sxb, sxt, ssb, ssc, sdb, sdt,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):
    pid_t, b = split_program_id(tl.cdiv(T, BT))
    b, pid_c = b.to(tl.int64), tl.program_id(1)
    toks = pid_t * BT + tl.arange(0, BT)
    chans = pid_c * BC + tl.arange(0, BC)
    tok_ok, chan_ok = toks < T, chans < Cn
    mask = tok_ok[:, None] & chan_ok[None, :]
    dout = tl.load(DOUT + b * sdb + toks.to(tl.int64)[:, None] * sdt + chans[None, :], mask=mask, other=0.0).to(tl.float32)
    if SILU:
        pre = tl.zeros((BT, BC), dtype=tl.float32)
        if HAS_BIAS:
            pre += tl.load(BIAS + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
        for k in tl.static_range(K):
            w = tl.load(W + chans * K + k, mask=chan_ok, other=0.0).to(tl.float32)
            pre += w[None, :] * _tap(X, STATE, b, toks - (K - 1) + k, chans, tok_ok, chan_ok, T, sxb, sxt, ssb, ssc, K, HAS_STATE)
        sig = tl.sigmoid(pre)
        dpre = dout * sig * (1.0 + pre * (1.0 - sig))
    else:
        dpre = dout
    tl.store(DPRE + (b * T + toks.to(tl.int64))[:, None] * Cn + chans[None, :], dpre, mask=mask)
    part = (b * tl.cdiv(T, BT) + pid_t) * Cn
    for k in tl.static_range(K):
        xk = _tap(X, STATE, b, toks - (K - 1) + k, chans, tok_ok, chan_ok, T, sxb, sxt, ssb, ssc, K, HAS_STATE)
        tl.store(DW_PART + (part + chans) * K + k, tl.sum(dpre * xk, axis=0), mask=chan_ok)
    tl.store(DB_PART + part + chans, tl.sum(dpre, axis=0), mask=chan_ok)


@launch_cached
@triton.jit
def _conv_bwd_dx(DPRE, W, DX, T, Cn, sdb, sdt, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t, b = split_program_id(tl.cdiv(T, BT))
    b, pid_c = b.to(tl.int64), tl.program_id(1)
    toks = pid_t * BT + tl.arange(0, BT)
    chans = pid_c * BC + tl.arange(0, BC)
    tok_ok, chan_ok = toks < T, chans < Cn
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.load(W + chans * K + k, mask=chan_ok, other=0.0).to(tl.float32)
        dst = toks + (K - 1) - k  # the output position that read x[s] through tap k
        ok = (dst < T) & tok_ok
        d = tl.load(DPRE + (b * T + dst.to(tl.int64))[:, None] * Cn + chans[None, :], mask=ok[:, None] & chan_ok[None, :], other=0.0)
        acc += w[None, :] * d
    tl.store(DX + b * sdb + toks.to(tl.int64)[:, None] * sdt + chans[None, :], acc.to(DX.dtype.element_ty),
             mask=tok_ok[:, None] & chan_ok[None, :])


@launch_cached
@triton.jit
def _conv_step(
    X, STATE, W, BIAS, OUT, Cn, sxb, ssb, ssc, ssk, sob,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr,
):
    b, pid_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    chans = pid_c * BC + tl.arange(0, BC)
    ok = chans < Cn
    x = tl.load(X + b * sxb + chans, mask=ok, other=0.0)
    acc = tl.zeros((BC,), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + chans, mask=ok, other=0.0).to(tl.float32)
    srow = STATE + b * ssb + chans * ssc
    # Window = state columns 1 .. K-1, then x. Each column is read before it is overwritten.
    for k in tl.static_range(K - 1):
        col = tl.load(srow + (k + 1) * ssk, mask=ok, other=0.0)
        tl.store(srow + k * ssk, col, mask=ok)
        acc += tl.load(W + chans * K + k, mask=ok, other=0.0).to(tl.float32) * col.to(tl.float32)
    tl.store(srow + (K - 1) * ssk, x.to(STATE.dtype.element_ty), mask=ok)
    acc += tl.load(W + chans * K + (K - 1), mask=ok, other=0.0).to(tl.float32) * x.to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(OUT + b * sob + chans, acc.to(OUT.dtype.element_ty), mask=ok)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _state_arg(state, x):
    if state is None:
        return x, 0, 0  # dummy pointer; HAS_STATE=False never reads it
    state = state.contiguous()
    return state, state.stride(0), state.stride(1)


def conv_grid(batch: int, seq: int, channels: int, bt: int, bc: int) -> tuple[int, int]:
    """(batch x token tiles, channel tiles), token tiles fastest: a batch past 65,535 would not
    fit grid axes 1 or 2."""
    return folded(triton.cdiv(seq, bt), batch, triton.cdiv(channels, bc))


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, silu):
        x = _rows_contiguous(x)
        weight = weight.contiguous()
        batch, seq, channels = x.shape
        width = weight.shape[1]
        out = torch.empty((batch, seq, channels), dtype=x.dtype, device=x.device)
        state, ssb, ssc = _state_arg(initial_state, x)
        bt, bc, warps = _tile(backward=False)
        grid = conv_grid(batch, seq, channels, bt, bc)
        _conv_fwd[grid](
            x, weight, bias if bias is not None else weight, state, out, seq, channels,
            x.stride(0), x.stride(1), ssb, ssc, out.stride(0), out.stride(1),
            K=width, HAS_BIAS=bias is not None, HAS_STATE=initial_state is not None, SILU=silu, BT=bt, BC=bc,
            num_warps=warps,
        )
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.silu = silu
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, initial_state = ctx.saved_tensors
        need_dstate = initial_state is not None and ctx.needs_input_grad[3]
        return (*causal_conv1d_backward(x, weight, bias, initial_state, dout, ctx.silu, ctx.needs_input_grad[0], need_dstate), None)


def causal_conv1d_backward(x, weight, bias, initial_state, dout, silu, need_dx=True, need_dstate=False, dx=None):
    """(dx or None, dweight, dbias or None, d initial_state or None) of the Triton conv. ``dx``: a
    [batch, seq, channels] buffer (row-strided, channels contiguous: a slice of the input
    projection's gradient) to write dx into, else a new one."""
    dout = _rows_contiguous(dout)
    batch, seq, channels = x.shape
    width = weight.shape[1]
    bt, bc, warps = _tile(backward=True)
    grid = conv_grid(batch, seq, channels, bt, bc)
    # The gradient before the activation, stored in x's dtype for dx (computed and reduced into
    # dweight / dbias in float32 inside the first kernel): half the bytes of float32 for both
    # kernels (`python -m benchmarks.conv_sweep`, docs/benchmarks/se_hybrid.md).
    dpre = torch.empty((batch, seq, channels), dtype=x.dtype, device=x.device)
    dw_part = torch.empty((grid[0], channels, width), dtype=torch.float32, device=x.device)
    db_part = torch.empty((grid[0], channels), dtype=torch.float32, device=x.device)
    state, ssb, ssc = _state_arg(initial_state, x)
    _conv_bwd_pre[grid](
        x, weight, bias if bias is not None else weight, state, dout, dpre, dw_part, db_part, seq, channels,
        x.stride(0), x.stride(1), ssb, ssc, dout.stride(0), dout.stride(1),
        K=width, HAS_BIAS=bias is not None, HAS_STATE=initial_state is not None, SILU=silu, BT=bt, BC=bc,
        num_warps=warps,
    )
    if need_dx:
        if dx is None:
            dx = torch.empty((batch, seq, channels), dtype=x.dtype, device=x.device)
        elif dx.shape != x.shape or dx.dtype != x.dtype or dx.stride(-1) != 1:
            raise ValueError(f"causal_conv1d_backward: dx must be {tuple(x.shape)} {x.dtype} with contiguous channels.")
        _conv_bwd_dx[grid](
            dpre, weight, dx, seq, channels, dx.stride(0), dx.stride(1), K=width, BT=bt, BC=bc, num_warps=warps,
        )
    else:
        dx = None
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    dstate = None
    if need_dstate:
        # State column j (j >= 1) is x at position j - K: it feeds outputs t = j - K + K - 1 - k = j - 1 - k.
        dstate = torch.zeros_like(initial_state, dtype=torch.float32)
        for j in range(1, width):
            for k in range(width):
                t = j - 1 - k
                if 0 <= t < seq:
                    dstate[:, :, j] += weight[:, k].float() * dpre[:, t, :].float()
        dstate = dstate.to(initial_state.dtype)
    return dx, dweight, dbias, dstate


def causal_conv1d_triton(x, weight, bias, initial_state, activation, return_final_state):
    out = _CausalConv1d.apply(x, weight, bias, initial_state, activation in ("silu", "swish"))
    if not return_final_state:
        return out
    width = weight.shape[1]
    history = x.new_zeros(x.shape[0], x.shape[2], width) if initial_state is None else initial_state.to(x.dtype)
    final_state = torch.cat([history, x.transpose(1, 2)], dim=-1)[..., -width:]
    return out, final_state


def causal_conv1d_step_triton(x, conv_state, weight, bias, activation, out):
    batch, channels = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    weight = weight if weight.is_contiguous() else weight.contiguous()
    bc = INTERPRET_TILE[1] if triton_interpreting() else 256
    _conv_step[(batch, triton.cdiv(channels, bc))](
        x, conv_state, weight, bias if bias is not None else weight, out, channels,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        K=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation in ("silu", "swish"), BC=bc,
    )
    return out
