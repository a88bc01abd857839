"""Ring attention over a context-parallel group: causal attention (Forgetting Attention, or plain
softmax attention as its case c = 0) of each rank's queries over the keys of its own and every
earlier shard, without any rank holding the prefix.

The keys, values and c (the cumulative log forget) of each shard travel around the ring, one
block per step (``RingPass``: point-to-point sends to the next rank, receives from the previous,
asynchronous, so a rank computes on the block it holds while the next one travels). Each rank
attends to its own block causally and to each earlier shard's block whole
(kernels/forgetting_attention/blocks.py) and merges the partial outputs by their log-sum-exps; it
holds its own block and two in transit, never the prefix.

The backward passes the blocks around again, each with float32 accumulators of its dK, dV and dc:
every rank adds its share (from the merged output and log-sum-exp it saved) and passes the
accumulators on; after a full turn they reach the block's own rank. Later shards' blocks pass
through a rank untouched, so with contiguous shards the last rank does the most work (a balanced
"two chunks per rank" layout would change every mixer's sharding; not done).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .group import ContextParallelGroup


class RingPass:
    """One step's transfer: ``send`` goes to the next rank, tensors shaped like ``send`` come from
    the previous one; ``wait()`` returns them once they have arrived (and ``send`` has left)."""

    def __init__(self, cp: ContextParallelGroup, send: tuple[torch.Tensor, ...]):
        following = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.world_size)
        preceding = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.world_size)
        send = tuple(t.contiguous() for t in send)
        self._received = tuple(torch.empty_like(t) for t in send)
        ops = [dist.P2POp(dist.isend, t, following, cp.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, preceding, cp.group) for t in self._received]
        self._send = send  # kept alive until the transfer is done
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[torch.Tensor, ...]:
        for request in self._requests:
            request.wait()
        self._send = None
        return self._received


def ring_forgetting_attention(q, k, v, c, cp: ContextParallelGroup, scale: float, backend: str = "auto") -> torch.Tensor:
    """FoX of this rank's queries over the keys of its shard and of every earlier shard (module
    docstring); q [B,S,HQ,D], k/v [B,S,HKV,D], c [B,S,HQ] float32 the whole sequence's cumulative
    log forget at this shard's tokens. Differentiable in q, k, v and c; o in q's dtype."""
    return _RingForgettingAttention.apply(q, k, v, c, cp, scale, backend)


def ring_softmax_attention(q, k, v, cp: ContextParallelGroup, scale: float, backend: str = "auto") -> torch.Tensor:
    """Causal softmax attention of this rank's queries over the keys of its shard and every earlier
    shard: the ring with no forgetting (c = 0). Shapes as ``ring_forgetting_attention``."""
    no_forgetting = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    return _RingForgettingAttention.apply(q, k, v, no_forgetting, cp, scale, backend)


class _RingForgettingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c, cp, scale, backend):
        from ...kernels.forgetting_attention.blocks import forgetting_block_attention

        # Step s: this rank holds the block of rank (rank - s) mod ranks; only earlier ranks' count.
        transfer = RingPass(cp, (k, v, c)) if cp.world_size > 1 else None
        o, lse = forgetting_block_attention(q, k, v, c, c, causal=True, scale=scale, backend=backend)
        o = o.float()
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
        # Each block travels with the accumulated dK, dV, dc of the ranks it has passed.
        kv_transfer = RingPass(cp, (k, v, c)) if cp.world_size > 1 else None
        dq, dk, dv, dc, _ = (t.float() if t is not None else None for t in block_grads(k, v, c, True))
        sums_transfer = None
        for step in range(1, cp.world_size):
            held = kv_transfer.wait()
            kv_transfer = RingPass(cp, held) if step + 1 < cp.world_size else None
            parts = block_grads(*held, False) if step <= cp.rank else None  # while the sums travel
            if sums_transfer is None:  # the block's own rank adds nothing to the sums it sends on
                sums = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in held)
            else:
                sums = sums_transfer.wait()
            if parts is not None:
                dq_block, dk_block, dv_block, dc_q, dc_k = parts
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
