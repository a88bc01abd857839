"""Single-token decode over the compact chunk-end cache (RAT generation, RAT+ dilated decoding).

One new query per row attends to the first n_b cached chunk ends of its row (n_b = query_chunk[b])
plus its own gated key/value, exactly :func:`chunk_end_attention_reference` with seq = 1. A decode
step is memory-bound (each cached end is read once), so the kernel is a plain streaming loop:
scores as elementwise products (a 1-row matrix product would waste the tensor cores' tile), online
softmax seeded with the own pair. The ends of a (row, head) are cut into splits that run as
separate programs, merged by a second pass (kernels/_split_decode.py), so a small batch at long
context still fills the GPU. Forward only: decoding needs no gradients; the autograd path is
chunk_end_attention_triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._split_decode import combine, empty_state, online_update, plan_splits, store_partial

LOG2E = 1.4426950408889634
# A streaming loop wants many small resident programs; wider tiles spill on sm_90
# (`python -m benchmarks.rat_decode_sweep` times the tiles).
DECODE_WARPS, DECODE_BLOCK_N = 2, 16


@triton.jit
def _start_with_own_pair(q, k_own, v_own, split, qk_scale, HEAD_DIM: tl.constexpr):
    """(m, l, acc) a split starts from: split 0 holds the query's own gated key/value (weight
    2^(score - m) = 1), the other splits nothing."""
    m_e, l_e, acc_e = empty_state(HEAD_DIM)
    first = split == 0
    own = tl.sum(q * k_own, 0) * qk_scale
    return tl.where(first, own, m_e), tl.where(first, l_e + 1.0, l_e), tl.where(first, v_own, acc_e)


@triton.jit
def _attend_ends(q, KE, VE, sec, sfc, lo, hi, dims, qk_scale, m_i, l_i, acc, BLOCK_N: tl.constexpr):
    """Fold chunk ends lo .. hi - 1 into a split's online softmax: the streaming loop every decode
    kernel shares. q float32 [D]; KE / VE point at this (row, head)'s first chunk end, sec / sfc the
    chunk strides."""
    for c0 in range(lo, hi, BLOCK_N):
        offs = c0 + tl.arange(0, BLOCK_N)
        ok = offs < hi
        ke = tl.load(KE + offs.to(tl.int64)[:, None] * sec + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        ve = tl.load(VE + offs.to(tl.int64)[:, None] * sfc + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(ke * q[None, :], 1) * qk_scale, float("-inf"))
        m_i, l_i, acc = online_update(m_i, l_i, acc, s, ve)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(
    Q, KO, VO, KE, VE, QC, M_OUT, L_OUT, ACC_OUT, O,
    sqb, sqh, skb, skh, svb, svh, seb, sec, seh, sfb, sfc, sfh, sqcb, sob, soh,
    H, C, split_len, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sqb + h * sqh + dims).to(tl.float32)
    k_own = tl.load(KO + b * skb + h * skh + dims).to(tl.float32)
    v_own = tl.load(VO + b * svb + h * svh + dims).to(tl.float32)
    n = tl.minimum(tl.maximum(tl.load(QC + b * sqcb).to(tl.int32), 0), C)
    lo = split * split_len
    m_i, l_i, acc = _start_with_own_pair(q, k_own, v_own, split, qk_scale, HEAD_DIM)
    m_i, l_i, acc = _attend_ends(q, KE + b * seb + h * seh, VE + b * sfb + h * sfh, sec, sfc, lo,
                                 tl.minimum(lo + split_len, n), dims, qk_scale, m_i, l_i, acc, BLOCK_N)
    store_partial(M_OUT, L_OUT, ACC_OUT, pid.to(tl.int64) * tl.num_programs(1) + split, m_i, l_i, acc, dims,
                  O, b * sob + h * soh, Q, 0, HEAD_DIM, DIRECT, False)


def chunk_end_decode_triton(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_ends: torch.Tensor,
    v_ends: torch.Tensor,
    query_chunk: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q, k_own, v_own [batch, 1, heads, head_dim]; k_ends, v_ends [batch, chunks, heads, head_dim] (any
    strides with a contiguous last dim, e.g. a preallocated cache); query_chunk [batch, 1]: row b sees
    ends 0 .. query_chunk[b] - 1. Returns [batch, 1, heads, head_dim] in q's dtype. Not differentiable."""
    batch, seq, heads, head_dim = q.shape
    if seq != 1:
        raise ValueError(f"chunk_end_decode_triton: expects one query per row (seq 1), got seq {seq}.")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"chunk_end_decode_triton: head_dim must be a power of two >= 16, got {head_dim}.")
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_own, v_own, k_ends, v_ends)]
    q, k_own, v_own, k_ends, v_ends = tensors
    scale = head_dim**-0.5 if scale is None else float(scale)
    splits, per_split, stats, partial = plan_splits(batch * heads, k_ends.shape[1], DECODE_BLOCK_N, head_dim, q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _decode_kernel[(batch * heads, splits)](
        q, k_own, v_own, k_ends, v_ends, query_chunk, stats[0], stats[1], partial, out,
        q.stride(0), q.stride(2), k_own.stride(0), k_own.stride(2), v_own.stride(0), v_own.stride(2),
        k_ends.stride(0), k_ends.stride(1), k_ends.stride(2), v_ends.stride(0), v_ends.stride(1), v_ends.stride(2),
        query_chunk.stride(0), out.stride(0), out.stride(2), heads, k_ends.shape[1], per_split, scale * LOG2E,
        BLOCK_N=DECODE_BLOCK_N, HEAD_DIM=head_dim, DIRECT=splits == 1, num_warps=DECODE_WARPS,
    )
    return combine(stats, partial, out, heads, splits, DECODE_WARPS)
