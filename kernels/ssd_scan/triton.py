"""Triton forward / backward of the SSD scan (math: reference.py) and the recurrent decode step.

Chunks of L tokens (the kernels' own L: the result does not depend on it beyond round-off), per
(batch, head); g = within-chunk cumulative log decay ([batch, T, heads], made by step_sizes.py in
one launch, which can also discretise raw step sizes), v_s = dt_s x_s, W_ls = exp(g_l - g_s) for
s <= l (else 0), S_c the state entering chunk c:

  forward
    0. _chunk_scores (one program per (chunk, batch*group)): C B^T, shared by the group's heads
       ([batch, T / L, groups, L, L] float32; the backward's chunk kernel forms its own, faster there)
    1. _states_fwd  (sequential over chunks, one program per (P block, N block, batch*head)):
           S_{c+1} = exp(g_L) S_c + (v * exp(g_L - g))^T B          -> every S_c, and the final state
    2. _output_fwd  (one program per (P block, chunk, batch*head), chunks in parallel):
           y = exp(g) * (C S_c^T) + ((C B^T) * W) v + D x
  backward (the chunk states are kept by a training forward that has room, else recomputed by 1)
    3. _dstates_bwd (reverse over chunks): dS_c (gradient of the state leaving chunk c):
           dS_{c-1} = exp(g_L) dS_c + (dy * exp(g))^T C
    4. _chunk_bwd   (chunks in parallel, whole head_dim per program):
           dv = ((C B^T) * W)^T dy + exp(g_L - g) * (B dS_c^T)       dx = dv dt + D dy
           dC = ((dy v^T) * W) B + exp(g) * (dy S_c)                 (per head, in the input dtype;
                                                                      torch sums the group in float32)
           dB = ((dy v^T) * W)^T C + exp(g_L - g) * (v dS_c)
           dg_l = C_l . dC_l - B_l . dB_l  (+ dS_c . S_{c+1} at the chunk's last row)
           da = reverse cumsum of dg within the chunk     ddt = dv . x + A da
           dA, dD partials = sums over the chunk of da dt and of dy . x
       then torch: dA, dD = sums of the partials.

The dg identity: every term holding C_l carries exp(+g_l), every term holding B_s carries
exp(-g_s), and the exit state carries exp(+g_L). Memory: O(T x heads x (P + N)) plus the chunk
states [batch, T / L + 1, heads, P, N] while a forward or backward runs: float32 in the forward;
in the backward the recomputed states and their gradients are stored in the inputs' dtype (both
kernels carry them in float32 from chunk to chunk, so the rounding does not accumulate) and the
per-head dB / dC parts exist for one slice of about 16 heads at a time.
Dot products run in IEEE float32 for float32 inputs. For 16-bit inputs every dot runs on 16-bit
tensor cores, its float32 operands (decay-weighted scores, dt x, the forward's states, ...) rounded
to the inputs' dtype first, as mamba_ssm's and FLA's kernels do; products of two 16-bit inputs
(C B^T) are exact. NATIVE_16BIT_DOTS = False: TF32 instead, about 1.5x slower
(`python -m hf_hybrid.bench.mamba`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached
from .._backend import triton_interpreting
from .._common import last_dim_contiguous
from .._grid import folded, split_program_id
from .step_sizes import chunk_log_decay

# Chunk length and the P / N block of the state kernels (and the N loop of the chunk kernels).
# 64 / 32 is the fastest at the SE hybrid's mixer shape (`python -m benchmarks.ssd_sweep`); chunks
# of 128 need more shared memory than sm_90 has with 64-wide blocks and are slower with 32.
CHUNK = 64
BLOCK_PN = 32
# num_warps per kernel (states forward, output forward, dstates backward, chunk backward): one
# place for benchmarks/ssd_sweep.py to vary.
WARPS = {"states": 4, "output": 4, "dstates": 4, "chunk_bwd": 4}
# _chunk_bwd's N block (its loops over the state size); one place for benchmarks/mixer_kernels.py to vary.
CHUNK_BWD_BLOCK_N = BLOCK_PN
# Dots whose operands hold 16-bit values exactly run on 16-bit tensor cores (twice TF32's rate
# on Hopper; the same products, float32 accumulation); False: every dot in float32 / TF32.
NATIVE_16BIT_DOTS = True
# _chunk_bwd's slice of heads: the per-head dB / dC parts exist for one slice at a time and take at
# most this many bytes (all 64 heads of the SE hybrid up to 8K tokens, 16 at 32K).
CHUNK_BWD_PARTS_MAX_BYTES = 256 * 2**20
# A training forward keeps the chunk states for the backward up to this size (one layer: 134 MB at
# 8K tokens of the SE hybrid's 1.3B mixer), saving their recomputation; longer sequences recompute.
KEEP_STATES_MAX_BYTES = 256 * 2**20
INTERPRET_CHUNK = 16  # tl.dot needs >= 16; small chunks give the interpreter tests several chunks
INTERPRET_BLOCK_PN = 16


def _sizes() -> tuple[int, int]:
    return (INTERPRET_CHUNK, INTERPRET_BLOCK_PN) if triton_interpreting() else (CHUNK, BLOCK_PN)


def chunk_length() -> int:
    """The kernels' chunk L (what a caller making g with step_sizes passes)."""
    return _sizes()[0]


@triton.jit
def _tile(PTR, b, rows, row_ok, sb, st, head_off, cols, col_ok):
    """float32 [rows, cols] tile of a [batch, T, (heads or groups), dim] tensor at one head/group."""
    return _tile_raw(PTR, b, rows, row_ok, sb, st, head_off, cols, col_ok).to(tl.float32)


@triton.jit
def _tile_raw(PTR, b, rows, row_ok, sb, st, head_off, cols, col_ok):
    """The same tile in the tensor's own dtype (operand of a 16-bit tensor-core dot)."""
    ptrs = PTR + b * sb + rows.to(tl.int64)[:, None] * st + head_off + cols[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _dot_rounded(a, b, like, NATIVE16: tl.constexpr, PREC: tl.constexpr):
    """a @ b with float32 operands: when NATIVE16, rounded to the 16-bit inputs' dtype (``like``'s)
    first and multiplied on 16-bit tensor cores, as mamba_ssm's and FLA's kernels do; else in
    float32 / TF32."""
    if NATIVE16:
        return tl.dot(a.to(like.dtype), b.to(like.dtype))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _chunk_rows(G, DT, b, h, c, T, H, L: tl.constexpr):
    """Rows of chunk c, which exist, their dt (0 past T) and g, and g at the chunk's last row."""
    rows = c * L + tl.arange(0, L)
    row_ok = rows < T
    dt = tl.load(DT + (b * T + rows) * H + h, mask=row_ok, other=0.0)
    g = tl.load(G + (b * tl.cdiv(T, L) * L + rows) * H + h)
    g_last = tl.load(G + (b * tl.cdiv(T, L) * L + c * L + L - 1) * H + h)
    return rows, row_ok, dt, g, g_last


@triton.jit
def _decay_matrix(g, L: tl.constexpr):
    """W[l, s] = exp(g_l - g_s) for s <= l, else 0 (masked before exp)."""
    i = tl.arange(0, L)
    diff = g[:, None] - g[None, :]
    return tl.exp(tl.where(i[:, None] >= i[None, :], diff, float("-inf")))


@launch_cached
@triton.jit
def _chunk_scores(
    Bm, Cm, CB, T, G, NT, sbb, sbt, sbg, scb, sct, scg, N,
    L: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, NATIVE16: tl.constexpr,
):
    # C B^T of one chunk and group, shared by the group's heads (float32 sums of exact products).
    c, bg = split_program_id(NT)
    b, grp = (bg // G).to(tl.int64), bg % G
    rows = c * L + tl.arange(0, L)
    row_ok = rows < T
    scores = tl.zeros((L, L), dtype=tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < N
        Cr = _tile_raw(Cm, b, rows, row_ok, scb, sct, grp * scg, offs_n, n_ok)
        Br = _tile_raw(Bm, b, rows, row_ok, sbb, sbt, grp * sbg, offs_n, n_ok)
        scores += _dot_rounded(Cr, tl.trans(Br), Cr, NATIVE16, PREC)
    tl.store(_scores_tile(CB, b, c, grp, G, NT, L), scores)


@triton.jit
def _scores_tile(CB, b, c, grp, G, NT, L: tl.constexpr):
    """Pointers of chunk c's [L, L] C B^T tile of one group in a [batch, NT, groups, L, L] tensor."""
    i = tl.arange(0, L)
    return CB + ((b * NT + c) * G + grp) * L * L + i[:, None] * L + i[None, :]


@launch_cached
@triton.jit
def _states_fwd(
    X, DT, G, Bm, S, S_COPY, INIT, T, H, P, N, heads_per_group, NT,
    sxb, sxt, sxh, sbb, sbt, sbg,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_INIT: tl.constexpr, HAS_COPY: tl.constexpr,
    PREC: tl.constexpr, NATIVE16: tl.constexpr,
):
    pid_p, bh = split_program_id(tl.cdiv(P, BP))
    pid_n = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    grp = h // heads_per_group
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    p_ok, n_ok = offs_p < P, offs_n < N
    pn = offs_p[:, None] * N + offs_n[None, :]
    pn_ok = p_ok[:, None] & n_ok[None, :]
    if HAS_INIT:
        state = tl.load(INIT + (b * H + h) * P * N + pn, mask=pn_ok, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BP, BN), dtype=tl.float32)
    for c in range(NT):
        tl.store(S + ((b * (NT + 1) + c) * H + h) * P * N + pn, state.to(S.dtype.element_ty), mask=pn_ok)
        if HAS_COPY:  # the backward's copy, in its dtype: what _chunk_states(dtype=...) would recompute
            tl.store(S_COPY + ((b * (NT + 1) + c) * H + h) * P * N + pn, state.to(S_COPY.dtype.element_ty), mask=pn_ok)
        rows, row_ok, dt, g, g_last = _chunk_rows(G, DT, b, h, c, T, H, L)
        x = _tile(X, b, rows, row_ok, sxb, sxt, h * sxh, offs_p, p_ok)
        Br = _tile_raw(Bm, b, rows, row_ok, sbb, sbt, grp * sbg, offs_n, n_ok)
        v = x * (dt * tl.exp(g_last - g))[:, None]
        state = state * tl.exp(g_last) + _dot_rounded(tl.trans(v), Br, Br, NATIVE16, PREC)
    tl.store(S + ((b * (NT + 1) + NT) * H + h) * P * N + pn, state.to(S.dtype.element_ty), mask=pn_ok)
    if HAS_COPY:
        tl.store(S_COPY + ((b * (NT + 1) + NT) * H + h) * P * N + pn, state.to(S_COPY.dtype.element_ty), mask=pn_ok)


@launch_cached
@triton.jit
def _output_fwd(
    X, DT, G, CB, Cm, S, Dv, Y, T, H, P, N, heads_per_group, NT,
    sxb, sxt, sxh, scb, sct, scg,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr,
    NATIVE16: tl.constexpr,
):
    pid_p, chunk_row = split_program_id(tl.cdiv(P, BP))
    c, bh = chunk_row % NT, chunk_row // NT
    b, h = (bh // H).to(tl.int64), bh % H
    grp = h // heads_per_group
    offs_p = pid_p * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    rows, row_ok, dt, g, g_last = _chunk_rows(G, DT, b, h, c, T, H, L)
    x_raw = _tile_raw(X, b, rows, row_ok, sxb, sxt, h * sxh, offs_p, p_ok)
    x = x_raw.to(tl.float32)
    scores = tl.load(_scores_tile(CB, b, c, grp, H // heads_per_group, NT, L))
    from_state = tl.zeros((L, BP), dtype=tl.float32)
    s_base = S + ((b * (NT + 1) + c) * H + h) * P * N
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < N
        Cr = _tile_raw(Cm, b, rows, row_ok, scb, sct, grp * scg, offs_n, n_ok)
        Sb = tl.load(s_base + offs_p[:, None] * N + offs_n[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        from_state += _dot_rounded(Cr, tl.trans(Sb), Cr, NATIVE16, PREC)
    weights = scores * _decay_matrix(g, L) * dt[None, :]
    y = from_state * tl.exp(g)[:, None] + _dot_rounded(weights, x_raw, x_raw, NATIVE16, PREC)
    if HAS_D:
        y += tl.load(Dv + h).to(tl.float32) * x
    yptrs = Y + ((b * T + rows.to(tl.int64)) * H + h)[:, None] * P + offs_p[None, :]
    tl.store(yptrs, y.to(Y.dtype.element_ty), mask=row_ok[:, None] & p_ok[None, :])


@launch_cached
@triton.jit
def _dstates_bwd(
    DY, DT, G, Cm, DS, DFINAL, DINIT, T, H, P, N, heads_per_group, NT,
    sdb, sdt, sdh, scb, sct, scg,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_DFINAL: tl.constexpr, PREC: tl.constexpr,
    NATIVE16: tl.constexpr,
):
    pid_p, bh = split_program_id(tl.cdiv(P, BP))
    pid_n = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    grp = h // heads_per_group
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    p_ok, n_ok = offs_p < P, offs_n < N
    pn = offs_p[:, None] * N + offs_n[None, :]
    pn_ok = p_ok[:, None] & n_ok[None, :]
    if HAS_DFINAL:
        dstate = tl.load(DFINAL + (b * H + h) * P * N + pn, mask=pn_ok, other=0.0).to(tl.float32)
    else:
        dstate = tl.zeros((BP, BN), dtype=tl.float32)
    for i in range(NT):
        c = NT - 1 - i
        tl.store(DS + ((b * NT + c) * H + h) * P * N + pn, dstate.to(DS.dtype.element_ty), mask=pn_ok)
        rows, row_ok, dt, g, g_last = _chunk_rows(G, DT, b, h, c, T, H, L)
        dy_raw = _tile_raw(DY, b, rows, row_ok, sdb, sdt, h * sdh, offs_p, p_ok)
        Cr = _tile_raw(Cm, b, rows, row_ok, scb, sct, grp * scg, offs_n, n_ok)
        dy = dy_raw.to(tl.float32) * tl.exp(g)[:, None]
        dstate = dstate * tl.exp(g_last) + _dot_rounded(tl.trans(dy), Cr, dy_raw, NATIVE16, PREC)
    tl.store(DINIT + (b * H + h) * P * N + pn, dstate, mask=pn_ok)


@launch_cached
@triton.jit
def _chunk_bwd(
    X, DT, G, A, Bm, Cm, S, DS, Dv, DY, DX, DDT, DAP, DBH, DCH, DDP, T, H, H0, HS, P, N, heads_per_group, NT,
    sxb, sxt, sxh, sbb, sbt, sbg, scb, sct, scg, sdb, sdt, sdh, sob, sot, soh,
    L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr,
    NATIVE16: tl.constexpr,
):
    # Heads H0 .. H0 + HS - 1 (one launch per slice of heads); DBH / DCH hold that slice only.
    c, bh = split_program_id(NT)
    b, h_in = (bh // HS).to(tl.int64), bh % HS
    h = H0 + h_in
    grp = h // heads_per_group
    offs_p = tl.arange(0, BP)
    p_ok = offs_p < P
    rows, row_ok, dt, g, g_last = _chunk_rows(G, DT, b, h, c, T, H, L)
    x = _tile(X, b, rows, row_ok, sxb, sxt, h * sxh, offs_p, p_ok)
    dy_raw = _tile_raw(DY, b, rows, row_ok, sdb, sdt, h * sdh, offs_p, p_ok)
    dy = dy_raw.to(tl.float32)
    v = x * dt[:, None]
    to_end = tl.exp(g_last - g)
    s_base = S + ((b * (NT + 1) + c) * H + h) * P * N
    ds_base = DS + ((b * NT + c) * H + h) * P * N
    scores = tl.zeros((L, L), dtype=tl.float32)
    dv = tl.zeros((L, BP), dtype=tl.float32)
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < N
        Cr = _tile_raw(Cm, b, rows, row_ok, scb, sct, grp * scg, offs_n, n_ok)
        Br = _tile_raw(Bm, b, rows, row_ok, sbb, sbt, grp * sbg, offs_n, n_ok)
        dSr = tl.load(ds_base + offs_p[:, None] * N + offs_n[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        scores += _dot_rounded(Cr, tl.trans(Br), Cr, NATIVE16, PREC)
        dv += _dot_rounded(Br, tl.trans(dSr), Br, NATIVE16, PREC)  # dS is stored in the inputs' dtype
    decay = _decay_matrix(g, L)
    dv = dv * to_end[:, None] + _dot_rounded(tl.trans(scores * decay), dy_raw, dy_raw, NATIVE16, PREC)
    dx = dv * dt[:, None]
    if HAS_D:
        dx += tl.load(Dv + h).to(tl.float32) * dy
        tl.store(DDP + (b * NT + c) * H + h, tl.sum(tl.sum(dy * x, axis=1), axis=0))  # this chunk's part of dD
    dx_rows = b * sob + rows.to(tl.int64) * sot + h * soh
    tl.store(DX + dx_rows[:, None] + offs_p[None, :], dx.to(DX.dtype.element_ty), mask=row_ok[:, None] & p_ok[None, :])
    dpw = _dot_rounded(dy_raw, tl.trans(v), dy_raw, NATIVE16, PREC) * decay
    tok_slice = (b * T + rows.to(tl.int64)) * HS + h_in
    dg = tl.zeros((L,), dtype=tl.float32)
    exit_term = 0.0  # dS_c . S_{c+1}
    snext_base = s_base + H * P * N  # S_{c+1}: the state leaving this chunk
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < N
        pn_mask = p_ok[:, None] & n_ok[None, :]
        Cb = _tile(Cm, b, rows, row_ok, scb, sct, grp * scg, offs_n, n_ok)
        Bb = _tile(Bm, b, rows, row_ok, sbb, sbt, grp * sbg, offs_n, n_ok)
        Sr = tl.load(s_base + offs_p[:, None] * N + offs_n[None, :], mask=pn_mask, other=0.0)
        dSr = tl.load(ds_base + offs_p[:, None] * N + offs_n[None, :], mask=pn_mask, other=0.0)
        dSb = dSr.to(tl.float32)
        Snext = tl.load(snext_base + offs_p[:, None] * N + offs_n[None, :], mask=pn_mask, other=0.0).to(tl.float32)
        exit_term += tl.sum(tl.sum(dSb * Snext, axis=1), axis=0)
        dC = (_dot_rounded(dpw, Bb, dy_raw, NATIVE16, PREC)
              + _dot_rounded(dy_raw, Sr, dy_raw, NATIVE16, PREC) * tl.exp(g)[:, None])
        dB = (_dot_rounded(tl.trans(dpw), Cb, dy_raw, NATIVE16, PREC)
              + _dot_rounded(v, dSr, dy_raw, NATIVE16, PREC) * to_end[:, None])
        out_mask = row_ok[:, None] & n_ok[None, :]
        tl.store(DCH + tok_slice[:, None] * N + offs_n[None, :], dC.to(DCH.dtype.element_ty), mask=out_mask)
        tl.store(DBH + tok_slice[:, None] * N + offs_n[None, :], dB.to(DBH.dtype.element_ty), mask=out_mask)
        dg += tl.sum(Cb * dC, axis=1) - tl.sum(Bb * dB, axis=1)
    # The exit state carries exp(+g) at the chunk's last row.
    dg += tl.where(tl.arange(0, L) == L - 1, exit_term, 0.0)
    # g_l sums dt_s * A over s <= l in the chunk: da_s = sum of dg_l over l >= s.
    da = tl.cumsum(dg, 0, reverse=True)
    a = tl.load(A + h).to(tl.float32)
    tl.store(DDT + (b * T + rows.to(tl.int64)) * H + h, tl.sum(dv * x, axis=1) + a * da, mask=row_ok)
    tl.store(DAP + (b * NT + c) * H + h, tl.sum(da * dt, axis=0))  # this chunk's part of dA (dt is 0 past T)


def _heads_per_launch(heads: int, per_group: int, bytes_per_head: int) -> int:
    """Heads per _chunk_bwd launch: as many as CHUNK_BWD_PARTS_MAX_BYTES holds (at least one),
    dividing a group or made of whole groups."""
    target = max(1, CHUNK_BWD_PARTS_MAX_BYTES // max(1, bytes_per_head))
    if per_group >= target:
        return max(d for d in range(1, target + 1) if per_group % d == 0)
    whole = max(1, target // per_group)
    while (heads // per_group) % whole:
        whole -= 1
    return per_group * whole


def _native16(*tensors: torch.Tensor) -> bool:
    """Whether the dots of 16-bit operands (inputs, and the backward's states stored in the inputs'
    dtype) run on 16-bit tensor cores: all one 16-bit dtype (NATIVE_16BIT_DOTS switches it off)."""
    dtypes = {t.dtype for t in tensors}
    # Triton's interpreter multiplies 16-bit tiles wrongly (numpy has no bfloat16): the CPU tests
    # run the float32 dots; the GPU tests check these.
    return NATIVE_16BIT_DOTS and not triton_interpreting() and len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}


def _precision(*tensors: torch.Tensor) -> str:
    return "ieee" if all(t.dtype == torch.float32 for t in tensors) else "tf32"


def state_grid(batch: int, heads: int, head_dim: int, state_size: int, block: int) -> tuple[int, int]:
    """(batch x head x head_dim block, state block) of the state passes, head_dim blocks fastest:
    batch x heads passes the limit of grid axes 1 and 2 (65,535) at large batch."""
    return folded(triton.cdiv(head_dim, block), batch * heads, triton.cdiv(state_size, block))


def output_grid(batch: int, heads: int, head_dim: int, n_chunks: int, block: int) -> tuple[int]:
    """(batch x head, chunk, head_dim block) on one axis, head_dim blocks fastest, then chunks."""
    return folded(triton.cdiv(head_dim, block), n_chunks * batch * heads)


def _chunk_states(x, dt, g, B, initial_state, chunk, block, dtype=torch.float32, copy_dtype=None):
    """Every chunk's entering state (and the final one), carried in float32, stored as ``dtype``;
    with ``copy_dtype``, (states, a second copy stored as copy_dtype: the states themselves when
    the dtypes agree)."""
    batch, seq, heads, head_dim = x.shape
    state_size = B.shape[-1]
    n_chunks = g.shape[1] // chunk
    shape = (batch, n_chunks + 1, heads, head_dim, state_size)
    states = torch.empty(shape, dtype=dtype, device=x.device)
    copy = torch.empty(shape, dtype=copy_dtype, device=x.device) if copy_dtype not in (None, dtype) else None
    init = initial_state.float().contiguous() if initial_state is not None else states
    grid = state_grid(batch, heads, head_dim, state_size, block)
    _states_fwd[grid](
        x, dt, g, B, states, copy if copy is not None else states, init, seq, heads, head_dim, state_size,
        heads // B.shape[2], n_chunks, x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
        L=chunk, BP=block, BN=block, HAS_INIT=initial_state is not None, HAS_COPY=copy is not None,
        PREC=_precision(x, B), NATIVE16=_native16(x, B), num_warps=WARPS["states"],
    )
    if copy_dtype is None:
        return states
    return states, (states if copy is None else copy)


def _chunk_scores_of(B, C, n_chunks, chunk, block, prec, native16) -> torch.Tensor:
    """C B^T per chunk and group, [batch, n_chunks, groups, chunk, chunk] float32 (2 MB a group at
    8K tokens): the heads of a group share it, so _output_fwd reads it instead of each of its
    programs forming it (64 heads x 2 head_dim blocks at the SE hybrid's shape). _chunk_bwd forms
    its own: reading it there was slower (docs/benchmarks/se_hybrid.md)."""
    batch, seq, groups, state_size = B.shape
    scores = torch.empty((batch, n_chunks, groups, chunk, chunk), dtype=torch.float32, device=B.device)
    _chunk_scores[folded(n_chunks, batch * groups)](
        B, C, scores, seq, groups, n_chunks, B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        state_size, L=chunk, BN=block, PREC=prec, NATIVE16=native16,
    )
    return scores


def keeps_states(x: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether a forward that the backward will follow keeps the chunk states for it (in x's dtype)
    instead of the backward recomputing them: when they take at most KEEP_STATES_MAX_BYTES."""
    return states_fit(*x.shape, B.shape[-1], x.element_size())


def states_fit(batch: int, seq: int, heads: int, head_dim: int, state_size: int, element_size: int) -> bool:
    """keeps_states from the sizes."""
    n_chunks = triton.cdiv(seq, _sizes()[0])
    return batch * (n_chunks + 1) * heads * head_dim * state_size * element_size <= KEEP_STATES_MAX_BYTES


def ssd_scan_forward(x, dt, A, B, C, D, initial_state, keep_states, g=None):
    """(y, final state float32, the chunk states kept for the backward or an empty tensor) of the
    Triton scan; dt discretised, float32. ``g``: the chunks' log decay of dt when the caller has it
    (step_sizes.discretized_step_sizes), else made here."""
    chunk, block = _sizes()
    x, B, C = (last_dim_contiguous(t) for t in (x, B, C))
    dt = dt.float().contiguous()
    batch, seq, heads, head_dim = x.shape
    state_size = B.shape[-1]
    if g is None:
        g = chunk_log_decay(dt, A, chunk)
    n_chunks = g.shape[1] // chunk
    kept = x.new_empty(0)
    if keep_states:
        states, kept = _chunk_states(x, dt, g, B, initial_state, chunk, block, copy_dtype=x.dtype)
    else:
        states = _chunk_states(x, dt, g, B, initial_state, chunk, block)
    y = torch.empty((batch, seq, heads, head_dim), dtype=x.dtype, device=x.device)
    grid = output_grid(batch, heads, head_dim, n_chunks, block)
    prec, native16 = _precision(x, B, C), _native16(x, B, C)
    scores = _chunk_scores_of(B, C, n_chunks, chunk, block, prec, native16)
    _output_fwd[grid](
        x, dt, g, scores, C, states, D if D is not None else dt, y, seq, heads, head_dim, state_size,
        heads // B.shape[2], n_chunks, x.stride(0), x.stride(1), x.stride(2), C.stride(0), C.stride(1), C.stride(2),
        L=chunk, BP=block, BN=block, HAS_D=D is not None, PREC=prec, NATIVE16=native16, num_warps=WARPS["output"],
    )
    return y, states[:, -1].clone(), kept


class _SSDScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, initial_state, keep_states=False):
        x, B, C = (last_dim_contiguous(t) for t in (x, B, C))
        dt = dt.float().contiguous()
        y, final_state, kept = ssd_scan_forward(x, dt, A, B, C, D, initial_state, keep_states)
        ctx.save_for_backward(x, dt, A, B, C, D, initial_state, kept)
        return y, final_state, kept

    @staticmethod
    def backward(ctx, dy, dfinal, dkept=None):
        return (*ssd_scan_backward(*ctx.saved_tensors, dy, dfinal), None)


def ssd_scan_backward(x, dt, A, B, C, D, initial_state, kept, dy, dfinal, dx=None, dB=None, dC=None, g=None):
    """(dx, ddt float32, dA, dB, dC, dD, d initial_state) of the Triton scan; dt discretised, float32.
    ``kept``: the forward's chunk states, or an empty tensor (recomputed here). ``dx``, ``dB``,
    ``dC``: buffers shaped like x, B, C (strided views with a contiguous last dim, slices of the
    conv output's gradient) to write those gradients into, else new ones. ``g``: as in
    :func:`ssd_scan_forward`."""
    chunk, block = _sizes()
    dy = last_dim_contiguous(dy)
    batch, seq, heads, head_dim = x.shape
    groups, state_size = B.shape[-2:]
    for name, out, like in (("dx", dx, x), ("dB", dB, B), ("dC", dC, C)):
        if out is not None and (out.shape != like.shape or out.dtype != like.dtype or out.stride(-1) != 1):
            raise ValueError(f"ssd_scan_backward: {name} must be {tuple(like.shape)} {like.dtype} with a contiguous last dim.")
    if g is None:
        g = chunk_log_decay(dt, A, chunk)
    n_chunks = g.shape[1] // chunk
    # Kept by the forward (keeps_states; never empty then), or recomputed; in the inputs' dtype (float32 at T = 32K:
    # 1 GiB), read by _chunk_bwd only.
    states = kept if kept.numel() else _chunk_states(x, dt, g, B, initial_state, chunk, block, dtype=x.dtype)
    prec = _precision(x, B, C)
    f32 = dict(dtype=torch.float32, device=x.device)
    # The gradients of the chunk states, stored in the inputs' dtype (carried in float32 inside
    # the kernel): as float32 at T = 32K, 64 heads and 64-token chunks they took 1 GiB.
    dstates = torch.empty((batch, n_chunks, heads, head_dim, state_size), dtype=x.dtype, device=x.device)
    dinit = torch.empty((batch, heads, head_dim, state_size), **f32)
    dfinal = dfinal.float().contiguous() if dfinal is not None else None
    _dstates_bwd[state_grid(batch, heads, head_dim, state_size, block)](
        dy, dt, g, C, dstates, dfinal if dfinal is not None else dinit, dinit, seq, heads, head_dim, state_size,
        heads // groups, n_chunks, dy.stride(0), dy.stride(1), dy.stride(2), C.stride(0), C.stride(1), C.stride(2),
        L=chunk, BP=block, BN=block, HAS_DFINAL=dfinal is not None, PREC=prec, NATIVE16=_native16(dy, C),
        num_warps=WARPS["dstates"],
    )
    if dx is None:
        dx = torch.empty((batch, seq, heads, head_dim), dtype=x.dtype, device=x.device)
    ddt = torch.empty((batch, seq, heads), **f32)
    dA_parts = torch.empty((batch, n_chunks, heads), **f32)
    dD_parts = torch.empty((batch, n_chunks, heads), **f32) if D is not None else ddt
    # Per-head parts of dB / dC, summed over each group's heads in float32: all heads in one
    # launch where they fit CHUNK_BWD_PARTS_MAX_BYTES, else one slice of heads per launch into
    # float32 accumulators (for all 64 heads at T = 32K they were 1 GiB in bf16, alive at the
    # backward's peak).
    per_group = heads // groups
    block_n = block if triton_interpreting() else CHUNK_BWD_BLOCK_N  # the interpreter keeps its small test block
    slice_heads = _heads_per_launch(heads, per_group, 2 * batch * seq * state_size * B.element_size())
    whole = slice_heads == heads  # one launch: its parts reduce straight into dB / dC
    if not whole:
        dB_sum = torch.zeros((batch, seq, groups, state_size), **f32)
        dC_sum = torch.zeros((batch, seq, groups, state_size), **f32)
    dBh = torch.empty((batch, seq, slice_heads, state_size), dtype=B.dtype, device=x.device)
    dCh = torch.empty_like(dBh)
    for h0 in range(0, heads, slice_heads):
        _chunk_bwd[folded(n_chunks, batch * slice_heads)](
            x, dt, g, A, B, C, states, dstates, D if D is not None else dt, dy, dx, ddt, dA_parts, dBh, dCh, dD_parts,
            seq, heads, h0, slice_heads, head_dim, state_size, per_group, n_chunks,
            x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
            C.stride(0), C.stride(1), C.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
            dx.stride(0), dx.stride(1), dx.stride(2),
            L=chunk, BP=max(16, triton.next_power_of_2(head_dim)), BN=block_n, HAS_D=D is not None, PREC=prec,
            NATIVE16=_native16(x, B, C, dy),
            num_warps=WARPS["chunk_bwd"],
        )
        if whole:
            dB_sum = dBh.view(batch, seq, groups, per_group, state_size).sum(3, dtype=torch.float32)
            dC_sum = dCh.view(batch, seq, groups, per_group, state_size).sum(3, dtype=torch.float32)
            break
        g0, g1 = h0 // per_group, (h0 + slice_heads - 1) // per_group + 1
        in_group = min(slice_heads, per_group)
        dB_sum[:, :, g0:g1] += dBh.view(batch, seq, g1 - g0, in_group, state_size).sum(3, dtype=torch.float32)
        dC_sum[:, :, g0:g1] += dCh.view(batch, seq, g1 - g0, in_group, state_size).sum(3, dtype=torch.float32)
    del dBh, dCh, states, dstates
    dA = dA_parts.sum((0, 1)).to(A.dtype)
    dB = dB_sum.to(B.dtype) if dB is None else dB.copy_(dB_sum)
    dC = dC_sum.to(C.dtype) if dC is None else dC.copy_(dC_sum)
    dD = dD_parts.sum((0, 1)).to(D.dtype) if D is not None else None
    dinit = dinit.to(initial_state.dtype) if initial_state is not None else None
    return dx, ddt, dA, dB, dC, dD, dinit


def ssd_scan_triton(x, dt, A, B, C, D, initial_state, return_final_state):
    y, final_state, _ = _SSDScan.apply(x, dt, A, B, C, D, initial_state, torch.is_grad_enabled() and keeps_states(x, B))
    return (y, final_state) if return_final_state else y


@launch_cached
@triton.jit
def _step(
    STATE, X, DT, A, Bm, Cm, Dv, DT_BIAS, Y, H, P, N, heads_per_group,
    sxb, sxh, sdtb, sbb, sbg, scb, scg, syb, syh, dt_min, dt_max,
    BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
):
    bh, pid_p = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    grp = h // heads_per_group
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    p_ok, n_ok = offs_p < P, offs_n < N
    dt = tl.load(DT + b * sdtb + h).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(DT_BIAS + h).to(tl.float32)
    if SOFTPLUS:  # torch's softplus (threshold 20)
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    x = tl.load(X + b * sxb + h * sxh + offs_p, mask=p_ok, other=0.0).to(tl.float32)
    Bv = tl.load(Bm + b * sbb + grp * sbg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    Cv = tl.load(Cm + b * scb + grp * scg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    sptrs = STATE + ((b * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]
    smask = p_ok[:, None] & n_ok[None, :]
    state = tl.load(sptrs, mask=smask, other=0.0)
    state = state * tl.exp(dt * tl.load(A + h).to(tl.float32)) + (dt * x)[:, None] * Bv[None, :]
    tl.store(sptrs, state, mask=smask)
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(Dv + h).to(tl.float32) * x
    tl.store(Y + b * syb + h * syh + offs_p, y.to(Y.dtype.element_ty), mask=p_ok)


def ssd_step_triton(state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, out):
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[-2:]
    x, B, C, dt = (last_dim_contiguous(t) for t in (x, B, C, dt))
    if out is None:
        out = torch.empty_like(x)
    if not state.is_contiguous():
        raise ValueError("ssd_step: the Triton step updates state in place and needs it contiguous.")
    block_n = max(16, triton.next_power_of_2(state_size))
    block_p = max(1, min(triton.next_power_of_2(head_dim), 4096 // block_n))
    _step[(batch * heads, triton.cdiv(head_dim, block_p))](
        state, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, out,
        heads, head_dim, state_size, heads // groups,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        out.stride(0), out.stride(1), float(dt_limit[0]), float(dt_limit[1]),
        BP=block_p, BN=block_n, HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
    )
    return out
