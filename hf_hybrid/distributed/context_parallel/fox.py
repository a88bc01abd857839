"""Context-parallel forward of Forgetting Attention (FoX)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, previous_rank_only


def fox_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ...kernels.forgetting_attention import forgetting_attention_with_cache
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
        prev_k = torch.einsum("r,rbhd->bhd", previous, cp.from_previous_ranks(k[:, -1]))
        prev_v = torch.einsum("r,rbhd->bhd", previous, cp.from_previous_ranks(v[:, -1]))
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
    # Every key, value and c up to this shard's end (the later shards' are gathered, and unused).
    end = (cp.rank + 1) * seq
    keys, values, c_keys = (cp.all_gather(t, dim=1)[:, :end] for t in (k, v, c))
    o = forgetting_attention_with_cache(q, keys, values, c, c_keys, None, backend=mixer.backend)
    return mixer.output(o, gate, norms)
