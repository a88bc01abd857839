"""Context-parallel forwards of RATTENTION's local (window halo, residual linear attention state,
each per segment: a rank's chunk, with its own chunk before) and global (ring attention) layers."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph, window_mask
from .layout import earlier_chunks_sum, longer_chunks_hint, previous_chunk_entries, segments
from .ring import ring_softmax_attention


def rattention_local_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ...kernels.residual_linear_attention import residual_linear_attention
    from ...kernels.residual_linear_attention.reference import feature_map_fn
    from ...layers.fused_norms import norm_backend, sum_branch_norms
    from ...layers.residual_linear_attention import _attend
    from ...layers.rotary import rotary_tables

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    q, k, v = mixer.project(hidden_states)
    w, size, starts = mixer.window_size, seq // len(cp.chunks), cp.segment_starts(seq)
    halo = w + 1  # the window of a chunk's first token: the chunk before's last w + 1 tokens
    if size < halo:
        raise ValueError(f"context parallelism with RATTENTION: each chunk of the {cp.layout} layout ({size} tokens) "
                         f"needs at least window_size + 1 = {halo}." + longer_chunks_hint(cp))

    def from_previous(t):  # [segments, batch, halo, ...]: each segment's chunk before's last tokens (zeros before the first)
        return previous_chunk_entries(cp, [part[:, size - halo:] for part in segments(cp, t)])

    def with_halo(halo_part, part, start):  # the segment's tokens after the part of its halo that exists
        return torch.cat([halo_part, part], 1)[:, halo - (halo if start > 0 else 0):]

    o_swa = o_rla = None
    halos = [from_previous(v)]
    if mixer.use_swa:
        positions = cp.positions(seq, q.device)[None]
        cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", cp.layout, cp.rank, seq))
        q_swa, k_swa = mixer.normed(q, k, cos_sin)
        halos.append(from_previous(k_swa))
        o_swa = torch.cat([
            _attend(q_seg, with_halo(halo_k, k_seg, start), with_halo(halo_v, v_seg, start),
                    window_mask(start, size, halo if start > 0 else 0, w + 1, q.device), mixer.num_heads, mixer.num_kv_heads)
            for start, q_seg, k_seg, v_seg, halo_k, halo_v in zip(starts, *(segments(cp, t) for t in (q_swa, k_swa, v)), halos[1], halos[0])
        ], 1)
    if mixer.use_rla:
        # RLA state entering a segment's window: every earlier token's phi(k) v^T, summed over the
        # earlier chunks, less its halo's (still in the window). The sums are additive: no decay.
        phi = feature_map_fn(k, mixer.feature_map)
        own_sums = [torch.einsum("bthf,bthd->bhfd", p.float(), v_seg.float()) for p, v_seg in zip(segments(cp, phi), segments(cp, v))]
        earlier = earlier_chunks_sum(cp, own_sums)
        halos.append(from_previous(k))
        outs = []
        for i, (start, q_seg, k_seg, v_seg) in enumerate(zip(starts, *(segments(cp, t) for t in (q, k, v)))):
            halo_raw, halo_v = halos[-1][i], halos[0][i]
            held = halo if start > 0 else 0
            halo_sum = torch.einsum("bthf,bthd->bhfd", feature_map_fn(halo_raw, mixer.feature_map).float(), halo_v.float())
            q_ext = torch.cat([q_seg.new_zeros(batch, held, *q_seg.shape[2:]), q_seg], dim=1)
            o_seg, _ = residual_linear_attention(q_ext, with_halo(halo_raw, k_seg, start), with_halo(halo_v, v_seg, start), w,
                                                 mixer.feature_map, earlier[i] - halo_sum, backend=mixer.backend)
            outs.append(o_seg[:, held:])
        o_rla = torch.cat(outs, 1)
    out = sum_branch_norms(o_swa, mixer.swa_norm, o_rla, mixer.rla_norm, norm_backend(mixer.backend, batch * seq))
    return keep_in_graph(mixer.o_proj(out.reshape(batch, seq, -1)), halos)


def rattention_global_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    """Global layers: causal softmax attention over the whole sequence, as ring attention (ring.py)."""
    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    q, k, v = mixer.project(hidden_states)
    q, k = mixer.normed(q, k)
    out = ring_softmax_attention(q, k, v, cp, q.shape[-1] ** -0.5, mixer.backend)
    return mixer.o_proj(out.reshape(batch, seq, -1))
