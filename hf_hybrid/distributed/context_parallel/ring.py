"""Ring attention over a context-parallel group: causal attention (Forgetting Attention, or plain
softmax attention) of each rank's queries over the keys of its own and every earlier shard,
without any rank holding the prefix.

The keys, values and c (the cumulative log forget) of each shard travel around the ring, one
block per step (``RingPass``: point-to-point sends to the next rank, receives from the previous,
asynchronous, so a rank computes on the block it holds while the next one travels). Each rank
attends to its own block causally and to each earlier shard's block whole
(kernels/forgetting_attention/blocks.py; softmax blocks on kernels/_lse_attention.py) and merges
the partial outputs by their log-sum-exps; it holds its own block and two in transit, never the
prefix.

The backward passes the blocks around again, each with float32 accumulators of its dK, dV (and dc):
every rank adds its share (from the merged output and log-sum-exp it saved) and passes the
accumulators on; after a full turn they reach the block's own rank.

Layouts (layout.py): with contiguous shards a rank attends to every earlier rank's block whole and
lets later ones pass untouched, so the last rank does the most work. Balanced (rank r holds chunks
r and 2N-1-r): the own block is causal as one (its late chunk sees all of its early one); of an
earlier rank's block, both query chunks see its first chunk and neither its second; of a later
rank's block, the second query chunk sees both chunks. Each step is two unmasked (query chunk, key
chunk) pairs on every rank, stacked along the batch into one block call of equal lengths
(``ring_block_pairs``); fully masked pairs are never computed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .group import ContextParallelGroup
from .layout import ring_block_pairs


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
    """FoX of this rank's queries over every key at or before them (module docstring; the shard
    in ``cp``'s layout); q [B,S,HQ,D], k/v [B,S,HKV,D], c [B,S,HQ] float32 the whole sequence's cumulative
    log forget at this shard's tokens. Differentiable in q, k, v and c; o in q's dtype."""
    return _RingAttention.apply(q, k, v, c, cp, scale, backend)


def ring_softmax_attention(q, k, v, cp: ContextParallelGroup, scale: float, backend: str = "auto") -> torch.Tensor:
    """Causal softmax attention of this rank's queries over the keys of its shard and every earlier
    shard: the ring with no forgetting (no c travels). Its blocks run on PyTorch's fused attention
    kernels that return the log-sum-exp (kernels/_lse_attention.py: cuDNN or FlashAttention-2 on
    GPUs), or on their plain-PyTorch version with ``backend="reference"``. Shapes as
    ``ring_forgetting_attention``."""
    return _RingAttention.apply(q, k, v, None, cp, scale, backend)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, c, cp, scale, backend):
        own = (k, v) if c is None else (k, v, c)
        # Step s: this rank holds the block of rank (rank - s) mod ranks; ring_block_pairs says
        # which of its query rows attend to which of the block's keys (per the layout).
        transfer = RingPass(cp, own) if cp.world_size > 1 else None
        o, lse = _block(q, own, c, True, scale, backend)
        o = o.float()
        seq = q.shape[1]
        for step in range(1, cp.world_size):
            held = transfer.wait()
            transfer = RingPass(cp, held) if step + 1 < cp.world_size else None
            pairs = ring_block_pairs(cp, (cp.rank - step) % cp.world_size, seq)
            if pairs:  # the pairs stacked along the batch: one call on blocks of equal length
                q_part, c_part, held_part = _pair_inputs(q, c, held, pairs)
                o_block, lse_block = _block(q_part, held_part, c_part, False, scale, backend)
                for (rows, _), o_pair, lse_pair in zip(pairs, o_block.chunk(len(pairs)), lse_block.chunk(len(pairs))):
                    lse_rows = lse[..., rows]
                    merged = torch.logaddexp(lse_rows, lse_pair)
                    mixed = o[:, rows] * _by_token(torch.exp(lse_rows - merged)) + o_pair.float() * _by_token(torch.exp(lse_pair - merged))
                    if rows == slice(None):
                        o, lse = mixed, merged
                    else:  # o and lse are this call's own buffers
                        o[:, rows], lse[..., rows] = mixed, merged
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, c, o, lse)
        ctx.cp, ctx.scale, ctx.backend = cp, scale, backend
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, c, o, lse = ctx.saved_tensors
        cp, scale, backend = ctx.cp, ctx.scale, ctx.backend
        grad = grad.contiguous()
        delta = (grad.float() * o.float()).sum(-1).transpose(1, 2)  # rowsum(dO * O) [B, HQ, S]
        own = (k, v) if c is None else (k, v, c)
        # Each block travels with the accumulated gradients (dK, dV[, dc]) of the ranks it has passed.
        kv_transfer = RingPass(cp, own) if cp.world_size > 1 else None
        dq, dc, own_grads = _block_grads(grad, q, own, c, o, lse, delta, True, scale, backend)
        dq = dq.float()  # accumulated over the steps in float32, as the key-side sums are
        own_grads = [g.float() for g in own_grads] + ([dc] if c is not None else [])
        sums_transfer = None
        for step in range(1, cp.world_size):
            held = kv_transfer.wait()
            kv_transfer = RingPass(cp, held) if step + 1 < cp.world_size else None
            pairs = ring_block_pairs(cp, (cp.rank - step) % cp.world_size, q.shape[1])
            parts = None
            if pairs:
                q_part, c_part, held_part = _pair_inputs(q, c, held, pairs)
                o_part, grad_part = (_stacked(t, [rows for rows, _ in pairs]) for t in (o, grad))
                lse_part, delta_part = (_stacked(t.transpose(1, 2), [rows for rows, _ in pairs]).transpose(1, 2).contiguous()
                                        for t in (lse, delta))
                parts = _block_grads(grad_part, q_part, held_part, c_part, o_part, lse_part, delta_part, False, scale, backend)
            if sums_transfer is None:  # the block's own rank adds nothing to the sums it sends on
                sums = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in held)
            else:
                sums = sums_transfer.wait()  # meanwhile the block's gradients were computed
            if parts is not None:
                dq_block, dc_q, held_grads = parts
                for p, (rows, cols) in enumerate(pairs):
                    dq = _add_rows(dq, dq_block.chunk(len(pairs))[p], rows)
                    if c is not None:
                        own_grads[2] = _add_rows(own_grads[2], dc_q.chunk(len(pairs))[p], rows)
                    sums = tuple(_add_rows(total, part.float().chunk(len(pairs))[p], cols) for total, part in zip(sums, held_grads))
            sums_transfer = RingPass(cp, sums)
        if sums_transfer is not None:  # after a full turn: this rank's own block's sums
            own_grads = [g + total for g, total in zip(own_grads, sums_transfer.wait())]
        dk, dv = own_grads[0].to(k.dtype), own_grads[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, own_grads[2] if c is not None else None, None, None, None


def _block(q, held, c, causal: bool, scale: float, backend: str):
    """(o, lse [B, HQ, S] float32) of this rank's queries against one held block of keys."""
    if c is None:
        from ...kernels._lse_attention import attention_with_kind

        qt, kt, vt = (t.transpose(1, 2) for t in (q, *held))
        o, lse, _ = attention_with_kind(_softmax_kind(qt, kt, backend), qt, kt, vt, causal, scale)
        return o.transpose(1, 2), lse
    from ...kernels.forgetting_attention.blocks import forgetting_block_attention

    return forgetting_block_attention(q, held[0], held[1], c, held[2], causal=causal, scale=scale, backend=backend)


def _block_grads(grad, q, held, c, o, lse, delta, causal: bool, scale: float, backend: str):
    """(dq, dc of this rank's queries or None, gradients of the held block's tensors) of one block,
    given the merged output ``o``, its ``lse`` and ``delta``. On the diagonal the own c's whole
    gradient is in dc and the held gradients are (dK, dV)."""
    if c is None:
        from ...kernels._lse_attention import attention_with_lse_backward, rebuilt_saved

        qt, kt, vt, ot, gt = (t.transpose(1, 2) for t in (q, *held, o, grad))
        kind = _softmax_kind(qt, kt, backend)
        dq, dk, dv = attention_with_lse_backward(gt, qt, kt, vt, ot, lse, rebuilt_saved(kind, qt, kt), causal, scale)
        return dq.transpose(1, 2), None, (dk.transpose(1, 2), dv.transpose(1, 2))
    from ...kernels.forgetting_attention.blocks import forgetting_block_attention_backward

    dq, dk, dv, dc_q, dc_k = forgetting_block_attention_backward(
        grad, q, held[0], held[1], c, held[2], o, lse, delta, causal=causal, scale=scale, backend=backend)
    return dq, dc_q, (dk, dv) if dc_k is None else (dk, dv, dc_k)


def _softmax_kind(qt, kt, backend: str) -> str:
    """The plain-PyTorch kernel for ``backend="reference"``, else the fused one for the device."""
    from ...kernels._lse_attention import kernel_kind

    return "math" if backend == "reference" else kernel_kind(qt, kt)


def _stacked(t, parts: list[slice]):
    """``t``'s rows (dim 1) at each of ``parts``, stacked along the batch (``t`` itself for one whole part)."""
    if t is None or parts == [slice(None)]:
        return t
    return torch.cat([t[:, part] for part in parts], 0).contiguous()


def _pair_inputs(q, c, held, pairs):
    """This rank's queries (and their c) and the held block's tensors of each (query rows, key rows)
    pair, the pairs stacked along the batch."""
    rows, cols = [r for r, _ in pairs], [k for _, k in pairs]
    return _stacked(q, rows), _stacked(c, rows), tuple(_stacked(t, cols) for t in held)


def _add_rows(total: torch.Tensor, part: torch.Tensor, rows: slice) -> torch.Tensor:
    """``total`` with ``part`` added at ``rows`` of the sequence (dim 1); in place for a part of
    the rows (``total`` is always one of the backward's own accumulators)."""
    if rows == slice(None):
        return total + part
    total[:, rows] += part.to(total.dtype)
    return total


def _by_token(weights: torch.Tensor) -> torch.Tensor:
    """[B, HQ, S] per-row weights -> [B, S, HQ, 1], to scale outputs [B, S, HQ, D]."""
    return weights.transpose(1, 2)[..., None]
