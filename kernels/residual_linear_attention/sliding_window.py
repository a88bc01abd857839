"""Fast paths for the SWA branch: query i sees keys j with 0 <= i - j <= w (w = window_size).

* flex_attention with a block mask: tiles entirely outside the band are skipped, so the cost is
  ~ T (w + tile) instead of T^2 / 2. Compiled once per process on CUDA (eager elsewhere, which
  materialises the scores: fine for tests only). Block masks are cached per (T, w, device), built
  by a compiled builder on CUDA from EAGER_MASK_MAX_TOKENS + 1 tokens (eagerly below: no compile of
  the builder at first use); inside torch.compile(model) both are traced into the model's graph
  instead.
* SDPA with a boolean band mask: any device; and SDPA's causal kernel when the window covers the
  whole sequence (w >= T - 1), where the band is just the causal mask. On CPU it runs over blocks
  of queries, each over its band of keys with its rows of the mask (memory and work ~ T (w +
  block)); elsewhere with the dense [T, T] mask (O(T^2)).
Both take [B, T, H, D] tensors (GQA through enable_gqa) and return [B, T, H, D].
"""
from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from .._query_blocks import sdpa_in_query_blocks


def band_mask(seq: int, window_size: int, device, query_start: int = 0, num_queries: int | None = None) -> torch.Tensor:
    """[num_queries, seq] bool (num_queries defaults to seq), True where 0 <= i - j <= window_size,
    for queries i = query_start .. query_start + num_queries - 1 and keys j = 0 .. seq - 1."""
    num_queries = seq - query_start if num_queries is None else num_queries
    i = torch.arange(query_start, query_start + num_queries, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (i - j <= window_size)


def sliding_window_attention_sdpa(q, k, v, window_size: int, scale: float | None = None) -> torch.Tensor:
    seq = q.shape[1]
    gqa = q.shape[2] != k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if window_size >= seq - 1:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.device.type == "cpu" and not torch.compiler.is_compiling():
        return sdpa_in_query_blocks(
            q, k, v, lambda start, end, lo, hi: band_mask(hi, window_size, q.device, start, end - start)[:, lo:],
            key_start=lambda start: max(0, start - window_size), scale=scale, enable_gqa=gqa,
        )
    else:
        mask = band_mask(seq, window_size, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


# Up to this length the block mask is built eagerly: its [seq, seq] grid is small (16M elements at
# 4K), while compiling the builder costs a first use seconds of torch.compile.
EAGER_MASK_MAX_TOKENS = 4096


def compiles_mask_builder(seq: int, device) -> bool:
    """Whether the block mask of a ``seq``-token band is built by a compiled builder: on CUDA past
    EAGER_MASK_MAX_TOKENS, and never inside torch.compile (the outer compile traces the builder)."""
    return torch.device(device).type == "cuda" and seq > EAGER_MASK_MAX_TOKENS and not torch.compiler.is_compiling()


def _build_block_mask(seq: int, window_size: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def in_band(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window_size)

    # Eagerly, create_block_mask evaluates in_band over the whole [seq, seq] grid (128 GiB at 128K
    # tokens); compiled, it builds the block lists without that grid. The same BlockMask either way.
    return create_block_mask(in_band, None, None, seq, seq, device=device,
                             _compile=compiles_mask_builder(seq, device))


_block_mask = functools.lru_cache(maxsize=32)(_build_block_mask)  # eager: one mask per (T, w, device string)


@functools.lru_cache(maxsize=2)
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def sliding_window_attention_flex(q, k, v, window_size: int, scale: float | None = None) -> torch.Tensor:
    seq = q.shape[1]
    if torch.compiler.is_compiling():
        # Inside torch.compile(model): the mask construction is traced into the graph (no cache
        # lookup, no nested compile) and the outer compile builds flex_attention's kernels.
        from torch.nn.attention.flex_attention import flex_attention as flex

        block_mask = _build_block_mask(seq, window_size, q.device)
    else:
        flex = _flex(q.device.type == "cuda")
        block_mask = _block_mask(seq, window_size, str(q.device))
    out = flex(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
