"""Context-parallel forwards of SE hybrids: SE attention and Mamba-2 (conv halo, SSM state)."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, previous_rank_only


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
    start, end = cp.rank * seq, (cp.rank + 1) * seq
    positions = torch.arange(start, end, device=q.device)[None]
    cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
    q, k = mixer._rotate(q, cos_sin), mixer._rotate(k, cos_sin)
    # The keys and values of every shard up to this one; the retrieval (which blocks each group of
    # queries reads) is chosen from the queries and keys before, gathered without gradient.
    keys, values = cp.all_gather(k, dim=1)[:, :end], cp.all_gather(v, dim=1)[:, :end]
    retrieved = None
    if mode in RETRIEVAL_MODES:
        with torch.no_grad():
            queries = cp.all_gather(q.detach(), dim=1)[:, :end]
            indices, valid, _ = selection_for_sequence(
                queries, keys.detach(), values.detach(), mode=mode, chunk_size=chunk_size, block_size=settings.block_size,
                top_k=settings.top_k, select_every=settings.select_every, seed=settings.seed,
            )
            retrieved = retrieved_block_table(indices, valid, end // settings.block_size)
    mask = span_expanded_mask(
        mode, seq, end, query_start=start, chunk_size=chunk_size, block_size=settings.block_size,
        select_every=settings.select_every, window=settings.window, retrieved=retrieved,
    ).to(q.device)
    out = masked_attention(q, keys, values, mask)
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
    K = mixer.conv_kernel_size
    if seq < K:
        raise ValueError(f"context parallelism with Mamba-2: each shard needs at least the conv width {K} tokens; got {seq}.")
    # Halo: the conv's state is the previous shard's last K inputs (zeros before the first shard).
    tails = cp.from_previous_ranks(xBC[:, -K:].transpose(1, 2))  # [ranks, batch, channels, K]
    conv_state = torch.einsum("r,rbck->bck", previous_rank_only(cp, xBC.device).to(tails.dtype), tails)
    xBC = causal_conv1d(xBC, mixer.conv1d.weight[:, 0], mixer.conv1d.bias, conv_state, mixer.activation, backend=backend)
    group_width = mixer.n_groups * mixer.ssm_state_size
    x, B, C = xBC.split([mixer.intermediate_size, group_width, group_width], dim=-1)
    x = x.reshape(batch, seq, mixer.num_heads, mixer.head_dim)
    B = B.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    C = C.reshape(batch, seq, mixer.n_groups, mixer.ssm_state_size)
    A = -torch.exp(mixer.A_log.float())
    scan = dict(D=mixer.D, dt_bias=mixer.dt_bias, dt_softplus=True, dt_limit=mixer.time_step_limit,
                chunk_size=mixer.chunk_size, backend=backend)
    # The shard's own final state from zero, and how much of a state entering it survives to its end.
    _, own_state = ssd_scan(x, dt, A, B, C, return_final_state=True, **scan)
    dt_eff = torch.nn.functional.softplus(dt.float() + mixer.dt_bias.float()).clamp(*mixer.time_step_limit)
    log_decay = (dt_eff * A).sum(dim=1)  # [batch, heads]
    states = cp.from_previous_ranks(own_state)  # [ranks, batch, heads, P, N]
    log_decays = cp.from_previous_ranks(log_decay)  # [ranks, batch, heads]
    # State entering shard r: h_r = sum over j < r of exp(log decay of shards j+1 .. r-1) h_j.
    inclusive = log_decays.cumsum(0)  # sum of the log decays of shards 0 .. j
    before_own = inclusive[cp.rank] - log_decays[cp.rank]  # shards 0 .. r-1
    earlier = (torch.arange(cp.world_size, device=x.device) < cp.rank)[:, None, None]
    exponent = torch.where(earlier, before_own - inclusive, float("-inf"))  # later shards: weight 0
    initial_state = torch.einsum("rbh,rbhpn->bhpn", torch.exp(exponent), states)
    y = ssd_scan(x, dt, A, B, C, initial_state=initial_state, **scan)
    return mixer._norm_and_project(y, gate, backend, dtype)
