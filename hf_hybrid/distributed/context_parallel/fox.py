"""Context-parallel forward of Forgetting Attention (FoX): ring attention.

Query i weighs key j by exp(c_i - c_j), c = cumsum(log f) over the whole sequence: each shard's c
is its own running sum plus the earlier shards' totals (all-gathered, one number per row and
head). The keys, values and c of each shard then travel around the ring, one block per step
(ring.py), while every rank attends to the block it holds: its own block causally, each earlier
shard's block whole (kernels/forgetting_attention/blocks.py), the partial outputs merged by their
log-sum-exps. A rank holds two blocks of keys at a time, never the prefix.

The backward passes the blocks around again, each with float32 accumulators of its dK, dV and
dc: every rank adds its share (from the merged output and log-sum-exp it saved) and passes the
accumulators on; after a full turn they reach the block's own rank. Later shards' blocks pass
through a rank untouched, so with contiguous shards the last rank does the most work (a balanced
"two chunks per rank" layout would change every mixer's sharding; not done).
"""
from __future__ import annotations

import torch

from .group import ContextParallelGroup, check_plain, previous_rank_only
from .ring import RingPass


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
    o = ring_forgetting_attention(q, k, v, c.float(), cp, dim**-0.5, mixer.backend)
    return mixer.output(o, gate, norms)


def ring_forgetting_attention(q, k, v, c, cp: ContextParallelGroup, scale: float, backend: str = "auto") -> torch.Tensor:
    """FoX of this rank's queries over the keys of its shard and of every earlier shard (module
    docstring); q [B,S,HQ,D], k/v [B,S,HKV,D], c [B,S,HQ] float32 the whole sequence's cumulative
    log forget at this shard's tokens. Differentiable in q, k, v and c; o in q's dtype."""
    return _RingForgettingAttention.apply(q, k, v, c, cp, scale, backend)


class _RingForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c, cp, scale, backend):
        from ...kernels.forgetting_attention.blocks import forgetting_block_attention

        o, lse = forgetting_block_attention(q, k, v, c, c, causal=True, scale=scale, backend=backend)
        o = o.float()
        # Step s: this rank holds the block of rank (rank - s) mod ranks; only earlier ranks' count.
        transfer = RingPass(cp, (k, v, c)) if cp.world_size > 1 else None
        for step in range(1, cp.world_size):
            held = transfer.wait()
            transfer = RingPass(cp, held) if step + 1 < cp.world_size else None
            if step <= cp.rank:
                o_block, lse_block = forgetting_block_attention(q, *held[:2], c, held[2], causal=False, scale=scale, backend=backend)
                merged = torch.logaddexp(lse, lse_block)
                o = o * _by_token(torch.exp(lse - merged)) + o_block.float() * _by_token(torch.exp(lse_block - merged))
                lse = merged
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, c, o, lse)
        ctx.cp, ctx.scale, ctx.backend = cp, scale, backend
        return o

    @staticmethod
    def backward(ctx, grad):
        from ...kernels.forgetting_attention.blocks import forgetting_block_attention_backward

        q, k, v, c, o, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        grad = grad.contiguous()
        delta = (grad.float() * o.float()).sum(-1).transpose(1, 2)  # rowsum(dO * O) [B, HQ, S]
        block_grads = lambda k_held, v_held, c_held, causal: forgetting_block_attention_backward(  # noqa: E731
            grad, q, k_held, v_held, c, c_held, o, lse, delta, causal=causal, scale=scale, backend=ctx.backend)
        dq, dk, dv, dc, _ = (t.float() if t is not None else None for t in block_grads(k, v, c, True))
        # Each block travels with the accumulated dK, dV, dc of the ranks it has passed.
        kv_transfer = RingPass(cp, (k, v, c)) if cp.world_size > 1 else None
        sums_transfer = None
        for step in range(1, cp.world_size):
            held = kv_transfer.wait()
            kv_transfer = RingPass(cp, held) if step + 1 < cp.world_size else None
            if sums_transfer is None:  # the block's own rank adds nothing to the sums it sends on
                sums = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in held)
            else:
                sums = sums_transfer.wait()
            if step <= cp.rank:
                dq_block, dk_block, dv_block, dc_q, dc_k = block_grads(*held, False)
                dq += dq_block
                dc += dc_q
                sums = tuple(total + part for total, part in zip(sums, (dk_block, dv_block, dc_k)))
            sums_transfer = RingPass(cp, sums)
        if sums_transfer is not None:  # after a full turn: this rank's own block's sums
            dk_others, dv_others, dc_others = sums_transfer.wait()
            dk, dv, dc = dk + dk_others, dv + dv_others, dc + dc_others
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dc, None, None, None


def _by_token(weights: torch.Tensor) -> torch.Tensor:
    """[B, HQ, S] per-row weights -> [B, S, HQ, 1], to scale outputs [B, S, HQ, D]."""
    return weights.transpose(1, 2)[..., None]
