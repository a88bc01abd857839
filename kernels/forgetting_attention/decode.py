"""Forgetting Attention of new queries against a cached key sequence (decode, chunked prefill).

The Tq queries are the last Tq positions of the Tk keys: query t sits at key position
p_t = Tk - Tq + t and sees key j iff j <= p_t, key_mask[b, j] (False marks left padding) and,
with window_size = W, p_t - j < W. The caller keeps the cumulative log forget c of every cached
token (c_q for the new queries, c_k for all keys, one running sum per query head), so

    o_t = sum_j softmax_j(scale q_t . k_j + c_q[t] - c_k[j]) v_j

which equals the full-sequence forward at those positions. Rows that see no key (a padded query
whose every visible key is padding) return 0.

Backends: "reference" (explicit einsum, any device) and "sdpa" (PyTorch's fused attention with
the float32 bias c_q - c_k as attn_mask, upcast to float32 so the bias keeps full precision).
"auto" and "triton" pick "sdpa" on CUDA; "auto" picks the reference elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import _expand_kv, masked_softmax_attention, visibility_mask

# Elements of the float32 bias one SDPA call of forgetting_attention_with_cache_sdpa may hold
# (2**27: 512 MiB; the block's masked copy and float32 K/V come on top).
SDPA_BIAS_BLOCK = 1 << 27


def cache_visibility(
    batch: int, num_queries: int, num_keys: int, key_mask: torch.Tensor | None, window_size: int | None, device
) -> torch.Tensor:
    """[batch or 1, 1, Tq, Tk] bool visibility of the cached keys for the new queries."""
    visible = visibility_mask(num_queries, num_keys, num_keys - num_queries, window_size, None, device)[None, None]
    if key_mask is not None:
        visible = visible & key_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return visible


def forgetting_attention_with_cache_reference(q, k, v, c_q, c_k, key_mask=None, scale=None, window_size=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias = c_q.float().permute(0, 2, 1)[..., :, None] - c_k.float().permute(0, 2, 1)[..., None, :]
    visible = cache_visibility(q.shape[0], q.shape[1], k.shape[1], key_mask, window_size, q.device)
    bias = bias.masked_fill(~visible, 0.0)
    return masked_softmax_attention(q, k, v, bias, visible, scale)


def decode_visibility(length: torch.Tensor, num_keys: int, key_mask: torch.Tensor | None, window_size: int | None) -> torch.Tensor:
    """[B or 1, 1, 1, T] bool: keys a query at position n - 1 sees (n = length per row, [1] or [B])."""
    columns = torch.arange(num_keys, device=length.device)
    n = length.reshape(-1, 1).to(torch.int64)
    visible = columns < n
    if window_size is not None:
        visible = visible & (n - 1 - columns < window_size)
    if key_mask is not None:
        visible = visible & key_mask.to(device=length.device, dtype=torch.bool)
    return visible[:, None, None, :]


def forgetting_attention_decode_reference(q, k, v, c_q, c_k, length, key_mask=None, scale=None, window_size=None):
    """One query per row at key position n - 1 (n = length): o = softmax_j(scale q.k_j + c_q - c_k[j]) v_j
    over j < n (and key_mask, and n - 1 - j < window_size). Columns >= n are never read into the result."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bias = c_q.float().permute(0, 2, 1)[..., :, None] - c_k.float().permute(0, 2, 1)[..., None, :]
    visible = decode_visibility(length, k.shape[1], key_mask, window_size)
    bias = bias.masked_fill(~visible, 0.0)
    return masked_softmax_attention(q, k, v, bias, visible, scale)


def forgetting_attention_with_cache_sdpa(q, k, v, c_q, c_k, key_mask=None, scale=None, window_size=None,
                                         block_elements: int | None = None):
    """The "sdpa" backend, over blocks of query heads (and of queries, where one head's bias is
    still larger than ``block_elements``, default ``SDPA_BIAS_BLOCK``): each block holds its own
    float32 bias [B, heads, queries, keys] and float32 copies of its heads' keys and values, not the
    whole [B, HQ, Tq, Tk] (a prefill continuing in slices at a large batch: tens of GB). A query
    block [t0, t1) is the same call on the keys up to its last query's position."""
    limit = SDPA_BIAS_BLOCK if block_elements is None else block_elements
    b, tq, hq = q.shape[:3]
    tk = k.shape[1]
    per_head = b * tq * tk
    if per_head * hq <= limit:
        return _with_cache_sdpa_block(q, k, v, c_q, c_k, key_mask, scale, window_size)
    group = hq // k.shape[2]
    heads = max(1, min(hq, limit // per_head))
    queries = tq if per_head <= limit else max(1, limit // (b * tk))
    out = q.new_empty(q.shape[:3] + v.shape[3:])
    for h0 in range(0, hq, heads):
        h1 = min(h0 + heads, hq)
        kv_heads = torch.arange(h0, h1, device=k.device) // group  # each query head's kv head
        k_block, v_block = k.index_select(2, kv_heads), v.index_select(2, kv_heads)
        for t0 in range(0, tq, queries):
            t1 = min(t0 + queries, tq)
            seen = tk - (tq - t1)  # keys up to the block's last query
            out[:, t0:t1, h0:h1] = _with_cache_sdpa_block(
                q[:, t0:t1, h0:h1], k_block[:, :seen], v_block[:, :seen], c_q[:, t0:t1, h0:h1], c_k[:, :seen, h0:h1],
                None if key_mask is None else key_mask[:, :seen], scale, window_size,
            )
    return out


def _with_cache_sdpa_block(q, k, v, c_q, c_k, key_mask=None, scale=None, window_size=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    visible = cache_visibility(q.shape[0], q.shape[1], k.shape[1], key_mask, window_size, q.device)
    bias = c_q.float().permute(0, 2, 1)[..., :, None] - c_k.float().permute(0, 2, 1)[..., None, :]
    bias = bias.masked_fill(~visible, float("-inf"))
    any_visible = visible.any(dim=-1, keepdim=True)  # [B|1, 1, Tq, 1]
    bias = bias.masked_fill(~any_visible, 0.0)  # keep fully masked rows finite; zeroed below
    qf = q.float().transpose(1, 2)
    kf = _expand_kv(k, q.shape[2]).float().transpose(1, 2)
    vf = _expand_kv(v, q.shape[2]).float().transpose(1, 2)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias, scale=scale)
    out = out * any_visible
    return out.transpose(1, 2).to(q.dtype)
