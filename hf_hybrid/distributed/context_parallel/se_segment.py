"""SE attention of one context-parallel segment over the keys it holds, in blocks of queries.

A segment's queries attend over [received blocks ; local span] (se_hybrid.py) under the rows of
the reference mask (kernels/span_expanded_attention/reference.py). Built whole, that mask and the
scores are [queries, keys] per head: quadratic in the segment at long sequences. Here the
queries run in blocks (kernels/_query_blocks.py): ``mask_rows(lo, hi)`` builds only the rows of
queries [lo, hi), and the backward recomputes one block at a time, so memory stays linear in the
segment's length (a block's rows within ``SCORE_BUDGET`` elements).

Per block, the attention itself runs on

* ``"reference"``: :func:`masked_attention`, the readable math (scores in float32), on CPU;
* ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` with the block's boolean mask rows
  (the memory-efficient kernel on CUDA: the block's mask rows are held, never its scores), key
  heads shared by their query heads (``enable_gqa``), on CUDA.

Both compute one softmax per query over the same keys, so they differ only by rounding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

SEGMENT_BACKENDS = ("reference", "sdpa")


def segment_backend(kernel_backend: str, device: torch.device) -> str:
    """The SE layer's ``kernel_backend`` ("auto", "sdpa", "reference") -> this module's backend:
    "auto" is the fused path on CUDA and the reference elsewhere, as in the one-process layer."""
    if kernel_backend == "reference":
        return "reference"
    if kernel_backend == "sdpa" or device.type == "cuda":
        return "sdpa"
    return "reference"


def segment_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask_rows: Callable[[int, int], torch.Tensor],
    *,
    backend: str,
    scale: float | None = None,
    budget: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale + log mask) v of a segment, block by block over its queries.

    q [batch, queries, heads, dim]; keys, values [batch, keys, kv_heads, dim] (kv_heads divides
    heads); ``mask_rows(lo, hi)``: bool [queries hi - lo, keys] or [batch, heads, hi - lo, keys],
    which keys queries lo .. hi - 1 read (every query reads at least one). ``budget``: elements of
    one block's rows (default ``SCORE_BUDGET``). Differentiable in q, keys and values."""
    from ...kernels._query_blocks import attend_in_query_blocks, query_block_size
    from ...kernels.span_expanded_attention import masked_attention

    if backend not in SEGMENT_BACKENDS:
        raise ValueError(f"segment_attention: backend={backend!r} is not one of {SEGMENT_BACKENDS}.")
    if q.shape[2] % keys.shape[2]:
        raise ValueError(f"segment_attention: heads ({q.shape[2]}) must be a multiple of kv_heads ({keys.shape[2]}).")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block = query_block_size(q.shape[1], keys.shape[1], q.shape[0] * q.shape[2], budget)

    def attend(lo, q_block, k, v):
        mask = mask_rows(lo, lo + q_block.shape[1])
        if backend == "reference":
            return masked_attention(q_block, k, v, mask, scale)
        out = F.scaled_dot_product_attention(
            q_block.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=k.shape[2] != q_block.shape[2],
        )
        return out.transpose(1, 2)

    return attend_in_query_blocks(attend, [q], [keys, values], block=block, upcast=backend == "reference")
