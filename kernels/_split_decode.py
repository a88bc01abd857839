"""Split-K ("flash-decoding") pieces shared by the single-query decode kernels.

A decode step reads each cached key once and is bound by that read. One program per (row, head)
streaming the whole cache leaves the GPU idle at small batch and long context (B=8 x 16 heads is
128 programs on 132 SMs, each walking its keys one latency-bound tile at a time), so each (row,
head) is cut into splits: pass 1 gives every (row, head, split) a running max m (log2 units), a
softmax sum l and an unnormalised float32 output; pass 2 (:func:`combine`) merges the splits:

    o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,    M = max_s m_s,

and a (row, head) that saw no key gets 0. The split count depends on shapes only (a captured CUDA
graph keeps it at every step); splits past the filled part of a buffer exit at once. Where the
(row, head) pairs alone fill the GPU (one split), pass 1 writes the output itself (DIRECT) and
pass 2 is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import multiprocessors

# splits are chosen so that about this many programs share each SM: a streaming decode step is
# occupancy-bound (`python -m benchmarks.split_decode_sweep` times the choices).
PROGRAMS_PER_SM = 16

def plan_splits(rows_heads: int, keys: int, block: int, dim: int, device: torch.device, programs_per_sm: int | None = None):
    """(splits, keys per split: a multiple of block, stats [2, pairs]: m and l, partial outputs
    [pairs, dim]) for rows_heads (row, head) pairs over ``keys`` slots, float32. With one split the
    kernel writes the output directly (DIRECT) and the buffers are unread placeholders.
    ``programs_per_sm``: a kernel's own tuned value instead of PROGRAMS_PER_SM."""
    blocks = triton.cdiv(max(keys, 1), block)
    if device.type == "cuda":
        per_sm = PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
        wanted = (per_sm * multiprocessors(device)) // max(rows_heads, 1)
    else:  # Triton's CPU interpreter: three splits wherever there are blocks for them (tests the merge)
        wanted = 3
    per_split = triton.cdiv(blocks, max(1, min(wanted, blocks))) * block
    splits = triton.cdiv(max(keys, 1), per_split)
    pairs = rows_heads * splits if splits > 1 else 1
    stats = torch.empty(2, pairs, device=device, dtype=torch.float32)
    partial = torch.empty(pairs, dim if splits > 1 else 1, device=device, dtype=torch.float32)
    return splits, per_split, stats, partial


@triton.jit
def empty_state(HEAD_DIM: tl.constexpr):
    """(m, l, acc) of a split that has seen no key yet."""
    m = tl.max(tl.full([16], float("-inf"), tl.float32), 0)
    l = tl.sum(tl.zeros([16], dtype=tl.float32), 0)
    return m, l, tl.zeros([HEAD_DIM], dtype=tl.float32)


@triton.jit
def online_update(m_i, l_i, acc, s, v):
    """Fold one tile of log2-scaled scores s [N] (-inf where invisible) and values v [N, D] in."""
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible so far: every weight is 0
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


@triton.jit
def gated(out, Z, z_off, dims, HAS_GATE: tl.constexpr):
    """out * sigmoid(z) (float32) where the caller fuses an output gate, else out."""
    if HAS_GATE:
        out = out * tl.sigmoid(tl.load(Z + z_off + dims).to(tl.float32))
    return out


@triton.jit
def store_partial(M_OUT, L_OUT, ACC_OUT, slot, m_i, l_i, acc, dims, O, o_off, Z, z_off,
                  HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr, HAS_GATE: tl.constexpr):
    """Pass 1's result: the split's (m, l, acc), or with one split (DIRECT) the normalised output at
    O + o_off (times sigmoid(Z[z_off]) with HAS_GATE)."""
    if DIRECT:
        out = gated(acc / tl.where(l_i > 0.0, l_i, 1.0), Z, z_off, dims, HAS_GATE)
        tl.store(O + o_off + dims, out.to(O.dtype.element_ty))
    else:
        tl.store(M_OUT + slot, m_i)
        tl.store(L_OUT + slot, l_i)
        tl.store(ACC_OUT + slot * HEAD_DIM + dims, acc)


@triton.jit
def _combine_kernel(M_IN, L_IN, ACC_IN, O, Z, sob, soh, szb, szh, H, splits,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, HAS_GATE: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    idx = tl.arange(0, BLOCK_S)
    ok = idx < splits
    base = pid.to(tl.int64) * splits
    m = tl.load(M_IN + base + idx, mask=ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # splits that saw no key: 0
    total = tl.sum(w * tl.load(L_IN + base + idx, mask=ok, other=0.0), 0)
    acc = tl.load(ACC_IN + (base + idx[:, None]) * HEAD_DIM + dims[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)  # no visible key: 0
    out = gated(out, Z, b * szb + h * szh, dims, HAS_GATE)
    tl.store(O + b * sob + h * soh + dims, out.to(O.dtype.element_ty))


def combine(stats: torch.Tensor, partial: torch.Tensor, out: torch.Tensor, heads: int, splits: int, warps: int = 4,
            gate: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 2 into out [B, 1, heads, D] (any strides with a contiguous last dim); nothing with one
    split. ``gate`` [B, 1, heads, D] (logits): the output is multiplied by sigmoid(gate) here, as
    pass 1 does with one split."""
    if splits == 1:
        return out
    batch, dim = out.shape[0], out.shape[-1]
    z = gate if gate is not None else out  # unread without a gate
    _combine_kernel[(batch * heads,)](
        stats[0], stats[1], partial, out, z, out.stride(0), out.stride(2), z.stride(0), z.stride(2), heads, splits,
        HEAD_DIM=dim, BLOCK_S=max(triton.next_power_of_2(splits), 2), HAS_GATE=gate is not None, num_warps=warps,
    )
    return out
