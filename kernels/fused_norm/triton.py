"""Triton forward and backward of the per-head norms (math: see reference.py).

One row is one (token, head) vector of head_dim D. A program owns one head h and a block of
BLOCK_T tokens (the [B, T] axes flattened), so it reads a [BLOCK_T, D] tile of strided rows, keeps
it in float32 registers and writes the result once, in the input dtype:

* rms_norm_rotary: y = RoPE(w_h * x * r), r = rsqrt(mean(x^2) + eps). The row is handled as its
  two halves [x1, x2], which makes rotate-half elementwise:
      y1 = n1 * cos1 - n2 * sin1,   y2 = n2 * cos2 + n1 * sin2.
* branch_norm_sum: y = w_a,h * a * r_a + w_b,h * b * r_b (the second term optional).

Backward, per row, with g the gradient reaching the normalised row n = w * xh, xh = x * r:

    RoPE^T:  g1 = dy1 * cos1 + dy2 * sin2,   g2 = dy2 * cos2 - dy1 * sin1    (inverse rotation)
    dx = r * (g * w - xh * mean(g * w * xh)),    dw_h = sum over the head's rows of g * xh

(the branch sum's two terms each get dy as their g). r is recomputed from x instead of saved: the
row is read anyway and the recompute is a handful of flops. The weight gradient needs no atomics:
a backward program walks a fixed range of tokens for its head, accumulates g * xh in registers
and writes one [D] partial sum; torch sums the few partials per head afterwards (deterministic).

Head is the fastest-varying program index, so the programs running together share their tokens: the heads of
a token block are adjacent in memory, and the token's cos/sin rows are read once from DRAM and
then hit in L2. Inputs may be strided views ([B, T, H, D] slices of a projection output, or a
transposed attention output) as long as the last dimension is contiguous; others are copied once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from .._common import last_dim_contiguous
from .._grid import MAX_GRID_YZ
from ..._compat.triton_launch import launch_cached

MAX_HEAD_DIM = 1024  # a [BLOCK_T, D] float32 tile per operand must fit in registers
# Elements per operand tile: 8 tokens x 128 at 4 warps, the fastest of (tokens, warps) in
# {8, 16, 32} x {4, 8} for both kernels at RATTENTION's shape (`python -m hf_hybrid.bench.rattention`).
TILE_ELEMENTS = 1024
MAX_BLOCK_T = 64
NUM_WARPS = 4
# Backward: programs per head ~ TARGET_PROGRAMS / heads, each looping over its range of tokens
# (enough programs to fill a 132-SM GPU twice over; few enough that the partial sums stay ~1 MB).
TARGET_PROGRAMS = 2048
# The CPU interpreter runs tiny shapes: small tiles and few programs make the tests cover several
# token blocks per program, ragged ends and more than one partial sum per head.
INTERPRET_BLOCK_T = 4
INTERPRET_PROGRAMS_PER_HEAD = 2


# ---------------------------------------------------------------- kernel helpers


@triton.jit
def _row_offsets(tokens, T, stride_b, stride_t, head_offset):
    """Element offsets of the rows of `tokens` (flattened b * T + t) for one head: [BLOCK_T, 1]."""
    tok = tokens.to(tl.int64)
    return ((tok // T) * stride_b + (tok % T) * stride_t + head_offset)[:, None]


@triton.jit
def _load_f32(ptr, offsets, mask):
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _token_tile(start, limit, cols, width, BLOCK_T: tl.constexpr):
    """Tokens start .. start + BLOCK_T - 1 of a head, which of them exist (< limit), and the
    [BLOCK_T, columns] mask (columns < width)."""
    tokens = start + tl.arange(0, BLOCK_T)
    rows_ok = tokens < limit
    return tokens, rows_ok, rows_ok[:, None] & (cols < width)[None, :]


@triton.jit
def _rope_tables(COS, SIN, tokens, T, sc_b, sc_t, ss_b, ss_t, cols, mask, HALF: tl.constexpr):
    """The tokens' cos / sin rows as float32 [BLOCK_T, half] tiles: (cos1, cos2, sin1, sin2)."""
    c_rows = _row_offsets(tokens, T, sc_b, sc_t, 0) + cols[None, :]
    s_rows = _row_offsets(tokens, T, ss_b, ss_t, 0) + cols[None, :]
    return (_load_f32(COS, c_rows, mask), _load_f32(COS, c_rows + HALF, mask),
            _load_f32(SIN, s_rows, mask), _load_f32(SIN, s_rows + HALF, mask))


@triton.jit
def _head_and_block(heads):
    """(head, token block) of a forward program: one flat grid axis, head fastest (grid axes 1 and
    2 stop at 65,535 programs, fewer than the token blocks of a large prefill)."""
    pid = tl.program_id(0)
    return pid % heads, pid // heads


@triton.jit
def _inv_rms(sum_sq, rows_ok, D: tl.constexpr, eps):
    # Rows past the end read zeros; with eps = 0 their rsqrt would be inf and poison the weight
    # gradient through 0 * inf, so they take rsqrt(1) (their x is 0, so x * r stays 0).
    return tl.rsqrt(tl.where(rows_ok, sum_sq / D + eps, 1.0))


# ---------------------------------------------------------------- RMSNorm + RoPE


@launch_cached
@triton.jit
def _norm_rope_fwd_kernel(
    X, W, COS, SIN, Y,
    n_tokens, T, heads, eps,
    sx_b, sx_t, sx_h, sc_b, sc_t, ss_b, ss_t,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    h, token_block = _head_and_block(heads)
    cols = tl.arange(0, BLOCK_HALF)
    tokens, rows_ok, mask = _token_tile(token_block * BLOCK_T, n_tokens, cols, HALF, BLOCK_T)

    x_rows = _row_offsets(tokens, T, sx_b, sx_t, h.to(tl.int64) * sx_h)
    n1 = _load_f32(X, x_rows + cols[None, :], mask)
    n2 = _load_f32(X, x_rows + HALF + cols[None, :], mask)
    if HAS_NORM:  # else RoPE alone
        r = _inv_rms(tl.sum(n1 * n1, 1) + tl.sum(n2 * n2, 1), rows_ok, D, eps)[:, None]
        n1 = _load_f32(W, h * D + cols, cols < HALF)[None, :] * (n1 * r)
        n2 = _load_f32(W, h * D + HALF + cols, cols < HALF)[None, :] * (n2 * r)

    cos1, cos2, sin1, sin2 = _rope_tables(COS, SIN, tokens, T, sc_b, sc_t, ss_b, ss_t, cols, mask, HALF)
    y1 = n1 * cos1 - n2 * sin1
    y2 = n2 * cos2 + n1 * sin2

    y_rows = (tokens.to(tl.int64) * heads + h)[:, None] * D
    tl.store(Y + y_rows + cols[None, :], y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + y_rows + HALF + cols[None, :], y2.to(Y.dtype.element_ty), mask=mask)


@launch_cached
@triton.jit
def _norm_rope_bwd_kernel(
    X, W, COS, SIN, DY, DX, DW_PART,
    n_tokens, T, eps, tokens_per_program,
    sx_b, sx_t, sx_h, sc_b, sc_t, ss_b, ss_t, sd_b, sd_t, sd_h,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    h = tl.program_id(0)
    heads = tl.num_programs(0)
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    col_ok = cols < HALF
    w1 = _load_f32(W, h * D + cols, col_ok & HAS_NORM)[None, :]
    w2 = _load_f32(W, h * D + HALF + cols, col_ok & HAS_NORM)[None, :]
    dw1 = tl.zeros([BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_T, BLOCK_HALF], dtype=tl.float32)
    first = part * tokens_per_program
    last = tl.minimum(first + tokens_per_program, n_tokens)
    for start in range(first, last, BLOCK_T):
        tokens, rows_ok, mask = _token_tile(start, last, cols, HALF, BLOCK_T)

        d_rows = _row_offsets(tokens, T, sd_b, sd_t, h.to(tl.int64) * sd_h)
        dy1 = _load_f32(DY, d_rows + cols[None, :], mask)
        dy2 = _load_f32(DY, d_rows + HALF + cols[None, :], mask)
        cos1, cos2, sin1, sin2 = _rope_tables(COS, SIN, tokens, T, sc_b, sc_t, ss_b, ss_t, cols, mask, HALF)
        g1 = dy1 * cos1 + dy2 * sin2  # the transposed rotation: gradient w.r.t. the normed row
        g2 = dy2 * cos2 - dy1 * sin1
        dx_rows = (tokens.to(tl.int64) * heads + h)[:, None] * D
        if HAS_NORM:
            x_rows = _row_offsets(tokens, T, sx_b, sx_t, h.to(tl.int64) * sx_h)
            x1 = _load_f32(X, x_rows + cols[None, :], mask)
            x2 = _load_f32(X, x_rows + HALF + cols[None, :], mask)
            r = _inv_rms(tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1), rows_ok, D, eps)[:, None]
            xh1 = x1 * r
            xh2 = x2 * r
            dw1 += g1 * xh1
            dw2 += g2 * xh2
            gw1 = g1 * w1
            gw2 = g2 * w2
            proj = ((tl.sum(gw1 * xh1, 1) + tl.sum(gw2 * xh2, 1)) / D)[:, None]
            g1 = r * (gw1 - xh1 * proj)
            g2 = r * (gw2 - xh2 * proj)
        tl.store(DX + dx_rows + cols[None, :], g1.to(DX.dtype.element_ty), mask=mask)
        tl.store(DX + dx_rows + HALF + cols[None, :], g2.to(DX.dtype.element_ty), mask=mask)

    if HAS_NORM:
        part_row = (part * heads + h).to(tl.int64) * D
        tl.store(DW_PART + part_row + cols, tl.sum(dw1, 0), mask=col_ok)
        tl.store(DW_PART + part_row + HALF + cols, tl.sum(dw2, 0), mask=col_ok)


# ---------------------------------------------------------------- sum of two RMSNorms


@launch_cached
@triton.jit
def _branch_fwd_kernel(
    A, WA, B, WB, Y,
    n_tokens, T, heads, eps_a, eps_b,
    sa_b, sa_t, sa_h, sb_b, sb_t, sb_h,
    HAS_B: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    h, token_block = _head_and_block(heads)
    cols = tl.arange(0, BLOCK_D)
    tokens, rows_ok, mask = _token_tile(token_block * BLOCK_T, n_tokens, cols, D, BLOCK_T)

    a = _load_f32(A, _row_offsets(tokens, T, sa_b, sa_t, h.to(tl.int64) * sa_h) + cols[None, :], mask)
    r_a = _inv_rms(tl.sum(a * a, 1), rows_ok, D, eps_a)[:, None]
    y = _load_f32(WA, h * D + cols, cols < D)[None, :] * (a * r_a)
    if HAS_B:
        b = _load_f32(B, _row_offsets(tokens, T, sb_b, sb_t, h.to(tl.int64) * sb_h) + cols[None, :], mask)
        r_b = _inv_rms(tl.sum(b * b, 1), rows_ok, D, eps_b)[:, None]
        y += _load_f32(WB, h * D + cols, cols < D)[None, :] * (b * r_b)
    y_rows = (tokens.to(tl.int64) * heads + h)[:, None] * D
    tl.store(Y + y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_tile(X, W, DX, dw_acc, dy, tokens, rows_ok, mask, cols, h, heads, T, eps, s_b, s_t, s_h,
                   D: tl.constexpr):
    """One branch's backward on a [BLOCK_T, BLOCK_D] tile: stores dx, returns dw_acc + dy * xh."""
    x = _load_f32(X, _row_offsets(tokens, T, s_b, s_t, h.to(tl.int64) * s_h) + cols[None, :], mask)
    r = _inv_rms(tl.sum(x * x, 1), rows_ok, D, eps)[:, None]
    xh = x * r
    gw = dy * _load_f32(W, h * D + cols, cols < D)[None, :]
    proj = (tl.sum(gw * xh, 1) / D)[:, None]
    dx_rows = (tokens.to(tl.int64) * heads + h)[:, None] * D
    tl.store(DX + dx_rows + cols[None, :], (r * (gw - xh * proj)).to(DX.dtype.element_ty), mask=mask)
    return dw_acc + dy * xh


@launch_cached
@triton.jit
def _branch_bwd_kernel(
    A, WA, B, WB, DY, DA, DB, DWA_PART, DWB_PART,
    n_tokens, T, eps_a, eps_b, tokens_per_program,
    sa_b, sa_t, sa_h, sb_b, sb_t, sb_h, sd_b, sd_t, sd_h,
    HAS_B: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    h = tl.program_id(0)
    heads = tl.num_programs(0)
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    dwa = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    dwb = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    first = part * tokens_per_program
    last = tl.minimum(first + tokens_per_program, n_tokens)
    for start in range(first, last, BLOCK_T):
        tokens, rows_ok, mask = _token_tile(start, last, cols, D, BLOCK_T)
        dy = _load_f32(DY, _row_offsets(tokens, T, sd_b, sd_t, h.to(tl.int64) * sd_h) + cols[None, :], mask)
        dwa = _norm_bwd_tile(A, WA, DA, dwa, dy, tokens, rows_ok, mask, cols, h, heads, T, eps_a, sa_b, sa_t, sa_h, D)
        if HAS_B:
            dwb = _norm_bwd_tile(B, WB, DB, dwb, dy, tokens, rows_ok, mask, cols, h, heads, T, eps_b, sb_b, sb_t, sb_h, D)
    part_row = (part * heads + h).to(tl.int64) * D
    tl.store(DWA_PART + part_row + cols, tl.sum(dwa, 0), mask=col_ok)
    if HAS_B:
        tl.store(DWB_PART + part_row + cols, tl.sum(dwb, 0), mask=col_ok)


# ---------------------------------------------------------------- launch helpers


def _bt_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, seq) strides of a [B, T, ...] tensor."""
    return t.stride(0), t.stride(1)


def _bth_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a [B, T, H, D] tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


def _block_tokens(block_cols: int, block_tokens: int | None) -> int:
    if block_tokens is not None:
        return block_tokens
    if triton_interpreting():
        return INTERPRET_BLOCK_T
    return max(1, min(MAX_BLOCK_T, TILE_ELEMENTS // block_cols))


def _backward_split(n_tokens: int, heads: int, block_t: int, programs: int | None) -> tuple[int, int]:
    """(programs per head, tokens per program); a program's range is a whole number of blocks."""
    n_blocks = triton.cdiv(n_tokens, block_t)
    if programs is None:
        programs = INTERPRET_PROGRAMS_PER_HEAD if triton_interpreting() else triton.cdiv(TARGET_PROGRAMS, heads)
    blocks_per_program = triton.cdiv(n_blocks, max(1, min(programs, n_blocks, MAX_GRID_YZ)))
    return triton.cdiv(n_blocks, blocks_per_program), blocks_per_program * block_t


def forward_grid(n_tokens: int, heads: int, block_t: int) -> tuple[int]:
    """Forward programs: (head, token block) pairs on one axis, head fastest."""
    return (heads * triton.cdiv(n_tokens, block_t),)


def backward_grid(n_tokens: int, heads: int, block_t: int, programs: int | None = None) -> tuple[int, int]:
    """Backward programs: (head, part of the tokens); the parts are few (``_backward_split``)."""
    return heads, _backward_split(n_tokens, heads, block_t, programs)[0]


def _expand_rotary(t: torch.Tensor, batch: int, seq: int, dim: int) -> torch.Tensor:
    """cos or sin broadcast to [B, T, 1, D] without a copy (stride 0 on broadcast axes)."""
    return last_dim_contiguous(t.expand(batch, seq, 1, dim))


def _reduce_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return partials.sum(0).to(dtype)


# ---------------------------------------------------------------- RMSNorm + RoPE: autograd


class _RmsNormRotary(torch.autograd.Function):
    """weight None: RoPE alone (no norm, no weight gradient)."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps, tune):
        batch, seq, heads, dim = x.shape
        x = last_dim_contiguous(x)
        has_norm = weight is not None
        weight = weight.contiguous() if has_norm else x  # never read without the norm
        cos, sin = _expand_rotary(cos, batch, seq, dim), _expand_rotary(sin, batch, seq, dim)
        half = dim // 2
        block_half = triton.next_power_of_2(half)
        block_t = _block_tokens(2 * block_half, tune.get("block_tokens"))
        n_tokens = batch * seq
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _norm_rope_fwd_kernel[forward_grid(n_tokens, heads, block_t)](
            x, weight, cos, sin, y, n_tokens, seq, heads, eps,
            *_bth_strides(x), *_bt_strides(cos), *_bt_strides(sin),
            D=dim, HALF=half, BLOCK_HALF=block_half, BLOCK_T=block_t, HAS_NORM=has_norm,
            num_warps=tune.get("num_warps", NUM_WARPS),
        )
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps, ctx.tune, ctx.has_norm = eps, tune, has_norm
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, cos, sin = ctx.saved_tensors
        batch, seq, heads, dim = x.shape
        dy = last_dim_contiguous(dy)
        half = dim // 2
        block_half = triton.next_power_of_2(half)
        block_t = _block_tokens(2 * block_half, ctx.tune.get("block_tokens"))
        n_tokens = batch * seq
        programs, tokens_per_program = _backward_split(n_tokens, heads, block_t, ctx.tune.get("programs_per_head"))
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        partial_rows = programs if ctx.has_norm else 0
        partials = torch.empty(partial_rows, heads, dim, dtype=torch.float32, device=x.device)
        _norm_rope_bwd_kernel[(heads, programs)](
            x, weight, cos, sin, dy, dx, partials, n_tokens, seq, ctx.eps, tokens_per_program,
            *_bth_strides(x), *_bt_strides(cos), *_bt_strides(sin), *_bth_strides(dy),
            D=dim, HALF=half, BLOCK_HALF=block_half, BLOCK_T=block_t, HAS_NORM=ctx.has_norm,
            num_warps=ctx.tune.get("num_warps", NUM_WARPS),
        )
        dweight = _reduce_partials(partials, weight.dtype) if ctx.has_norm else None
        return dx, dweight, None, None, None, None


# ---------------------------------------------------------------- branch-norm sum: autograd


class _BranchNormSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, weight_a, b, weight_b, eps_a, eps_b, tune):
        batch, seq, heads, dim = a.shape
        a, weight_a = last_dim_contiguous(a), weight_a.contiguous()
        has_b = b is not None
        if has_b:
            b, weight_b = last_dim_contiguous(b), weight_b.contiguous()
        b_args = (b, weight_b) if has_b else (a, weight_a)  # placeholders the kernel never reads
        block_d = triton.next_power_of_2(dim)
        block_t = _block_tokens(block_d, tune.get("block_tokens"))
        n_tokens = batch * seq
        y = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        _branch_fwd_kernel[forward_grid(n_tokens, heads, block_t)](
            a, weight_a, *b_args, y, n_tokens, seq, heads, eps_a, eps_b,
            *_bth_strides(a), *_bth_strides(b_args[0]),
            HAS_B=has_b, D=dim, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=tune.get("num_warps", NUM_WARPS),
        )
        ctx.save_for_backward(a, weight_a, b, weight_b)
        ctx.eps, ctx.tune = (eps_a, eps_b), tune
        return y

    @staticmethod
    def backward(ctx, dy):
        a, weight_a, b, weight_b = ctx.saved_tensors
        batch, seq, heads, dim = a.shape
        has_b = b is not None
        dy = last_dim_contiguous(dy)
        block_d = triton.next_power_of_2(dim)
        block_t = _block_tokens(block_d, ctx.tune.get("block_tokens"))
        n_tokens = batch * seq
        programs, tokens_per_program = _backward_split(n_tokens, heads, block_t, ctx.tune.get("programs_per_head"))
        da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        dwa_part = torch.empty(programs, heads, dim, dtype=torch.float32, device=a.device)
        db = torch.empty(b.shape, dtype=b.dtype, device=b.device) if has_b else da
        dwb_part = torch.empty_like(dwa_part) if has_b else dwa_part
        b_args = (b, weight_b) if has_b else (a, weight_a)
        _branch_bwd_kernel[(heads, programs)](
            a, weight_a, *b_args, dy, da, db, dwa_part, dwb_part,
            n_tokens, seq, *ctx.eps, tokens_per_program,
            *_bth_strides(a), *_bth_strides(b_args[0]), *_bth_strides(dy),
            HAS_B=has_b, D=dim, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=ctx.tune.get("num_warps", NUM_WARPS),
        )
        dwa = _reduce_partials(dwa_part, weight_a.dtype)
        if not has_b:
            return da, dwa, None, None, None, None, None
        return da, dwa, db, _reduce_partials(dwb_part, weight_b.dtype), None, None, None


# ---------------------------------------------------------------- entry points


def rms_norm_rotary_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    **tune,
) -> torch.Tensor:
    """Triton path of ``hf_hybrid.kernels.fused_norm.rms_norm_rotary`` (inputs already checked).

    Differentiable in x and weight (cos/sin get no gradient). Without RoPE it is the one-branch
    norm kernel. ``tune`` (block_tokens, num_warps, programs_per_head) changes speed, not results
    beyond float32 summation order."""
    if cos_sin is None:
        return _BranchNormSum.apply(x, weight, None, None, float(eps), float(eps), tune)
    cos, sin = cos_sin
    return _RmsNormRotary.apply(x, weight, cos, sin, float(eps), tune)


def rotary_triton(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], **tune) -> torch.Tensor:
    """Triton path of ``hf_hybrid.kernels.fused_norm.rotary`` (inputs already checked): the
    RMSNorm + RoPE kernels without the norm; differentiable in x."""
    cos, sin = cos_sin
    return _RmsNormRotary.apply(x, None, cos, sin, 0.0, tune)


def branch_norm_sum_triton(
    a: torch.Tensor | None,
    weight_a: torch.Tensor | None,
    b: torch.Tensor | None,
    weight_b: torch.Tensor | None,
    eps_a: float,
    eps_b: float,
    **tune,
) -> torch.Tensor:
    """Triton path of ``hf_hybrid.kernels.fused_norm.branch_norm_sum`` (inputs already checked)."""
    if a is None:  # one branch: the kernel's first slot
        a, weight_a, eps_a, b, weight_b = b, weight_b, eps_b, None, None
    return _BranchNormSum.apply(a, weight_a, b, weight_b, float(eps_a), float(eps_b), tune)
