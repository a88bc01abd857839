"""RAT's attention over chunk ends on PyTorch's dense fused attention (cuDNN on Hopper).

In RAT's geometry (block ends + the token's own key; no window, no sinks) every query of chunk c
sees exactly the ends of chunks 0 .. c - 1, whatever its offset r in the chunk. So, for a fixed r,
queries c' = 1 .. C - 1 against ends 0 .. C - 2 form a *causal* attention of length E = C - 1
(query c' at index c' - 1 sees ends <= c' - 1), and the L offsets share those keys: one causal
grouped-query attention with H * L query heads (head h * L + r reads key head h) and H key heads:

    q_slots[b, h L + r, c - 1] = q[b, c L + r, h % G]           c = 1 .. C - 1  (_gather_queries)
    o_a, lse_a = softmax attention(q_slots, ends of k, ends of v), causal     (cuDNN / flash)
    merged with the own pair by log-sum-exp                                   (_merge_kernel)

The backward calls the dense kernel's backward with the *merged* output and log-sum-exp, which
gives exactly the ends' share of the gradient (kernels/_lse_attention.py); row kernels add the own
pair's share and the output gate's. cuDNN's causal attention runs at about twice the speed of
the generic Triton kernels in triton.py here, row kernels included the op is faster from 1024 chunk
ends (`python -m benchmarks.rat_ends_ab`; docs/benchmarks/rat.md).

Used for fp16 / bf16 on CUDA when the dense kernel passed its self-check; fp32 and the other
geometries (RAT+ windows and sinks) keep the Triton kernels. Off CUDA the same path runs on
PyTorch's CPU flash kernel and the Triton interpreter (tests).
"""
from __future__ import annotations

import torch

from .._lse_attention import attention_with_kind, attention_with_lse_backward, kernel_kind, path_switch, rebuilt_saved
from .._custom_ops import fake_like, kernel_op, optional, placeholder
from .reference import chunk_ends
from .._common import leading_strides as _strides

# "triton": RAT's ends always on the Triton kernels; "sdpa": on this path from any length (A/B timings)
ENV_SWITCH = "HF_HYBRID_BLOCK_ENDS"
_HEAD_DIMS = (64, 128)
# Fewer chunk ends than this stay on the Triton kernels under "auto": below it the dense call and
# its row kernels cost more than they save (`python -m benchmarks.rat_ends_ab`).
MIN_ENDS = 1024


def applies(q: torch.Tensor, k: torch.Tensor, block_size: int, local_window: int, num_sink_tokens: int) -> bool:
    """Whether ``block_end_attention``'s automatic choice takes this path on CUDA."""
    switch = path_switch(ENV_SWITCH)
    if switch == "triton" or not q.is_cuda:
        return False
    if local_window or num_sink_tokens or q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
        return False
    min_ends = 2 if switch == "sdpa" else MIN_ENDS
    if q.shape[-1] not in _HEAD_DIMS or _num_slots(k.shape[1], block_size) < min_ends:
        return False
    return kernel_kind(q.transpose(1, 2)) == "cudnn"  # [batch, heads, len, dim], as the dense call sees it


def _num_slots(seq: int, block_size: int) -> int:
    return -(-seq // block_size) - 1


def _ends(x: torch.Tensor, block_size: int, num_slots: int) -> torch.Tensor:
    """[B, E, H, D] ends of chunks 0 .. E - 1 as [B, H, E, D] (a view)."""
    return chunk_ends(x, block_size)[:, :num_slots].transpose(1, 2)


def _launch(seq: int, rows: int):
    """(grid, launch options) of the row kernels: every (row, tile of BLOCK_T tokens) pair on grid
    axis 0, tiles fastest (rows = batch x heads passes axis 1's limit of 65,535 at large batch)."""
    from .sdpa_ends_triton import BLOCK_T, WARPS

    return (-(-seq // BLOCK_T) * rows,), dict(BLOCK_T=BLOCK_T, num_warps=WARPS)


def _query_slots(q: torch.Tensor, heads: int, block_size: int, num_slots: int) -> torch.Tensor:
    from .sdpa_ends_triton import _gather_queries_kernel

    batch, seq, groups, dim = q.shape
    slots = q.new_empty(batch, heads * block_size, num_slots, dim)
    grid, meta = _launch(num_slots * block_size, batch * heads)
    _gather_queries_kernel[grid](q, slots, *_strides(q), seq, heads, groups, block_size, num_slots, HEAD_DIM=dim, **meta)
    return slots


def _check(q, k, v, output_gate, block_size) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("output_gate", output_gate)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"block_end_attention (sdpa): {name} needs a unit stride in head_dim; got {t.stride()}.")
    if k.shape[1] <= block_size:
        raise ValueError(f"block_end_attention (sdpa): needs more than block_size={block_size} tokens (no chunk ends otherwise).")


@kernel_op("block_end_attention_sdpa_fwd")
def block_end_attention_sdpa_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output_gate: torch.Tensor | None, block_size: int, scale: float,
    store_merged: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, merged output in the slot layout [B, H L, E, D], merged lse [B, H L, E]). q [B, T, G, D]
    (head h reads q head h % G); k, v, output_gate [B, T, H, D]. ``store_merged`` False (no backward
    follows): the last two hold the ends' partial results instead, and the merge writes y only."""
    from .sdpa_ends_triton import _merge_kernel

    _check(q, k, v, output_gate, block_size)
    batch, seq, heads, dim = k.shape
    num_slots = _num_slots(seq, block_size)
    slots = _query_slots(q, heads, block_size, num_slots)
    out_slots, lse, _ = attention_with_kind(
        kernel_kind(slots), slots, _ends(k, block_size, num_slots), _ends(v, block_size, num_slots), True, scale
    )
    out_slots, lse = out_slots.contiguous(), lse.contiguous()
    y = torch.empty(batch, seq, heads, dim, device=q.device, dtype=q.dtype)
    z = v if output_gate is None else output_gate
    grid, meta = _launch(seq, batch * heads)
    _merge_kernel[grid](
        q, k, v, z, out_slots, lse, y, *_strides(q), *_strides(k), *_strides(v), *_strides(z), *_strides(y),
        seq, heads, q.shape[2], block_size, num_slots, scale, HAS_GATE=output_gate is not None,
        STORE_MERGED=store_merged, HEAD_DIM=dim, **meta,
    )
    return y, out_slots, lse


@block_end_attention_sdpa_fwd.register_fake
def _(q, k, v, output_gate, block_size, scale, store_merged=True):
    batch, seq, heads, dim = k.shape
    num_slots = _num_slots(seq, block_size)
    y = torch.empty(batch, seq, heads, dim, device=q.device, dtype=q.dtype)
    out_slots = q.new_empty(batch, heads * block_size, num_slots, dim)
    return y, out_slots, torch.empty(batch, heads * block_size, num_slots, device=q.device, dtype=torch.float32)


@kernel_op("block_end_attention_sdpa_bwd")
def block_end_attention_sdpa_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output_gate: torch.Tensor | None, out_slots: torch.Tensor,
    lse: torch.Tensor, dy: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d output_gate or a placeholder)."""
    from .sdpa_ends_triton import _dq_kernel, _own_backward_kernel

    batch, seq, heads, dim = k.shape
    groups = q.shape[2]
    num_slots = _num_slots(seq, block_size)
    dy = dy.contiguous()
    dk, dv = torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)
    dz = torch.empty_like(dk) if output_gate is not None else placeholder(q)
    z = v if output_gate is None else output_gate
    dout_slots = torch.empty_like(out_slots)
    open_tail = seq - num_slots * block_size  # tokens of the last chunk, when it is open (< L)
    if open_tail < block_size:  # its missing tokens' slots (zero queries) must pass no gradient
        dout_slots.view(batch, heads, block_size, num_slots, dim)[:, :, open_tail:, -1].zero_()
    ds = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)
    grid, meta = _launch(seq, batch * heads)
    _own_backward_kernel[grid](
        q, k, v, z, out_slots, lse, dy, dout_slots, dz if output_gate is not None else dk, dk, dv, ds,
        *_strides(q), *_strides(k), *_strides(v), *_strides(z), *_strides(dy),
        seq, heads, groups, block_size, num_slots, scale, HAS_GATE=output_gate is not None, HEAD_DIM=dim, **meta,
    )
    slots = _query_slots(q, heads, block_size, num_slots)
    k_ends, v_ends = _ends(k, block_size, num_slots), _ends(v, block_size, num_slots)
    saved = rebuilt_saved(kernel_kind(slots), slots, k_ends)
    dslots, dk_ends, dv_ends = attention_with_lse_backward(
        dout_slots, slots, k_ends, v_ends, out_slots, lse, saved, True, scale
    )
    _ends(dk, block_size, num_slots).add_(dk_ends)
    _ends(dv, block_size, num_slots).add_(dv_ends)
    dq = torch.empty(batch, seq, groups, dim, device=q.device, dtype=q.dtype)
    grid, meta = _launch(seq, batch * groups)
    _dq_kernel[grid](k, ds, dslots.contiguous(), dq, *_strides(k), seq, heads, groups, block_size, num_slots, scale,
                     HEAD_DIM=dim, **meta)
    return dq, dk, dv, dz


@block_end_attention_sdpa_bwd.register_fake
def _(q, k, v, output_gate, out_slots, lse, dy, block_size, scale):
    return fake_like(q, k, v, output_gate)


def _setup(ctx, inputs, output):
    q, k, v, gate, block_size, scale, _store_merged = inputs
    _, out_slots, lse = output
    ctx.save_for_backward(q, k, v, gate, out_slots, lse)
    ctx.args = (block_size, scale)
    ctx.set_materialize_grads(False)  # out_slots and lse feed nothing: no zero-filled gradients for them


def _backward(ctx, dy, _dout_slots, _dlse):
    if dy is None:
        return (None,) * 7
    q, k, v, gate, out_slots, lse = ctx.saved_tensors
    dq, dk, dv, dgate = block_end_attention_sdpa_bwd(q, k, v, gate, out_slots, lse, dy, *ctx.args)
    return dq, dk, dv, optional(dgate, gate is not None), None, None, None


block_end_attention_sdpa_fwd.register_autograd(_backward, setup_context=_setup)

