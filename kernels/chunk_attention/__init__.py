"""Attention over block/chunk ends plus the token's own key (RAT inter-chunk attention, RAT+ dilation)."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from ..gated_recurrence.rat_keys_values import expand_groups
from ..output_gate import sigmoid_gate_reference
from .reference import (
    block_end_attention_reference,
    block_end_mask,
    chunk_end_attention_reference,
    chunk_end_mask,
    chunk_ends,
    query_chunk_index,
)

__all__ = [
    "block_end_attention",
    "block_end_attention_reference",
    "block_end_mask",
    "chunk_end_attention",
    "chunk_end_attention_reference",
    "chunk_end_mask",
    "chunk_ends",
    "query_chunk_index",
]


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_fits(q: torch.Tensor) -> bool:
    """Shapes the Triton kernels take: head_dim a power of two in [16, 256], a float dtype."""
    head_dim = q.shape[-1]
    return q.dtype in _TRITON_DTYPES and 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"{op}: q, k, v must all be [batch, seq, heads, head_dim] with equal shapes; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )


def _shares_query_heads(op: str, q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when q [batch, seq, G, head_dim] holds fewer heads than k, G a divisor (checked here)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] == k.shape[2]:
        return False
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] == 0 or k.shape[2] % q.shape[2]:
        raise ValueError(
            f"{op}: q must be [batch, seq, heads, head_dim] like k {tuple(k.shape)}, or hold a divisor of its "
            f"heads (shared query heads); got {tuple(q.shape)}."
        )
    return True


def chunk_end_attention(
    q: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    k_ends: torch.Tensor,
    v_ends: torch.Tensor,
    chunk_size: int | None = None,
    start_position: int = 0,
    scale: float | None = None,
    backend: str = "auto",
    query_chunk: torch.Tensor | None = None,
) -> torch.Tensor:
    """RAT inter-chunk attention in its compact form (T x C scores): see reference.py for the math.

    q/k_own/v_own [batch, seq, heads, head_dim]; k_ends/v_ends [batch, chunks, heads, head_dim]
    hold the end of chunk i at index i (from the cache, the current segment, or both). Give the
    queries' chunks either as ``query_chunk`` [batch, seq] (per row: left padding, caches) or as
    ``chunk_size`` + ``start_position`` (all rows at positions start_position + t).

    "auto" runs the Triton kernels on CUDA when head_dim is a power of two in [16, 256] (the
    single-query streaming decode kernel when seq = 1 and no gradient is needed), else the reference.
    """
    _check_qkv("chunk_end_attention", q, k_own, v_own)
    if k_ends.shape != v_ends.shape or k_ends.shape[::2] != q.shape[::2] or k_ends.shape[3] != q.shape[3]:
        raise ValueError(
            f"chunk_end_attention: k_ends/v_ends must be [batch, chunks, heads, head_dim] matching q "
            f"{tuple(q.shape)}; got {tuple(k_ends.shape)}, {tuple(v_ends.shape)}."
        )
    if query_chunk is None:
        if chunk_size is None or chunk_size < 1:
            raise ValueError(f"chunk_end_attention: pass query_chunk, or chunk_size >= 1 (got {chunk_size}).")
        query_chunk = query_chunk_index(q.shape[0], q.shape[1], chunk_size, start_position, q.device)
    elif query_chunk.shape != q.shape[:2]:
        raise ValueError(f"chunk_end_attention: query_chunk must be [batch, seq] = {tuple(q.shape[:2])}, got {tuple(query_chunk.shape)}.")
    impl = resolve_backend(backend, q.device, "chunk_end_attention")
    if impl == "triton" and (backend == "triton" or _triton_fits(q)):
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k_own, v_own, k_ends, v_ends)
        )
        if q.shape[1] == 1 and not needs_grad:
            from .decode import chunk_end_decode_triton

            return chunk_end_decode_triton(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)
        from .triton import chunk_end_attention_triton

        return chunk_end_attention_triton(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)
    return chunk_end_attention_reference(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)


def block_end_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    local_window: int = 0,
    num_sink_tokens: int = 0,
    scale: float | None = None,
    backend: str = "auto",
    output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention where query i sees key j iff (j+1) % block_size == 0, i - j <= local_window,
    or j < num_sink_tokens (see :func:`block_end_mask`). q, k, v [batch, seq, heads, head_dim];
    q may instead hold G heads, G dividing k's heads, shared as in RAT (head h uses q head h % G):
    the Triton forward reads them in place. output_gate (k's shape, optional): the result is
    sigmoid(output_gate) * attention (RAT's z gate), applied in the Triton forward's epilogue, its
    gradient computed by the Triton backward's row-wise kernel."""
    grouped = _shares_query_heads("block_end_attention", q, k)
    _check_qkv("block_end_attention", k if grouped else q, k, v)
    if output_gate is not None and output_gate.shape != k.shape:
        raise ValueError(f"block_end_attention: output_gate must have k's shape {tuple(k.shape)}; got {tuple(output_gate.shape)}.")
    if block_size < 1:
        raise ValueError(f"block_end_attention: block_size (dilation) must be >= 1, got {block_size}.")
    if local_window < 0 or num_sink_tokens < 0:
        raise ValueError(
            f"block_end_attention: local_window ({local_window}) and num_sink_tokens ({num_sink_tokens}) must be >= 0."
        )
    impl = resolve_backend(backend, q.device, "block_end_attention")
    if impl == "triton" and (backend == "triton" or _triton_fits(q)):
        from .triton import block_end_attention_triton

        return block_end_attention_triton(q, k, v, block_size, local_window, num_sink_tokens, scale, output_gate)
    if grouped:
        q = expand_groups(q, k.shape[2])
    out = block_end_attention_reference(q, k, v, block_size, local_window, num_sink_tokens, scale)
    return out if output_gate is None else sigmoid_gate_reference(output_gate, out)
