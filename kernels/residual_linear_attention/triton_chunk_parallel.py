"""Triton RLA with every chunk's state stored: outputs and gradients in parallel over chunks.

Same function as ``reference.residual_linear_attention_reference`` and as the segment kernels of
``triton.py`` (whose notation this follows: lag L = w + 1, chunk c of C tokens, S_c the state before
chunk c, phi = [phi+, phi-] in two feature halves). Where those kernels keep a [D, BV] block of the
state in registers and walk it through a segment, so that each program sees one feature half and
leaves partial sums (float32 atomics, a zeroed buffer, a conversion), this path splits the work in two:

* Light sequential walks. From the stored segment states (``triton.segment_states``: the same
  state pass and prefix sum as the segment kernels), one program per (half, value block, kv head, segment) walks its chunks and
  stores S_c in the operand dtype, the rounding the segment kernels apply before every product
  anyway. The backward walks the adjoint G_c = dS_final + sum over the queries after chunk c of
  phi(q)^T dO the same way, in reverse, from ``triton.segment_adjoints``.
* Chunk-parallel products. One program per (batch x head, chunk) reads S_c (or G_c) whole, both
  feature halves and every value column:
      o_c        = phi(Q_c) S_c + causal(phi(Q_c) phi(K'_c)^T) V'_c
      dphi(Q_c)  = dO_c S_c^T + causal(dO_c V'_c^T) phi(K'_c)
      dV'_c      = phi(K'_c) G_c + sum_h later(phi(K'_c) phi(Q_ch)^T) dO_ch
      dphi(K'_c) = V'_c G_c^T + sum_h later(V'_c dO_ch^T) phi(Q_ch)
  so every result is finished on chip and stored once in its dtype: no partial sums.

The price is memory: one [F, D] state per chunk and key / value head (F = 2D; 64 KB per chunk at
D = 128 in bfloat16) is written once and read by the output kernel, kept for the backward and read
by the dq kernel; a longer chunk stores fewer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._compat.triton_launch import launch_cached
from .._triton_dot import dot as _mm
from .triton import (
    _fold_chunk,
    _fold_queries,
    _lagged_keys,
    _phi,
    _phi_bwd,
    _program,
    _segment_state,
    _state_slot,
    segment_adjoints,
    segment_grid,
    segment_states,
)


@triton.jit
def _chunk_state(SC, pid_bk, c, NUM_CHUNKS, rows, F: tl.constexpr, D: tl.constexpr):
    """Pointers to block `rows` of chunk c's state in per-chunk states [B, HKV, NUM_CHUNKS, F, D]."""
    return SC + (pid_bk * NUM_CHUNKS + c).to(tl.int64) * F * D + rows


@launch_cached
@triton.jit
def _walk_states_kernel(
    K, V, S_IN, SC, S_OUT,
    B, T, LAG, SEG_CHUNKS, NUM_CHUNKS,
    HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, NH: tl.constexpr,
    FEATURE: tl.constexpr, S_IN_MODE: tl.constexpr, STORE_FINAL: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Per (half, value block, batch x kv head, segment): S_c of each chunk of the segment into SC
    [B, HKV, NUM_CHUNKS, F, D] (SC's dtype). S_IN_MODE as ``triton._fwd_kernel``; STORE_FINAL
    (single segment): the state after the last chunk into S_OUT [B, HKV, F, D]."""
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    pid_fv, pid_bk, seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C)
    S = _segment_state(S_IN, seg, B, pid_bk, rows, HKV, F, D, BV, S_IN_MODE)
    c_stop = tl.minimum((seg + 1) * SEG_CHUNKS, NUM_CHUNKS)
    for c in range(seg * SEG_CHUNKS, c_stop):
        tl.store(_chunk_state(SC, pid_bk, c, NUM_CHUNKS, rows, F, D), S.to(SC.dtype.element_ty))
        S = _fold_chunk(K, V, S, b, hk, c, T, LAG, sign, offs_c, offs_d, offs_v, HKV, D, C, FEATURE, DOT_PREC)
    if STORE_FINAL:
        tl.store(_state_slot(S_OUT, 0, B, pid_bk, rows, HKV, F, D), S)


@launch_cached
@triton.jit
def _walk_adjoints_kernel(
    Q, DO, G_IN, GC, DS0,
    B, T, SEG_CHUNKS, NUM_CHUNKS, NSEG,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HG: tl.constexpr,
    NH: tl.constexpr, FEATURE: tl.constexpr, G_IN_MODE: tl.constexpr, STORE_DS0: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Per (half, value block, batch x kv head, segment), chunks in reverse: G_c (the adjoint the
    keys of chunk c read) into GC [B, HKV, NUM_CHUNKS, F, D]. G_IN_MODE as ``triton._dkv_kernel``;
    STORE_DS0: G before chunk 0, which is dS_0, into DS0 [B, HKV, F, D] (float32)."""
    NV: tl.constexpr = D // BV
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HKV
    pid_fv, pid_bk, seg, half, b, hk, sign, offs_c, offs_d, offs_v, rows = _program(NV, NH, HKV, D, BV, C)
    G = _segment_state(G_IN, NSEG - 1 - seg, B, pid_bk, rows, HKV, F, D, BV, G_IN_MODE)
    c_start = seg * SEG_CHUNKS
    c_stop = tl.minimum(c_start + SEG_CHUNKS, NUM_CHUNKS)
    for cc in range(c_start, c_stop):
        c = c_stop - 1 - (cc - c_start)
        tl.store(_chunk_state(GC, pid_bk, c, NUM_CHUNKS, rows, F, D), G.to(GC.dtype.element_ty))
        G = _fold_queries(Q, DO, G, b, hk, c, T, sign, offs_d, offs_v, H, GROUP, HG, C, D, FEATURE, DOT_PREC)
    if STORE_DS0:
        if seg == 0:
            tl.store(_state_slot(DS0, 0, B, pid_bk, rows, HKV, F, D), G)


@triton.jit
def _chunk_program(H_ROWS, NUM_CHUNKS, C: tl.constexpr):
    """Grid (chunk fastest, then batch x head over H_ROWS heads) -> (chunk, batch, head, chunk-local offsets)."""
    pid = tl.program_id(0)
    c = pid % NUM_CHUNKS
    bh = pid // NUM_CHUNKS
    return c, bh // H_ROWS, bh % H_ROWS, tl.arange(0, C)


@triton.jit
def _half(x, ok, half, FEATURE: tl.constexpr, dtype):
    """Feature half `half` of rows x (any float dtype; phi in float32), zero where not ok, in dtype."""
    return tl.where(ok[:, None], _phi(x.to(tl.float32), 1.0 - 2.0 * half, FEATURE), 0.0).to(dtype)


@triton.jit
def _query_chunk(Q, K, V, T, LAG, NUM_CHUNKS, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    """The tiles of a (query head, chunk) program: (c, b, hk, offs_c, offs_d, q_ok, q_off, q in
    float32 [C, D], k_ok, the lagged keys k' in float32 [C, D], their values v' [C, D])."""
    c, b, h, offs_c = _chunk_program(H, NUM_CHUNKS, C)
    hk = h // (H // HKV)
    offs_d = tl.arange(0, D)
    p = c * C + offs_c
    q_ok = p < T
    j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, q_ok, T, LAG, HKV, D, offs_d, offs_d)
    q_off = ((b * T + p).to(tl.int64) * H + h) * D
    q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
    return c, b, hk, offs_c, offs_d, q_ok, q_off, q, k_ok, k.to(tl.float32), v


@launch_cached
@triton.jit
def _chunk_output_kernel(
    Q, K, V, SC, O,
    B, T, LAG, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, C: tl.constexpr, NH: tl.constexpr,
    FEATURE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """o of chunk c of one query head: phi(Q_c) S_c + causal(phi(Q_c) phi(K'_c)^T) V'_c, finished."""
    F: tl.constexpr = NH * D
    c, b, hk, offs_c, offs_d, q_ok, q_off, q, k_ok, k, v = _query_chunk(Q, K, V, T, LAG, NUM_CHUNKS, H, HKV, D, C)
    state = _chunk_state(SC, b * HKV + hk, c, NUM_CHUNKS, offs_d[:, None] * D + offs_d[None, :], F, D)
    qf1 = _half(q, q_ok, 0, FEATURE, v.dtype)
    qf2 = _half(q, q_ok, 1, FEATURE, v.dtype)
    kf1 = _half(k, k_ok, 0, FEATURE, v.dtype)
    kf2 = _half(k, k_ok, 1, FEATURE, v.dtype)
    s1 = tl.load(state)
    o = _mm(qf1, s1, tl.zeros([C, D], dtype=tl.float32), DOT_PREC)
    a = _mm(qf1, tl.trans(kf1), tl.zeros([C, C], dtype=tl.float32), DOT_PREC)
    if NH == 2:
        s2 = tl.load(state + D * D)
        o = _mm(qf2, s2, o, DOT_PREC)
        a = _mm(qf2, tl.trans(kf2), a, DOT_PREC)
    a = tl.where(offs_c[:, None] >= offs_c[None, :], a, 0.0).to(v.dtype)
    o = _mm(a, v, o, DOT_PREC)
    tl.store(O + q_off[:, None] + offs_d[None, :], o.to(O.dtype.element_ty), mask=q_ok[:, None])


@launch_cached
@triton.jit
def _chunk_dq_kernel(
    Q, K, V, DO, SC, DQ,
    B, T, LAG, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, C: tl.constexpr, NH: tl.constexpr,
    FEATURE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dq of chunk c of one query head: dphi(q) = dO S_c^T + causal(dO V'^T) phi(K'), then through phi."""
    F: tl.constexpr = NH * D
    c, b, hk, offs_c, offs_d, q_ok, q_off, q, k_ok, k, v = _query_chunk(Q, K, V, T, LAG, NUM_CHUNKS, H, HKV, D, C)
    do = tl.load(DO + q_off[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0).to(v.dtype)
    # [value column, feature] of a [F, D] state: S_c^T
    state_t = _chunk_state(SC, b * HKV + hk, c, NUM_CHUNKS, offs_d[None, :] * D + offs_d[:, None], F, D)
    da = _mm(do, tl.trans(v), tl.zeros([C, C], dtype=tl.float32), DOT_PREC)
    da = tl.where(offs_c[:, None] >= offs_c[None, :], da, 0.0).to(v.dtype)
    kf1 = _half(k, k_ok, 0, FEATURE, v.dtype)
    kf2 = _half(k, k_ok, 1, FEATURE, v.dtype)
    dqf = _mm(do, tl.load(state_t), tl.zeros([C, D], dtype=tl.float32), DOT_PREC)
    dqf = _mm(da, kf1, dqf, DOT_PREC)
    dq = _phi_bwd(q, _phi(q, 1.0, FEATURE), dqf, 1.0, FEATURE)
    if NH == 2:
        dqf = _mm(do, tl.load(state_t + D * D), tl.zeros([C, D], dtype=tl.float32), DOT_PREC)
        dqf = _mm(da, kf2, dqf, DOT_PREC)
        dq += _phi_bwd(q, _phi(q, -1.0, FEATURE), dqf, -1.0, FEATURE)
    tl.store(DQ + q_off[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=q_ok[:, None])


@launch_cached
@triton.jit
def _chunk_dkv_kernel(
    Q, K, V, DO, GC, DK, DV,
    B, T, LAG, NUM_CHUNKS,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, C: tl.constexpr, NH: tl.constexpr,
    FEATURE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dk, dv of the keys chunk c's queries read (rows j = p - L) of one kv head, summed over its
    query heads, one feature half after the other (fewer live tiles):
    dV' = sum_f [phi_f(K') G_fc + sum_h later(phi_f(K') phi_f(Q_h)^T) dO_h],
    dphi_f(K') = V' G_fc^T + sum_h later(V' dO_h^T) phi_f(Q_h), then through phi."""
    F: tl.constexpr = NH * D
    GROUP: tl.constexpr = H // HKV
    c, b, hk, offs_c = _chunk_program(HKV, NUM_CHUNKS, C)
    offs_d = tl.arange(0, D)
    p = c * C + offs_c
    q_ok = p < T
    j, k_ok, k, v = _lagged_keys(K, V, b, hk, p, q_ok, T, LAG, HKV, D, offs_d, offs_d)
    square = offs_d[:, None] * D + offs_d[None, :]
    adjoint = _chunk_state(GC, b * HKV + hk, c, NUM_CHUNKS, square, F, D)
    later = offs_c[:, None] <= offs_c[None, :]  # [key, query]
    dv = tl.zeros([C, D], dtype=tl.float32)
    dk = tl.zeros([C, D], dtype=tl.float32)
    for half in tl.static_range(NH):
        sign = 1.0 - 2.0 * half
        kf = _half(k, k_ok, half, FEATURE, v.dtype)
        g = tl.load(adjoint + half * D * D)
        dv = _mm(kf, g, dv, DOT_PREC)
        dkf = _mm(v, tl.trans(g), tl.zeros([C, D], dtype=tl.float32), DOT_PREC)
        for h in range(GROUP):  # a loop, not unrolled: one query head lives at a time
            q_off = ((b * T + p).to(tl.int64) * H + hk * GROUP + h) * D
            q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0)
            do = tl.load(DO + q_off[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0).to(v.dtype)
            qf = _half(q, q_ok, half, FEATURE, v.dtype)
            at = _mm(kf, tl.trans(qf), tl.zeros([C, C], dtype=tl.float32), DOT_PREC)
            at = tl.where(later, at, 0.0).to(v.dtype)
            dv = _mm(at, do, dv, DOT_PREC)
            dat = _mm(v, tl.trans(do), tl.zeros([C, C], dtype=tl.float32), DOT_PREC)
            dat = tl.where(later, dat, 0.0).to(v.dtype)
            dkf = _mm(dat, qf, dkf, DOT_PREC)
        k32 = k.to(tl.float32)  # phi(k) again in float32 for its Jacobian
        dk += _phi_bwd(k32, _phi(k32, sign, FEATURE), dkf, sign, FEATURE)
    kv_off = ((b * T + j).to(tl.int64) * HKV + hk) * D
    tl.store(DK + kv_off[:, None] + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=k_ok[:, None])
    tl.store(DV + kv_off[:, None] + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=k_ok[:, None])


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


def _chunk_states(k, v, s0, states, plan, final):
    """Every chunk's state [B, HKV, NUM_CHUNKS, F, D] in v's dtype, from the segment states (or
    from S_0 / zeros for one segment, then also writing the final state into ``final``)."""
    B, T, HKV, D = k.shape
    sc = torch.empty((B, HKV, plan.num_chunks, plan.features, D), device=k.device, dtype=v.dtype)
    if states is not None:
        mode, s_in, store_final = 2, states, False
    else:
        mode, s_in, store_final = (1, s0, True) if s0 is not None else (0, sc, True)
    nv = D // plan.backward.block_v
    _walk_states_kernel[segment_grid(plan.halves * nv, B * HKV, plan.nseg)](
        k, v, s_in, sc, final if store_final else sc, *plan.runtime(),
        HKV=HKV, S_IN_MODE=mode, STORE_FINAL=store_final, **plan.common(plan.backward, queries=False),
    )
    return sc


def forward(q, k, v, initial_state, plan):
    """(o, final state, every chunk's state, which the backward reads again)."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    s0 = initial_state.float().contiguous() if initial_state is not None else None
    states, final = segment_states(k, v, s0, plan)
    if final is None:
        final = torch.empty((B, HKV, plan.features, D), device=q.device, dtype=torch.float32)
    sc = _chunk_states(k, v, s0, states, plan, final)
    out = torch.empty_like(q)
    _chunk_output_kernel[(plan.num_chunks * B * H,)](
        q, k, v, sc, out, B, T, plan.lag, plan.num_chunks, **plan.chunk_args(H, HKV),
    )
    return out, final, sc


def backward(q, k, v, initial_state, sc, do, dfinal, plan, need_ds0: bool):
    """(dq, dk, dv, dS_0 or None); ``sc``: every chunk's state, as ``forward`` returned it."""
    B, T, H, D = q.shape
    HKV = k.shape[2]
    dev = q.device
    do = do.contiguous()
    dq = torch.empty_like(q)
    _chunk_dq_kernel[(plan.num_chunks * B * H,)](
        q, k, v, do, sc, dq, B, T, plan.lag, plan.num_chunks, **plan.chunk_args(H, HKV),
    )
    dsf = dfinal.float().contiguous() if dfinal is not None else None
    gc = torch.empty((B, HKV, plan.num_chunks, plan.features, D), device=dev, dtype=v.dtype)
    ds0 = torch.empty((B, HKV, plan.features, D), device=dev, dtype=torch.float32) if need_ds0 else gc
    nv = D // plan.backward.block_v
    gstates = segment_adjoints(q, do, dsf, plan)
    if gstates is not None:
        g_mode, g_in = 2, gstates
    else:
        g_mode, g_in = (1, dsf) if dsf is not None else (0, gc)
    _walk_adjoints_kernel[segment_grid(plan.halves * nv, B * HKV, plan.nseg)](
        q, do, g_in, gc, ds0, B, T, plan.seg_chunks, plan.num_chunks, plan.nseg,
        H=H, HKV=HKV, G_IN_MODE=g_mode, STORE_DS0=need_ds0, **plan.common(plan.backward),
    )
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    unread = min(plan.lag, T)  # keys j > T - 1 - lag never leave the window: no program writes them
    dk.narrow(1, T - unread, unread).zero_()
    dv.narrow(1, T - unread, unread).zero_()
    _chunk_dkv_kernel[(plan.num_chunks * B * HKV,)](
        q, k, v, do, gc, dk, dv, B, T, plan.lag, plan.num_chunks, **plan.chunk_args(H, HKV),
    )
    return dq, dk, dv, ds0 if need_ds0 else None
