"""Context-parallel forward of softmax attention: a sliding window reads a halo of the previous
shard; full attention runs as ring attention (ring.py)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph, previous_rank_only, window_mask
from .ring import ring_softmax_attention


def softmax_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from torch.nn import functional as F

    from ...layers.rotary import apply_rotary, rotary_tables

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, kv_heads, dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    q = mixer.q_proj(hidden_states).view(batch, seq, heads, dim)
    k = mixer.k_proj(hidden_states).view(batch, seq, kv_heads, dim)
    v = mixer.v_proj(hidden_states).view(batch, seq, kv_heads, dim)
    start = cp.rank * seq
    positions = torch.arange(start, start + seq, device=q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
    q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    window = mixer.sliding_window
    if window is None:  # full attention
        out = ring_softmax_attention(q, k, v, cp, mixer.scaling, getattr(mixer, "backend", "auto"))
        return mixer.o_proj(out.reshape(batch, seq, -1))
    # A window of w tokens (itself included) reaches w - 1 tokens into the previous shard.
    halo = window - 1
    if seq < halo:
        raise ValueError(f"context parallelism with a sliding window of {window}: each shard needs at least {halo} tokens.")
    held = halo if cp.rank > 0 else 0
    previous = previous_rank_only(cp, q.device)
    halo_k, halo_v = (torch.einsum("r,rb...->b...", previous.to(t.dtype), cp.from_previous_ranks(t[:, seq - halo:])) for t in (k, v))
    keys, values = torch.cat([halo_k, k], 1)[:, halo - held:], torch.cat([halo_v, v], 1)[:, halo - held:]
    unused_halos = [halo_k, halo_v] if held == 0 else []
    mask = window_mask(start, seq, held, window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
        scale=mixer.scaling, enable_gqa=heads != kv_heads,
    ).transpose(1, 2)
    return keep_in_graph(mixer.o_proj(out.reshape(batch, seq, -1)), unused_halos)
