"""Attention-like references run block by block over the query axis, so memory grows linearly in T.

A reference states its op as one dense score matrix (queries x keys). At T = 16K that matrix is
1 GB per head group in float32, and autograd keeps several of them for the backward. The helpers
here run the *same* function on blocks of queries instead, never holding more than one block's
scores (``SCORE_BUDGET`` elements):

* :func:`attend_in_query_blocks` runs a differentiable reference block by block. Its backward
  recomputes each block's forward and differentiates it alone (the activation-checkpoint pattern,
  one block at a time), accumulating the gradients of the shared inputs in float32 like the dense
  reference does, then casting once. Row-wise ops (softmax per query) give the same rows; only the
  summation order of the shared inputs' gradients differs.
* :func:`sdpa_in_query_blocks` runs ``scaled_dot_product_attention`` with a boolean mask block by
  block the same way, building only the block's mask rows over the keys it can see (PyTorch's CPU
  kernel is memory-efficient without a mask, but a dense [T, T] mask is 256 MB as bool and 1 GB
  once turned into float32).

When one block holds every query the function is called once, exactly as before.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from .._compat.glibc_malloc import keep_large_blocks_out_of_the_heap

# Elements of one block's score matrix (batch x heads x queries x keys): 32 MB in float32. The
# reference keeps a few tensors of that size alive per block (scores, mask, probabilities).
SCORE_BUDGET = 1 << 23


def query_block_size(num_queries: int, num_keys: int, batch_heads: int, budget: int | None = None) -> int:
    """Queries per block so that batch_heads x block x num_keys stays within ``budget`` (default
    SCORE_BUDGET, read at the call) and at least 1."""
    budget = SCORE_BUDGET if budget is None else budget
    return max(1, min(num_queries, budget // max(1, batch_heads * num_keys)))


def _blocks(num_queries: int, block: int):
    return [(start, min(start + block, num_queries)) for start in range(0, num_queries, block)]


def _pieces(tensors, start: int, end: int, num_per_query: int, causal: bool):
    """The block's slices: per-query tensors at [start, end), shared ones whole or, causal, up to end."""
    per_query = [t[:, start:end] for t in tensors[:num_per_query]]
    shared = [t[:, :end] if causal else t for t in tensors[num_per_query:]]
    return per_query + shared


class _QueryBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attend, block, causal, upcast, num_per_query, *tensors):
        ctx.attend, ctx.block, ctx.causal, ctx.num_per_query = attend, block, causal, num_per_query
        ctx.upcast = upcast
        ctx.save_for_backward(*tensors)
        num_queries = tensors[0].shape[1]
        outs = [attend(start, *_pieces(tensors, start, end, num_per_query, causal)) for start, end in _blocks(num_queries, block)]
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]
        # float32 (float64 for float64) accumulators: a 16-bit input's gradient is rounded once, at the end.
        grads = [torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device) if need else None
                 for t, need in zip(tensors, needs)]
        for start, end in _blocks(tensors[0].shape[1], ctx.block):
            pieces = _pieces(tensors, start, end, ctx.num_per_query, ctx.causal)
            # Leaves in the accumulation dtype: the references upcast first, so the forward values are
            # the same and the gradients come back unrounded.
            leaves = [(p.detach().to(g.dtype) if ctx.upcast else p.detach()).requires_grad_() if g is not None else p
                      for p, g in zip(pieces, grads)]
            with torch.enable_grad():
                out = ctx.attend(start, *leaves)
            wanted = [leaf for leaf, g in zip(leaves, grads) if g is not None]
            got = iter(torch.autograd.grad(out, wanted, grad_out[:, start:end].to(out.dtype), allow_unused=True))
            for index, g in enumerate(grads):
                if g is None:
                    continue
                piece_grad = next(got)
                if piece_grad is None:
                    continue
                if index < ctx.num_per_query:
                    g[:, start:end] += piece_grad
                else:
                    g[:, : piece_grad.shape[1]] += piece_grad  # causal: the keys up to the block's end
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors)]
        return (None, None, None, None, None, *grads)


def attend_in_query_blocks(
    attend: Callable[..., torch.Tensor],
    per_query: Sequence[torch.Tensor],
    shared: Sequence[torch.Tensor],
    *,
    block: int,
    causal: bool = False,
    upcast: bool = True,
) -> torch.Tensor:
    """``attend(query_start, *per_query_block, *shared)`` over blocks of ``block`` queries, concatenated.

    per_query: tensors [batch, num_queries, ...] sliced to the block along dim 1 (integer tensors
    such as chunk indices too); shared: tensors [batch, num_keys, ...] every block reads (with
    ``causal``, queries and keys aligned, only keys [0, block end) are passed). ``attend`` must be a
    pure function of its tensor arguments that upcasts them before computing (the references do),
    returning [batch, block, ...]. Differentiable in every floating input. ``upcast=False``
    recomputes the backward in the inputs' dtype (for fused kernels that compute in it).
    """
    num_queries = per_query[0].shape[1]
    if block >= num_queries:
        return attend(0, *per_query, *shared)
    if per_query[0].device.type == "cpu":
        keep_large_blocks_out_of_the_heap()
    return _QueryBlocks.apply(attend, block, causal, upcast, len(per_query), *per_query, *shared)


def sdpa_in_query_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_rows: Callable[[int, int, int, int], torch.Tensor],
    *,
    key_start: Callable[[int], int] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    budget: int | None = None,
) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` with a boolean mask, block by block over the queries.

    q [B, Tq, H, D], k/v [B, Tk, Hkv, D] with queries and keys aligned (query t is key t; the
    kernels' layout, not SDPA's). ``mask_rows(start, end, lo, hi)`` gives the mask of queries
    [start, end) over keys [lo, hi), broadcastable to [B, H, end - start, hi - lo]; a block reads
    keys from ``key_start(start)`` (default 0: a band's first key) to its last query. Each block's
    SDPA runs once in the forward and again in the backward, so only q, k, v are kept.
    """
    block = query_block_size(q.shape[1], k.shape[1], q.shape[0] * q.shape[2], budget)

    def attend(start, q_block, k_seen, v_seen):
        end = start + q_block.shape[1]
        lo = 0 if key_start is None else key_start(start)
        out = F.scaled_dot_product_attention(
            q_block.transpose(1, 2), k_seen[:, lo:].transpose(1, 2), v_seen[:, lo:].transpose(1, 2),
            attn_mask=mask_rows(start, end, lo, end), scale=scale, enable_gqa=enable_gqa,
        )
        return out.transpose(1, 2)

    return attend_in_query_blocks(attend, [q], [k, v], block=block, causal=True, upcast=False)
