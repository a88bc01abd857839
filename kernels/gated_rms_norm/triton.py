"""Triton forward and backward of the gated RMSNorm (math: see reference.py).

A row is one (token, group) vector of group_size features. A program owns one group and a block
of BLOCK_T tokens (all leading axes flattened), keeps the [BLOCK_T, BLOCK_D] tile in float32
registers, and reads y and z once and writes the output once, instead of PyTorch's chain of
float32 temporaries (cast, silu, product, square, mean, rsqrt, scale, cast, weight product).

The forward rounds h * r to y's dtype before the weight product, as BambaRMSNormGated does, so a
bf16 model sees the same numbers. The backward recomputes s, h and r from y and z (they are read
anyway) instead of saving them. The weight gradient needs no atomics: a backward program walks a
fixed range of tokens for its group, accumulates dout * nh in registers and writes one partial row;
torch sums the few partials afterwards (deterministic).

Group is the fastest-varying part of the (flat) forward program index, so programs running
together read neighbouring groups of the same tokens; the index is flat because token blocks
outnumber a second grid axis's limit of 65535 at prefill sizes (8 x 16K tokens). y, z and dout
may be strided views (z is a slice of the input projection's output) as long as the last dimension
is contiguous: they are read through their row strides, not copied.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._backend import triton_interpreting
from ..._compat.triton_launch import launch_cached

MAX_GROUP_SIZE = 8192  # one row of each operand must fit in registers
# Forward rows per program: short groups share a program until the tile holds this many elements.
TILE_ELEMENTS = 2048
# Backward programs (all groups together): ~32 resident warps per SM of a 132-SM GPU, each program
# looping over its range of tokens: fewer programs leave the SMs short of loads in flight, more
# write and reduce more partial sums.
BACKWARD_WARPS_IN_FLIGHT = 132 * 32
# The CPU interpreter runs tiny shapes: tiny blocks and two programs per group make the tests cover
# several token blocks per program, ragged ends and more than one partial sum per group.
INTERPRET_BLOCK_T = 2
INTERPRET_PROGRAMS_PER_GROUP = 2


# ---------------------------------------------------------------- kernel helpers


@triton.jit
def _row_offsets(tokens, T, stride_b, stride_t, features):
    """Offsets of a [BLOCK_T, BLOCK_D] tile of a [outer, T, D_total] view at the given features."""
    tok = tokens.to(tl.int64)
    return ((tok // T) * stride_b + (tok % T) * stride_t)[:, None] + features[None, :]


@triton.jit
def _load_rows(ptr, tokens, T, stride_b, stride_t, features, mask):
    """float32 [BLOCK_T, BLOCK_D] tile of a [outer, T, D_total] view at the given features."""
    return tl.load(ptr + _row_offsets(tokens, T, stride_b, stride_t, features), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _output_offsets(tokens, features, D_TOTAL: tl.constexpr):
    """Offsets into a contiguous [tokens, D_total] output."""
    return tokens.to(tl.int64)[:, None] * D_TOTAL + features[None, :]


@triton.jit
def _inv_rms(h, rows_ok, GROUP: tl.constexpr, eps):
    # Rows past the end read zeros; with eps = 0 their rsqrt would be inf and poison the weight
    # gradient through 0 * inf, so they take rsqrt(1) (their h is 0, so h * r stays 0).
    mean_sq = tl.sum(h * h, 1) / GROUP
    return tl.rsqrt(tl.where(rows_ok, mean_sq + eps, 1.0))[:, None]


@triton.jit
def _token_block(start, limit, col_ok, BLOCK_T: tl.constexpr):
    """Tokens start .. start + BLOCK_T - 1, which of them exist (< limit), and the tile mask."""
    tokens = start + tl.arange(0, BLOCK_T)
    rows_ok = tokens < limit
    return tokens, rows_ok, rows_ok[:, None] & col_ok[None, :]


# ---------------------------------------------------------------- kernels


@launch_cached
@triton.jit
def _fwd_kernel(
    Y, Z, W, OUT,
    n_tokens, T, eps,
    sy_b, sy_t, sz_b, sz_t,
    GROUP: tl.constexpr, D_TOTAL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < GROUP
    pid = tl.program_id(0).to(tl.int64)
    groups: tl.constexpr = D_TOTAL // GROUP
    features = (pid % groups) * GROUP + cols
    tokens, rows_ok, mask = _token_block((pid // groups) * BLOCK_T, n_tokens, col_ok, BLOCK_T)

    y = _load_rows(Y, tokens, T, sy_b, sy_t, features, mask)
    z = _load_rows(Z, tokens, T, sz_b, sz_t, features, mask)
    h = y * (z * tl.sigmoid(z))
    r = _inv_rms(h, rows_ok, GROUP, eps)
    normed = (h * r).to(Y.dtype.element_ty).to(tl.float32)  # BambaRMSNormGated rounds here
    w = tl.load(W + features, mask=col_ok, other=0.0).to(tl.float32)
    out = w[None, :] * normed
    tl.store(OUT + _output_offsets(tokens, features, D_TOTAL), out.to(OUT.dtype.element_ty), mask=mask)


@launch_cached
@triton.jit
def _bwd_kernel(
    Y, Z, W, DOUT, DY, DZ, DW_PART,
    n_tokens, T, eps, tokens_per_program,
    sy_b, sy_t, sz_b, sz_t, sd_b, sd_t, sdz_b, sdz_t,
    GROUP: tl.constexpr, D_TOTAL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < GROUP
    features = tl.program_id(0) * GROUP + cols
    dw = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    first = part * tokens_per_program
    last = tl.minimum(first + tokens_per_program, n_tokens)
    for start in range(first, last, BLOCK_T):
        tokens, rows_ok, mask = _token_block(start, last, col_ok, BLOCK_T)
        # Few full-row tiles live at once (an 8192-feature row must stay in registers): z and
        # sigmoid(z) fold into s = silu(z) and dz_scale = y * silu'(z) before the reductions.
        z = _load_rows(Z, tokens, T, sz_b, sz_t, features, mask)
        y = _load_rows(Y, tokens, T, sy_b, sy_t, features, mask)
        sig = tl.sigmoid(z)
        s = z * sig
        dz_scale = y * sig * (1.0 + z * (1.0 - sig))
        h = y * s
        r = _inv_rms(h, rows_ok, GROUP, eps)
        nh = h * r
        dout = _load_rows(DOUT, tokens, T, sd_b, sd_t, features, mask)
        dw += dout * nh
        g = dout * tl.load(W + features, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dh = r * (g - nh * (tl.sum(g * nh, 1) / GROUP)[:, None])
        tl.store(DY + _output_offsets(tokens, features, D_TOTAL), (dh * s).to(DY.dtype.element_ty), mask=mask)
        tl.store(DZ + _row_offsets(tokens, T, sdz_b, sdz_t, features), (dh * dz_scale).to(DZ.dtype.element_ty), mask=mask)
    tl.store(DW_PART + part.to(tl.int64) * D_TOTAL + features, tl.sum(dw, 0), mask=col_ok)


# ---------------------------------------------------------------- launch helpers


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D_total] as a [outer, inner, D_total] view (inner = the axis before the features):
    two row strides cover a slice of a wider projection output and a transposed [B, T] layout
    without a copy. Copies only a non-contiguous feature axis, or leading axes that do not merge."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    inner = t.shape[-2] if t.dim() > 1 else 1
    return t.reshape(math.prod(t.shape[:-2]), inner, t.shape[-1])


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1)


def _tile(group_size: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_T): a whole group per row; short groups stack rows up to ~TILE_ELEMENTS."""
    block_d = triton.next_power_of_2(group_size)
    return block_d, INTERPRET_BLOCK_T if triton_interpreting() else max(1, TILE_ELEMENTS // block_d)


def _forward_warps(tile_elements: int) -> int:
    """Few elements per thread and operand: close to the fastest of 4, 8, 16 warps at every width."""
    return 16 if tile_elements >= 8192 else 8 if tile_elements >= 2048 else 4


def _backward_warps(tile_elements: int) -> int:
    """The backward holds several row tiles at once (sm_90 compile, 16-byte-aligned pointers and
    strides: a 4096 row takes 127 registers a thread at 8 warps, 77 at 16; an 8192 row 128 at 16;
    none spilled); 16 warps are faster than 8 for 4096- and 8192-wide rows, 4 for [4, 512] tiles."""
    return 16 if tile_elements >= 4096 else 4


def _backward_split(n_tokens: int, groups: int, block_t: int, num_warps: int) -> tuple[int, int]:
    """(programs per group, tokens per program); a program's range is a whole number of blocks."""
    n_blocks = triton.cdiv(n_tokens, block_t)
    if triton_interpreting():
        programs = INTERPRET_PROGRAMS_PER_GROUP
    else:
        programs = triton.cdiv(triton.cdiv(BACKWARD_WARPS_IN_FLIGHT, num_warps), groups)
    blocks_per_program = triton.cdiv(n_blocks, max(1, min(programs, n_blocks)))
    return triton.cdiv(n_blocks, blocks_per_program), blocks_per_program * block_t


# ---------------------------------------------------------------- entry points (inputs already checked)


def gated_rms_norm_forward(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """BambaRMSNormGated's output, contiguous, in torch.result_type(weight, y)."""
    d_total = y.shape[-1]
    y_rows, z_rows = _token_rows(y), _token_rows(z)
    n_tokens, seq = y_rows.shape[0] * y_rows.shape[1], y_rows.shape[1]
    block_d, block_t = _tile(group_size)
    out = torch.empty(y.shape, dtype=torch.result_type(weight, y), device=y.device)
    grid = (d_total // group_size * triton.cdiv(n_tokens, block_t),)
    _fwd_kernel[grid](
        y_rows, z_rows, weight.contiguous(), out, n_tokens, seq, eps,
        *_row_strides(y_rows), *_row_strides(z_rows),
        GROUP=group_size, D_TOTAL=d_total, BLOCK_D=block_d, BLOCK_T=block_t,
        num_warps=_forward_warps(block_d * block_t),
    )
    return out


def gated_rms_norm_backward(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, dout: torch.Tensor, group_size: int, eps: float,
    dz: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, dz, dweight) for the output gradient dout, in the dtypes of y, z and weight. ``dz``: a
    buffer shaped like z to write dz into (a slice of the whole input projection's gradient, with
    its row strides), else a new one."""
    d_total = y.shape[-1]
    groups = d_total // group_size
    y_rows, z_rows, dout_rows = _token_rows(y), _token_rows(z), _token_rows(dout)
    n_tokens, seq = y_rows.shape[0] * y_rows.shape[1], y_rows.shape[1]
    block_d, block_t = _tile(group_size)
    num_warps = _backward_warps(block_d * block_t)
    programs, tokens_per_program = _backward_split(n_tokens, groups, block_t, num_warps)
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if dz is None:
        dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    elif dz.shape != z.shape or dz.dtype != z.dtype or dz.stride(-1) != 1:
        raise ValueError(f"gated_rms_norm_backward: dz must be {tuple(z.shape)} {z.dtype} with a contiguous last dim.")
    dz_rows = _token_rows(dz)
    if dz_rows.data_ptr() != dz.data_ptr():
        raise ValueError("gated_rms_norm_backward: dz's leading axes must merge into one (a copy would not be written back).")
    partials = torch.empty(programs, d_total, dtype=torch.float32, device=y.device)
    _bwd_kernel[(groups, programs)](
        y_rows, z_rows, weight.contiguous(), dout_rows, dy, dz_rows, partials,
        n_tokens, seq, eps, tokens_per_program,
        *_row_strides(y_rows), *_row_strides(z_rows), *_row_strides(dout_rows), *_row_strides(dz_rows),
        GROUP=group_size, D_TOTAL=d_total, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=num_warps,
    )
    return dy, dz, partials.sum(0).to(weight.dtype)
