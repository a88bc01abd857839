"""Context-parallel forwards of RATTENTION's local (window halo, residual linear attention state)
and global (ring attention) layers."""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, keep_in_graph, previous_rank_only, window_mask
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
    w, start = mixer.window_size, cp.rank * seq
    halo = w + 1  # the window of the shard's first token: the previous shard's last w + 1 tokens
    if seq < halo:
        raise ValueError(f"context parallelism with RATTENTION: each shard ({seq} tokens) needs at least window_size + 1 = {halo}.")
    held = halo if cp.rank > 0 else 0
    previous = previous_rank_only(cp, q.device)

    def from_previous(t):  # [batch, halo, ...] of the previous shard (zeros on the first rank)
        return torch.einsum("r,rb...->b...", previous.to(t.dtype), cp.from_previous_ranks(t[:, seq - halo:]))

    o_swa = o_rla = None
    unused_halos = []
    if mixer.use_swa:
        positions = torch.arange(start, start + seq, device=q.device)[None]
        cos_sin = rotary_tables(mixer.rotary, context, positions, tag=("context parallel positions", start))
        q_swa, k_swa = mixer.normed(q, k, cos_sin)
        halo_k, halo_v = from_previous(k_swa), from_previous(v)
        keys, values = torch.cat([halo_k, k_swa], 1)[:, halo - held:], torch.cat([halo_v, v], 1)[:, halo - held:]
        mask = window_mask(start, seq, held, w + 1, q.device)
        o_swa = _attend(q_swa, keys, values, mask, mixer.num_heads, mixer.num_kv_heads)
        unused_halos += [halo_k, halo_v]
    if mixer.use_rla:
        # RLA state entering the window: every earlier token's phi(k) v^T, summed over the earlier
        # shards, less the halo's (still in the window). The sums are additive: no decay.
        phi = feature_map_fn(k, mixer.feature_map)
        own_sum = torch.einsum("bthf,bthd->bhfd", phi.float(), v.float())
        earlier = (torch.arange(cp.world_size, device=q.device) < cp.rank).to(own_sum.dtype)
        halo_raw, halo_v = from_previous(k), from_previous(v)
        halo_sum = torch.einsum("bthf,bthd->bhfd", feature_map_fn(halo_raw, mixer.feature_map).float(), halo_v.float())
        state = torch.einsum("r,rbhfd->bhfd", earlier, cp.from_previous_ranks(own_sum)) - halo_sum
        q_ext = torch.cat([q.new_zeros(batch, held, *q.shape[2:]), q], dim=1)
        raw = torch.cat([halo_raw, k], 1)[:, halo - held:]
        vals = torch.cat([halo_v, v], 1)[:, halo - held:]
        o_rla, _ = residual_linear_attention(q_ext, raw, vals, w, mixer.feature_map, state, backend=mixer.backend)
        o_rla = o_rla[:, held:]
    out = sum_branch_norms(o_swa, mixer.swa_norm, o_rla, mixer.rla_norm, norm_backend(mixer.backend, batch * seq))
    return keep_in_graph(mixer.o_proj(out.reshape(batch, seq, -1)), unused_halos if held == 0 else [])


def rattention_global_forward(mixer, cp: ContextParallelGroup, hidden_states, context, cache_layer=None, **unused):
    """Global layers: causal softmax attention over the whole sequence, as ring attention (ring.py)."""
    check_plain(mixer, context, cache_layer)
    batch, seq, _ = hidden_states.shape
    q, k, v = mixer.project(hidden_states)
    q, k = mixer.normed(q, k)
    out = ring_softmax_attention(q, k, v, cp, q.shape[-1] ** -0.5, mixer.backend)
    return mixer.o_proj(out.reshape(batch, seq, -1))
