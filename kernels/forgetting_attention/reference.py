"""Reference Forgetting Attention (FoX, Lin et al. 2025, Eq. 11-13), the oracle for the kernels.

Math, per batch row and per query head h (log f <= 0 is the log forget gate of that head):

    c_t      = sum_{l <= t} log f_l                     (cumulative log forget, float32)
    s_ij     = scale * q_i . k_j + c_i - c_j            (= q_i . k_j + sum_{l=j+1..i} log f_l)
    o_i      = sum_j softmax_j(s_ij) v_j                over the visible keys j of query i

Key j is visible to query i iff j <= i, and with ``window_size = W`` also i - j < W (the window
counts the token itself, like transformers' ``sliding_window``). With ``cu_seqlens`` (packed
sequences, batch 1) keys of another sequence are invisible and c restarts at every sequence
start, so neither attention nor the forget gate crosses a boundary. GQA: query head h reads
key/value head h // (HQ // HKV); log f and c are per *query* head.

Gradients (Appendix E): with dS = P o (dP - rowsum(dO o O)) the gradient of the logits,
dc_i = sum_j dS_ij - sum_j dS_ji and d log f = reverse cumsum of dc. The reference gets them
from autograd through the explicit T x T bias, which is the definition.
"""
from __future__ import annotations

import torch


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: index of the packed sequence every token belongs to."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), positions, right=True)


def row_boundaries(batch: int, seq: int, device) -> torch.Tensor:
    """int32 [batch + 1]: a dense batch's rows as packed-sequence boundaries (0, seq, 2 seq, ...),
    the cu_seqlens the kernels take when none is given."""
    return torch.arange(0, (batch + 1) * seq, seq, device=device, dtype=torch.int32)


def cumulative_log_forget_by_head(log_f: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """c = cumsum(log_f) laid out [heads, batch * seq] (float32): the Triton kernels' layout.

    log_f [batch, seq, heads] (any float dtype). The scan runs along the contiguous last axis:
    torch's scan over the strided middle axis of [batch, seq, heads] gives one thread to each
    (row, head), a sizeable share of the whole attention forward at long sequences, where the last
    axis costs next to nothing. With cu_seqlens (batch 1)
    the sum runs in float64 and the running total at each sequence start is subtracted, so a late
    sequence keeps full precision. Differentiable (autograd turns dc into the reverse cumsum).
    """
    heads = log_f.shape[2]
    by_head = log_f.permute(2, 0, 1)  # [heads, batch, seq]
    if cu_seqlens is None:
        return torch.cumsum(by_head.float().contiguous(), dim=-1).reshape(heads, -1)
    total = torch.cumsum(by_head[:, 0].double().contiguous(), dim=-1)  # [heads, tokens]
    seg = segment_ids(cu_seqlens, total.shape[1])
    starts = cu_seqlens[:-1].to(torch.int64)
    before = torch.nn.functional.pad(total, (1, 0))[:, starts]  # sum before each sequence start
    return (total - before[:, seg]).float()


def cumulative_log_forget(log_f: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """c = cumsum(log_f) over the sequence axis in float32, restarting at every packed sequence.

    log_f and the result are [batch, seq, heads] (the result is a view of the [heads, batch, seq]
    sums of :func:`cumulative_log_forget_by_head`). Differentiable.
    """
    batch, seq, heads = log_f.shape
    return cumulative_log_forget_by_head(log_f, cu_seqlens).view(heads, batch, seq).permute(1, 2, 0)


def visibility_mask(
    num_queries: int,
    num_keys: int,
    query_offset: int = 0,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    device=None,
) -> torch.Tensor:
    """[num_queries, num_keys] bool: query t (at key position query_offset + t) may see key j."""
    i = torch.arange(query_offset, query_offset + num_queries, device=device)[:, None]
    j = torch.arange(num_keys, device=device)[None, :]
    mask = j <= i
    if window_size is not None:
        mask = mask & (i - j < window_size)
    if cu_seqlens is not None:
        seg = segment_ids(cu_seqlens.to(device), num_keys)
        mask = mask & (seg[query_offset:query_offset + num_queries, None] == seg[None, :])
    return mask


def _expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, T, HKV, D] -> [B, T, HQ, D]: query head h reads kv head h // group."""
    group = num_q_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def masked_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """softmax(scale q.k + bias, masked) v in float32 (float64 for float64 q); q [B,Tq,HQ,D],
    k/v [B,Tk,HKV,D], bias [B,HQ,Tq,Tk] float32, visible broadcastable to it. Rows that see no key
    return 0."""
    acc = torch.promote_types(q.dtype, torch.float32)
    kf = _expand_kv(k, q.shape[2]).to(acc)
    vf = _expand_kv(v, q.shape[2]).to(acc)
    scores = torch.einsum("bthd,bshd->bhts", q.to(acc), kf) * scale + bias.to(acc)
    scores = scores.masked_fill(~visible, float("-inf"))
    any_visible = visible.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~any_visible, 0.0), dim=-1) * any_visible
    return torch.einsum("bhts,bshd->bthd", probs, vf).to(q.dtype)


def forgetting_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    scale: float | None = None,
    window_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B,T,HQ,D], k/v [B,T,HKV,D], log_f [B,T,HQ] -> o [B,T,HQ,D] (q's dtype).

    Builds the explicit T x T bias D_ij = c_i - c_j and a masked softmax: for tests and short
    sequences only.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    c = cumulative_log_forget(log_f, cu_seqlens).permute(0, 2, 1)  # [B, HQ, T]
    bias = c[..., :, None] - c[..., None, :]
    visible = visibility_mask(q.shape[1], k.shape[1], 0, window_size, cu_seqlens, q.device)
    # Invisible entries can hold +inf - (+inf) style garbage only if c were infinite; mask them
    # before the softmax so their gradient is exactly zero.
    bias = bias.masked_fill(~visible, 0.0)
    return masked_softmax_attention(q, k, v, bias, visible, scale)
