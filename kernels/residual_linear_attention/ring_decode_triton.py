"""Triton kernel of :mod:`.ring_decode` (the math and the reference are there): one program per row
and kv head walks that head's whole state in [D, BLOCK_V] tiles (each read once and written once),
so the ring slot it reads is rewritten by the same program, after a barrier."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton import FEATURE_IDS, _phi_vec

# A [128, 64] float32 tile of the state at a time, 8 warps: 32 values per thread.
WARPS, BLOCK_V = 8, 64


@triton.jit
def _ring_decode_kernel(
    Q, K, KS, V, S, RK, RV, RR, NEXT, O,
    sqb, sqh, skb, skh, sksb, sksh, svb, svh, srb, srt, srh, sob, soh,
    ring,
    HS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, NH: tl.constexpr, FEATURE: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HS).to(tl.int64)
    hs = (pid % HS).to(tl.int64)
    dims = tl.arange(0, D)
    slot = tl.load(NEXT) % ring
    ring_off = b * srb + slot * srt + hs * srh
    k_leaving = tl.load(RR + ring_off + dims).to(tl.float32)
    state = S + pid.to(tl.int64) * (NH * D * D)
    heads = tl.arange(0, GROUP_P2)
    for vb in range(D // BV):  # column blocks of the state: [D, BV] float32 tiles in registers
        cols = vb * BV + tl.arange(0, BV)
        rows = dims[:, None] * D + cols[None, :]
        v_block = tl.load(RV + ring_off + cols).to(tl.float32)
        acc = tl.zeros([GROUP_P2, BV], dtype=tl.float32)  # o of the kv head's query heads, both halves
        for half in range(NH):
            sign = 1.0 - 2.0 * half
            s = tl.load(state + half * D * D + rows) + _phi_vec(k_leaving, sign, FEATURE)[:, None] * v_block[None, :]
            tl.store(state + half * D * D + rows, s)
            for g in range(GROUP):
                q = tl.load(Q + b * sqb + (hs * GROUP + g) * sqh + dims).to(tl.float32)
                o = tl.sum(_phi_vec(q, sign, FEATURE)[:, None] * s, 0)
                acc = tl.where(heads[:, None] == g, acc + o[None, :], acc)
        o_ptrs = O + b * sob + (hs * GROUP + heads)[:, None] * soh + cols[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(heads < GROUP)[:, None])
    tl.debug_barrier()  # every read of the slot above happens before it is overwritten
    tl.store(RK + ring_off + dims, tl.load(KS + b * sksb + hs * sksh + dims).to(RK.dtype.element_ty))
    tl.store(RV + ring_off + dims, tl.load(V + b * svb + hs * svh + dims).to(RV.dtype.element_ty))
    tl.store(RR + ring_off + dims, tl.load(K + b * skb + hs * skh + dims).to(RR.dtype.element_ty))


def ring_decode_triton(q, k, k_swa, v, state, ring_keys, ring_values, ring_raw_keys, next_column, feature_map):
    """:func:`.ring_decode.ring_decode_reference` in one launch (same arguments; checks are the
    public op's: state contiguous float32, the rings of equal strides)."""
    batch, heads, dim = q.shape
    kv_heads = state.shape[1]
    out = torch.empty_like(q)
    _ring_decode_kernel[(batch * kv_heads,)](
        q, k, k_swa, v, state, ring_keys, ring_values, ring_raw_keys, next_column, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k_swa.stride(0), k_swa.stride(1), v.stride(0), v.stride(1),
        ring_raw_keys.stride(0), ring_raw_keys.stride(1), ring_raw_keys.stride(2), out.stride(0), out.stride(1),
        ring_raw_keys.shape[1],
        HS=kv_heads, GROUP=heads // kv_heads, GROUP_P2=triton.next_power_of_2(heads // kv_heads), D=dim, BV=min(dim, BLOCK_V), NH=1 if feature_map == "identity" else 2,
        FEATURE=FEATURE_IDS[feature_map], num_warps=WARPS,
    )
    return out
