"""Context-parallel forward of Forgetting Attention (FoX): ring attention.

Query i weighs key j by exp(c_i - c_j), c = cumsum(log f) over the whole sequence: each segment's
c (a rank's chunk: one per rank, or two in the balanced layout) is its own running sum plus the
earlier chunks' totals (all-gathered, one number per row and head); then ring attention (ring.py)
over the shards' keys, values and c.
"""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain
from .layout import earlier_chunks_sum, previous_chunk_entries, segments
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
    norms = norm_backend(mixer.backend, batch * seq)
    if mixer.k_shift is not None:  # KV-shift reads the previous chunk's last raw key and value
        shifted = []
        for shift, x, logits in ((mixer.k_shift, k, k_shift_logits), (mixer.v_shift, v, v_shift_logits)):
            before = previous_chunk_entries(cp, [part[:, -1] for part in segments(cp, x)])
            shifted.append(torch.cat([
                shift(h, part, prev, lg, backend=norms)
                for h, part, prev, lg in zip(segments(cp, hidden_states), segments(cp, x), before, _segments_or_none(cp, logits))
            ], 1))
        k, v = shifted
    if mixer.q_norm is not None:
        q, k = qk_norm_rotary(q, k, mixer.q_norm, mixer.k_norm, None, norms)
    if mixer.rotary is not None:
        positions = cp.positions(seq, q.device)[None]
        cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", cp.layout, cp.rank, seq))
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
    # c = cumsum(log f) over the whole sequence: each segment's own running sum plus the earlier chunks' totals.
    own = segments(cp, log_f)
    offsets = earlier_chunks_sum(cp, [part.sum(dim=1) for part in own])  # [segments, batch, heads]
    c = torch.cat([part.cumsum(dim=1) + offset[:, None] for part, offset in zip(own, offsets)], 1)
    o = ring_forgetting_attention(q, k, v, c.float(), cp, dim**-0.5, mixer.backend)
    return mixer.output(o, gate, norms)


def _segments_or_none(cp, tensor):
    return segments(cp, tensor) if tensor is not None else [None] * len(cp.chunks)
