"""Context-parallel forward of softmax attention: a sliding window reads a halo of the chunk before
each of a rank's chunks (segments); full attention runs as ring attention (ring.py)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph, window_mask
from .layout import longer_chunks_hint, previous_chunk_entries, segments
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
    positions = cp.positions(seq, q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", cp.layout, cp.rank, seq))
    q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    window = mixer.sliding_window
    if window is None:  # full attention
        out = ring_softmax_attention(q, k, v, cp, mixer.scaling, getattr(mixer, "backend", "auto"))
        return mixer.o_proj(out.reshape(batch, seq, -1))
    # A window of w tokens (itself included) reaches w - 1 tokens into the chunk before.
    halo = window - 1
    size = seq // len(cp.chunks)
    if size < halo:
        raise ValueError(f"context parallelism with a sliding window of {window}: each chunk of the {cp.layout} "
                         f"layout needs at least {halo} tokens; got {size}." + longer_chunks_hint(cp))
    halos = [previous_chunk_entries(cp, [part[:, size - halo:] for part in segments(cp, t)]) for t in (k, v)]
    outs = []
    for index, (start, q_seg, k_seg, v_seg) in enumerate(zip(cp.segment_starts(seq), *(segments(cp, t) for t in (q, k, v)))):
        held = halo if start > 0 else 0
        keys = torch.cat([halos[0][index], k_seg], 1)[:, halo - held:]
        values = torch.cat([halos[1][index], v_seg], 1)[:, halo - held:]
        outs.append(F.scaled_dot_product_attention(
            q_seg.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=window_mask(start, size, held, window, q.device),
            scale=mixer.scaling, enable_gqa=heads != kv_heads,
        ).transpose(1, 2))
    out = torch.cat(outs, 1)
    return keep_in_graph(mixer.o_proj(out.reshape(batch, seq, -1)), halos)
