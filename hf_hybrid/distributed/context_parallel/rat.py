"""Context-parallel forwards of RAT (chunk ends all-gathered) and RAT+ (recurrent state carried
through the earlier shards; of the earlier keys and values, what the attention patterns read: a
dilated pattern's chunk ends, window halo and sinks all-gathered, a dense pattern's all through
ring attention)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph
from .layout import gather_segments, gather_sequence, longer_chunks_hint, segments
from .ring import ring_softmax_attention


def rat_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ...kernels._common import expand_groups
    from ...kernels.chunk_attention import chunk_end_attention, chunk_ends
    from ...kernels.fused_norm import rotary as rotate
    from ...layers.rotary import rotary_tables

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, dim, L, groups = mixer.num_heads, mixer.head_dim, mixer.chunk_size, mixer.num_qk_groups
    size = seq // len(cp.chunks)
    if size % L:
        raise ValueError(f"context parallelism with RAT: each chunk of the {cp.layout} layout ({size} tokens) must hold whole RAT chunks of {L}." + longer_chunks_hint(cp))
    q, k, v, gate_logits, gate_z = (proj(hidden_states) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.g_proj, mixer.z_proj))
    q, k = q.view(batch, seq, groups, dim), k.view(batch, seq, groups, dim)
    v, gate_logits = v.view(batch, seq, heads, dim), gate_logits.view(batch, seq, heads, dim)
    positions = cp.positions(seq, hidden_states.device)[None]
    chunk_index = torch.div(positions, L, rounding_mode="floor")
    cos_sin = rotary_tables(mixer.rotary, context, chunk_index, tag=("context parallel chunk", L, cp.layout, cp.rank, seq))
    # Chunk-local recurrences: every segment (a rank's chunk) starts at a restart, as position 0 does.
    k_tilde, v_tilde = mixer._recurrences(k, v, gate_logits, 0, positions, None)
    k_rot = rotate(k_tilde, cos_sin, backend=mixer.backend)
    q = expand_groups(rotate(q, cos_sin, backend=mixer.backend), heads)
    # Every RAT chunk's end, in sequence order (each segment's ends gathered, then ordered by chunk).
    k_ends, v_ends = (gather_sequence(cp, [chunk_ends(part, L) for part in segments(cp, t)]) for t in (k_rot, v_tilde))
    y = chunk_end_attention(q, k_rot, v_tilde, k_ends, v_ends, query_chunk=chunk_index.expand(batch, seq), backend=mixer.backend)
    return mixer._output(gate_z, y)


def rat_plus_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, sparse_config=None, **unused):
    from ...kernels.fused_norm import rotary
    from ...kernels.gated_recurrence import gated_recurrence
    from ...kernels.output_gate import sigmoid_gate
    from ...layers.rat_plus_attention import DENSE, select_kv_heads
    from ...layers.rotary import rotary_tables

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    heads, kv, dim = mixer.num_heads, mixer.num_kv_heads, mixer.head_dim
    groups = (sparse_config or DENSE).layer_groups(mixer.layer_idx, heads)
    if any(pattern.kind == "topk" for pattern, _ in groups):
        raise NotImplementedError("context parallelism with RAT+: top-k block patterns have no exchange yet (dense and dilated do).")
    rep = heads // kv
    group_kv = [sorted({h // rep for h in group_heads}) for _, group_heads in groups]
    q, k, v, gate_z = (proj(hidden_states) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.z_proj))
    q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv, dim), v.view(batch, seq, kv, dim)
    size, starts = seq // len(cp.chunks), cp.segment_starts(seq)
    gathers = []  # kept in every rank's graph (zero weight where unused): the same collectives in each backward
    if mixer.use_recurrence:
        # The recurrence runs over the whole sequence: the state entering a segment (a rank's chunk)
        # is the earlier chunks' final states (each from zero) carried through the later ones' gate products.
        gate = torch.sigmoid(mixer.g_proj(hidden_states).float()).view(batch, seq, kv, dim)
        products = gather_segments(cp, [part.prod(dim=1) for part in segments(cp, gate)])  # [chunks, batch, kv, dim]
        gathers.append(products)
        tilde = []
        for x in (k, v):
            finals = gather_segments(cp, [
                gated_recurrence(x_s, g_s, 0, 0, None, backend=mixer.backend, out_dtype=torch.float32)[:, -1]
                for x_s, g_s in zip(segments(cp, x), segments(cp, gate))
            ])
            gathers.append(finals)
            parts = []
            for chunk, x_s, g_s in zip(cp.chunks, segments(cp, x), segments(cp, gate)):
                state = torch.zeros_like(finals[0])
                for j in range(chunk):
                    state = products[j] * state + finals[j]
                parts.append(gated_recurrence(x_s, g_s, 0, 0, state, backend=mixer.backend, out_dtype=torch.float32))
            tilde.append(torch.cat(parts, 1))
        k_tilde, v_tilde = tilde
    else:
        k_tilde, v_tilde = k.float(), v.float()
    positions = cp.positions(seq, q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", cp.layout, cp.rank, seq))
    rope_backend = mixer.backend if mixer.backend in ("reference", "triton") else "auto"
    q = rotary(q, cos_sin, backend=rope_backend)
    k_rot = rotary(k_tilde.to(q.dtype), cos_sin, backend=rope_backend)
    # Dense groups (D = 1) read every earlier key: ring attention (ring.py). Dilated groups read
    # each earlier chunk's chunk ends, window halo and sinks (shard_tokens_read), all-gathered.
    own_values = v_tilde.to(q.dtype)
    dilated = [pattern for pattern, _ in groups if pattern.kind == "dilated"]
    per_segment = []  # (query positions, keys, values, key positions) of each segment for the dilated groups
    if dilated:
        read = shard_tokens_read(dilated, size)
        index = torch.arange(size, device=q.device) if read is None else torch.tensor(read, device=q.device)
        gathered = [gather_sequence(cp, [part[:, index] for part in segments(cp, t)]) for t in (k_rot, own_values)]
        gathers += gathered
        for chunk, start, k_seg, v_seg in zip(cp.chunks, starts, segments(cp, k_rot), segments(cp, own_values)):
            earlier = chunk * len(index)  # the gathered tokens of the chunks before this one
            keys, values = (torch.cat([g[:, :earlier], t], dim=1) for g, t in zip(gathered, (k_seg, v_seg)))
            chunks_before = torch.arange(chunk, device=q.device)[:, None]
            k_pos = torch.cat([(chunks_before * size + index).flatten(), torch.arange(start, start + size, device=q.device)])
            q_pos = torch.arange(start, start + size, device=q.device)
            per_segment.append((q_pos[None].expand(batch, size), keys, values, k_pos[None].expand(batch, -1)))
    y = q.new_empty(batch, seq, heads, dim) if len(groups) > 1 else None
    for (pattern, group_heads), kv_heads in zip(groups, group_kv):
        q_group = q if len(groups) == 1 else q[:, :, list(group_heads)]
        pick = lambda x: select_kv_heads(x, kv_heads, mixer._index_tensor)  # noqa: E731
        if pattern.kind == "dense":
            # The ring takes grouped heads as they are where the group's query heads are whole
            # GQA groups, else one key head per query head.
            per_query = lambda x: x if _whole_kv_groups(group_heads, kv_heads, rep) else mixer._expand(x, kv_heads, group_heads)  # noqa: E731
            out = ring_softmax_attention(q_group, per_query(pick(k_rot)), per_query(pick(own_values)), cp, dim**-0.5, mixer.backend)
        else:
            out = torch.cat([
                mixer._group_attention(pattern, group_heads, kv_heads, q_seg, pick(keys), pick(values), q_pos, k_pos, None, False)
                for q_seg, (q_pos, keys, values, k_pos) in zip(segments(cp, q_group), per_segment)
            ], 1)
        if y is None:
            y = out
        else:
            y[:, :, list(group_heads)] = out
    out = mixer.o_proj(sigmoid_gate(gate_z, y.reshape(gate_z.shape), backend=mixer.backend))
    return keep_in_graph(out, gathers)


def shard_tokens_read(patterns, seq: int) -> list[int] | None:
    """Indices within a chunk of ``seq`` tokens (a rank's shard, or each of its two chunks in the
    balanced layout) of the keys that later chunks' queries read under dilated ``patterns`` (the
    union over them): the chunk ends ((position + 1) % D == 0), the last ``local_window`` tokens
    (the window of the next chunk's first queries) and the first ``num_sink_tokens`` (read from
    the first chunk only; the later chunks' are masked). The same on every rank when D divides
    ``seq``. None where every earlier key must be gathered: a dense pattern, or a dilation, window
    or sink count that does not fit a chunk."""
    read = set()
    for pattern in patterns:
        if pattern.kind != "dilated":
            return None
        dilation, window, sinks = pattern.dilation, pattern.local_window, pattern.num_sink_tokens
        if seq % dilation or window > seq or sinks > seq:
            return None
        read |= set(range(dilation - 1, seq, dilation)) | set(range(seq - window, seq)) | set(range(sinks))
    return sorted(read)


def _whole_kv_groups(heads, kv_heads, rep: int) -> bool:
    """Whether query ``heads`` are exactly the query heads of ``kv_heads`` in order (rep per key head)."""
    return len(heads) == rep * len(kv_heads) and all(h // rep == kv_heads[i // rep] for i, h in enumerate(heads))
