"""Context-parallel forwards of SE hybrids: SE attention (the keys before gathered, retrieval chosen
from the queries before) and Mamba-2 (conv halo, SSM state), each per segment (a rank's chunk)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph
from .layout import gather_segments, gather_sequence, longer_chunks_hint, previous_chunk_entries, segments


def se_attention_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None,
                          attention_mode=None, se_chunk_size=None, **unused):
    from ...kernels.span_expanded_attention import MODES, RETRIEVAL_MODES, retrieved_block_table, span_expanded_mask
    from ...kernels.span_expanded_attention.reference import masked_attention, selection_for_sequence
    from ...layers.rotary import rotary_tables

    check_plain(mixer, context, cache_layer)
    mode = mixer.settings.mode if attention_mode is None else attention_mode
    if mode not in MODES or mode == "se_random":
        raise NotImplementedError(f"context parallelism with SE attention: mode {mode!r} has no exchange yet.")
    settings = mixer.settings
    if se_chunk_size is None and mixer.training and len(settings.chunk_sizes) > 1 and mode in RETRIEVAL_MODES:
        raise ValueError("context parallelism with SE attention: train with one se_chunk_sizes entry (every rank must chunk alike).")
    chunk_size = mixer._chunk_size(se_chunk_size, mode, cached=False)
    batch, seq, _ = hidden_states.shape
    q = mixer.q_proj(hidden_states).view(batch, seq, mixer.num_heads, mixer.head_dim)
    k = mixer.k_proj(hidden_states).view(batch, seq, mixer.num_kv_heads, mixer.head_dim)
    v = mixer.v_proj(hidden_states).view(batch, seq, mixer.num_kv_heads, mixer.head_dim)
    positions = cp.positions(seq, q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", cp.layout, cp.rank, seq))
    q, k = mixer._rotate(q, cos_sin), mixer._rotate(k, cos_sin)
    # The keys and values of the whole sequence, in order; each segment (a rank's chunk) reads those
    # up to its end. The retrieval (which blocks each group of queries reads) is chosen from the
    # queries and keys before, gathered without gradient.
    keys, values = (gather_sequence(cp, segments(cp, t)) for t in (k, v))
    queries = gather_sequence(cp, segments(cp, q.detach())) if mode in RETRIEVAL_MODES else None
    size, outs = seq // len(cp.chunks), []
    for start, q_seg in zip(cp.segment_starts(seq), segments(cp, q)):
        end = start + size
        retrieved = None
        if mode in RETRIEVAL_MODES:
            with torch.no_grad():
                indices, valid, _ = selection_for_sequence(
                    queries[:, :end], keys[:, :end].detach(), values[:, :end].detach(), mode=mode, chunk_size=chunk_size,
                    block_size=settings.block_size, top_k=settings.top_k, select_every=settings.select_every, seed=settings.seed,
                )
                retrieved = retrieved_block_table(indices, valid, end // settings.block_size)
        mask = span_expanded_mask(
            mode, size, end, query_start=start, chunk_size=chunk_size, block_size=settings.block_size,
            select_every=settings.select_every, window=settings.window, retrieved=retrieved,
        ).to(q.device)
        outs.append(masked_attention(q_seg, keys[:, :end], values[:, :end], mask))
    out = keep_in_graph(torch.cat(outs, 1), [keys, values])  # the first chunk reads none of the later keys
    return mixer.o_proj(out.reshape(batch, seq, -1))


# ------------------------------------------------------------------------------------ Mamba-2


def mamba2_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    from ...kernels.causal_conv1d import causal_conv1d
    from ...kernels.ssd_scan import ssd_scan
    from ...models.se_hybrid.modeling_se_hybrid import _mamba_backend

    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    dtype = hidden_states.dtype
    backend = _mamba_backend(mixer)
    gate, xBC, dt = mixer.in_proj(hidden_states).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    K, size = mixer.conv_kernel_size, seq // len(cp.chunks)
    if size < K:
        raise ValueError(f"context parallelism with Mamba-2: each chunk of the {cp.layout} layout needs at least the conv width {K} tokens; got {size}." + longer_chunks_hint(cp))
    # Halo: a segment's conv state is the last K inputs of the chunk before (zeros before the first).
    tails = previous_chunk_entries(cp, [part[:, -K:].transpose(1, 2) for part in segments(cp, xBC)])  # [segments, batch, channels, K]
    xBC = torch.cat([
        causal_conv1d(part, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, tail, mixer.activation, backend=backend)
        for part, tail in zip(segments(cp, xBC), tails)
    ], 1)
    group_width = mixer.n_groups * mixer.ssm_state_size
    x, B, C = xBC.split([mixer.intermediate_size, group_width, group_width], dim=-1)
    x = x.reshape(batch, seq, mixer.num_heads, mixer.head_dim)
    B = B.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    C = C.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    A = -torch.exp(mixer.A_log.float())
    scan = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=mixer.time_step_limit,
                chunk_size=mixer.chunk_size, backend=backend)
    parts = list(zip(*(segments(cp, t) for t in (x, dt, B, C))))
    # Each segment's own final state from zero, and how much of a state entering it survives to its end.
    own_states = [ssd_scan(x_s, dt_s, A, B_s, C_s, return_final_state=True, **scan)[1] for x_s, dt_s, B_s, C_s in parts]
    log_decay = [(torch.nn.functional.softplus(dt_s.float() + mixer.dt_bias.float()).clamp(*mixer.time_step_limit) * A).sum(dim=1)
                 for _, dt_s, _, _ in parts]  # [batch, heads] each
    states = gather_segments(cp, own_states)  # [chunks, batch, heads, P, N] in sequence order
    log_decays = gather_segments(cp, log_decay)  # [chunks, batch, heads]
    # State entering chunk c: h = sum over j < c of exp(log decay of chunks j+1 .. c-1) h_j.
    inclusive = log_decays.cumsum(0)  # sum of the log decays of chunks 0 .. j
    ys = []
    for chunk, (x_s, dt_s, B_s, C_s) in zip(cp.chunks, parts):
        before_own = inclusive[chunk] - log_decays[chunk]  # chunks 0 .. c-1
        earlier = (torch.arange(cp.num_chunks, device=x.device) < chunk)[:, None, None]
        exponent = torch.where(earlier, before_own - inclusive, float("-inf"))  # later chunks: weight 0
        initial_state = torch.einsum("rbh,rbhpn->bhpn", torch.exp(exponent), states)
        ys.append(ssd_scan(x_s, dt_s, A, B_s, C_s, initial_state=initial_state, **scan))
    return mixer._norm_and_project(torch.cat(ys, 1), gate, backend, dtype)
