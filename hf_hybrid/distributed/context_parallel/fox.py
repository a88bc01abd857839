"""Context-parallel forward of Forgetting Attention (FoX): ring attention.

Query i weighs key j by exp(c_i - c_j), c = cumsum(log f) over the whole sequence: each shard's c
is its own running sum plus the earlier shards' totals (all-gathered, one number per row and
head); then ring attention (ring.py) over the shards' keys, values and c.
"""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, previous_rank_only
from .ring import ring_forgetting_attention


def fox_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ...layers.fused_norms import norm_backend, qk_norm_rotary
    from ...layers.rotary import apply_rotary, rotary_tables

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, kv_heads, dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q, k, v, gate, k_shift_logits, v_shift_logits = mixer._projections(hidden_states)
    q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv_heads, dim), v.view(batch, seq, kv_heads, dim)
    log_f = mixer.log_forget(hidden_states)
    previous = previous_rank_only(cp, q.device)
    norms = norm_backend(mixer.backend, batch * seq)
    if mixer.k_shift is not None:  # KV-shift reads the previous shard's last raw key and value
        prev_k = torch.einsum("r,rbhd->bhd", previous.to(k.dtype), cp.from_previous_ranks(k[:, -1]))
        prev_v = torch.einsum("r,rbhd->bhd", previous.to(v.dtype), cp.from_previous_ranks(v[:, -1]))
        k = mixer.k_shift(hidden_states, k, prev_k, k_shift_logits, backend=norms)
        v = mixer.v_shift(hidden_states, v, prev_v, v_shift_logits, backend=norms)
    if mixer.q_norm is not None:
        q, k = qk_norm_rotary(q, k, mixer.q_norm, mixer.k_norm, None, norms)
    if mixer.rotary is not None:
        start = cp.rank * seq
        positions = torch.arange(start, start + seq, device=q.device)[None]
        cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    # c = cumsum(log f) over the whole sequence: the shard's own running sum plus the earlier shards' totals.
    totals = cp.from_previous_ranks(log_f.sum(dim=1))  # [ranks, batch, heads]
    earlier = (torch.arange(cp.world_size, device=q.device) < cp.rank).to(totals.dtype)
    c = log_f.cumsum(dim=1) + torch.einsum("r,rbh->bh", earlier, totals)[:, None]
    o = ring_forgetting_attention(q, k, v, c.float(), cp, dim**-0.5, mixer.backend)
    return mixer.output(o, gate, norms)
