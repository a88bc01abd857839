"""Attention over block/chunk ends plus the token's own key (RAT inter-chunk attention, RAT+ dilation)."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._query_blocks import attend_in_query_blocks, query_block_size
from .._custom_ops import KernelContext, fake_like, kernel_op, needs_grad, optional, placeholder
from .._common import expand_groups, last_dim_contiguous
from ..output_gate import sigmoid_gate_reference
from .rat_plus_decode import StoreLayout, rat_plus_decode_step_reference
from .sdpa_ends import _HEAD_DIMS as _SDPA_HEAD_DIMS
from .sdpa_ends import applies as sdpa_applies
from .sdpa_ends import block_end_attention_sdpa_fwd
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
    "chunk_end_attention_query_blocks",
    "chunk_end_attention_reference",
    "chunk_end_mask",
    "chunk_ends",
    "query_chunk_index",
    "rat_decode_step",
    "rat_plus_decode_step",
    "rat_plus_decode_step_reference",
    "StoreLayout",
]


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_fits(q: torch.Tensor) -> bool:
    """Shapes the Triton kernels take: head_dim a power of two in [16, 256], a float dtype."""
    head_dim = q.shape[-1]
    return q.dtype in _TRITON_DTYPES and 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)


def _check_triton_head_dim(op: str, q: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"{op}: the Triton kernel needs head_dim a power of two in [16, 256], got {head_dim}; pass backend='reference'."
        )


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
        _check_triton_head_dim("chunk_end_attention", q)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        if q.shape[1] == 0:
            return q.clone()
        if q.shape[1] == 1 and not needs_grad(q, k_own, v_own, k_ends, v_ends):
            return chunk_end_decode(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)
        return chunk_end_attention_fwd(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)[0]
    return chunk_end_attention_query_blocks(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)


def chunk_end_attention_query_blocks(q, k_own, v_own, k_ends, v_ends, query_chunk, scale=None,
                                     query_block: int | None = None) -> torch.Tensor:
    """:func:`chunk_end_attention_reference` over blocks of ``query_block`` queries (default: a
    block's T x C scores within _query_blocks.SCORE_BUDGET), so memory grows linearly in T."""
    seq = q.shape[1]
    block = query_block_size(seq, k_ends.shape[1] + 1, q.shape[0] * q.shape[2]) if query_block is None else query_block

    def attend(start, q_block, k_block, v_block, chunk_block, k_ends, v_ends):
        return chunk_end_attention_reference(q_block, k_block, v_block, k_ends, v_ends, chunk_block, scale)

    return attend_in_query_blocks(attend, [q, k_own, v_own, query_chunk], [k_ends, v_ends], block=block)


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
    gradient computed by the Triton backward's row-wise kernel.

    backend "auto" on CUDA runs RAT's geometry (no window, no sinks) in fp16 / bf16 as one causal
    cuDNN attention over the chunk ends plus row kernels (sdpa_ends.py), everything else on the
    Triton kernels; "sdpa" asks for that path on any device (CPU: PyTorch's flash kernel and the
    Triton interpreter; float32 on CUDA: plain PyTorch attention that materialises the scores, for
    tests), "triton" for the Triton kernels."""
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
    impl = resolve_backend(backend, q.device, "block_end_attention", extra=("sdpa",))
    if impl == "sdpa" or (backend == "auto" and impl == "triton" and sdpa_applies(
            q, k, block_size, local_window, num_sink_tokens)):
        return _block_end_attention_sdpa(q, k, v, output_gate, block_size, local_window, num_sink_tokens, scale)
    if impl == "triton" and (backend == "triton" or _triton_fits(q)):
        _check_triton_head_dim("block_end_attention", q)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        if q.shape[1] == 0:
            return q.new_empty(k.shape)
        store_ungated = output_gate is not None and needs_grad(q, k, v, output_gate)
        return block_end_attention_fwd(
            q, k, v, output_gate, int(block_size), int(local_window), int(num_sink_tokens), scale, store_ungated
        )[0]
    if grouped:
        q = expand_groups(q, k.shape[2])
    out = block_end_attention_reference(q, k, v, block_size, local_window, num_sink_tokens, scale)
    return out if output_gate is None else sigmoid_gate_reference(output_gate, out)


def _block_end_attention_sdpa(q, k, v, output_gate, block_size, local_window, num_sink_tokens, scale):
    if local_window or num_sink_tokens:
        raise ValueError(
            "block_end_attention: backend='sdpa' covers RAT's geometry only (local_window=0, num_sink_tokens=0); "
            f"got local_window={local_window}, num_sink_tokens={num_sink_tokens}. Pass backend='triton' or 'auto'."
        )
    if q.shape[-1] not in _SDPA_HEAD_DIMS:
        raise ValueError(f"block_end_attention: backend='sdpa' supports head_dim in {_SDPA_HEAD_DIMS}; got {q.shape[-1]}.")
    if k.shape[1] <= block_size:  # no chunk ends: the own pair alone
        out = v if output_gate is None else v * torch.sigmoid(output_gate.float()).to(v.dtype)
        return out.clone() if output_gate is None else out
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if output_gate is not None and output_gate.stride(-1) != 1:
        output_gate = output_gate.contiguous()
    store_merged = needs_grad(q, k, v, output_gate)  # what only a backward reads
    return block_end_attention_sdpa_fwd(q, k, v, output_gate, int(block_size), scale, store_merged)[0]


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


def _block_geometry(seq: int, block_size: int, local_window: int, num_sink_tokens: int):
    from .triton import _Geometry

    return _Geometry(False, seq // block_size, block_size, local_window, num_sink_tokens, num_sink_tokens // block_size)


def _attention_fakes(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, T, heads, D] in q's dtype and the float32 log-sum-exp [B, heads, T]."""
    batch, seq, heads, head_dim = q.shape[0], q.shape[1], k.shape[2], q.shape[3]
    out = torch.empty(batch, seq, heads, head_dim, dtype=q.dtype, device=q.device)
    return out, torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)


@kernel_op("block_end_attention_fwd")
def block_end_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output_gate: torch.Tensor | None,
    block_size: int, local_window: int, num_sink_tokens: int, scale: float, store_ungated: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, ungated attention or a placeholder): the ungated attention is written next to the
    gated output only for a gated backward (``store_ungated``)."""
    from .triton import _BlockEndAttention

    ctx = KernelContext(needs_input_grad=(store_ungated,))
    out = _BlockEndAttention.forward(ctx, q, k, v, block_size, local_window, num_sink_tokens, scale, output_gate)
    saved_out, lse = ctx.saved_tensors[3:5]
    return out, lse, saved_out if output_gate is not None and store_ungated else placeholder(q)


@block_end_attention_fwd.register_fake
def _(q, k, v, output_gate, block_size, local_window, num_sink_tokens, scale, store_ungated):
    out, lse = _attention_fakes(q, k)
    ungated = torch.empty_like(out) if output_gate is not None and store_ungated else placeholder(q)
    return out, lse, ungated


@kernel_op("block_end_attention_bwd")
def block_end_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output_gate: torch.Tensor | None, out: torch.Tensor,
    lse: torch.Tensor, dout: torch.Tensor, block_size: int, local_window: int, num_sink_tokens: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d output_gate or a placeholder); ``out``: the ungated attention when gated."""
    from .triton import _BlockEndAttention

    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    saved = (q, k, v, out, lse) + (() if output_gate is None else (last_dim_contiguous(output_gate),))
    geo = _block_geometry(q.shape[1], block_size, local_window, num_sink_tokens)
    grads = _BlockEndAttention.backward(KernelContext(saved, geo=geo, scale=scale), dout)
    dgate = grads[-1]
    return grads[0], grads[1], grads[2], placeholder(q) if dgate is None else dgate


@block_end_attention_bwd.register_fake
def _(q, k, v, output_gate, out, lse, dout, block_size, local_window, num_sink_tokens, scale):
    return fake_like(q, k, v, output_gate)


def _block_end_setup(ctx, inputs, output):
    q, k, v, gate, block_size, local_window, num_sink_tokens, scale, store_ungated = inputs
    out, lse, ungated = output
    ctx.save_for_backward(q, k, v, gate, out if gate is None else ungated, lse)
    ctx.args = (block_size, local_window, num_sink_tokens, scale)
    ctx.set_materialize_grads(False)  # lse and the ungated copy feed nothing: no zero-filled gradients


def _block_end_backward(ctx, dout, _dlse, _dungated):
    if dout is None:
        return (None,) * 9
    q, k, v, gate, out, lse = ctx.saved_tensors
    dq, dk, dv, dgate = block_end_attention_bwd(q, k, v, gate, out, lse, dout, *ctx.args)
    return dq, dk, dv, optional(dgate, gate is not None), None, None, None, None, None


block_end_attention_fwd.register_autograd(_block_end_backward, setup_context=_block_end_setup)


def _chunk_end_inputs(q, k_own, v_own, k_ends, v_ends, query_chunk):

    tensors = tuple(last_dim_contiguous(t) for t in (q, k_own, v_own, k_ends, v_ends))
    return tensors + (query_chunk.to(torch.int32).contiguous(),)


@kernel_op("chunk_end_attention_fwd")
def chunk_end_attention_fwd(
    q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, k_ends: torch.Tensor, v_ends: torch.Tensor,
    query_chunk: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the compact form (T x C scores)."""
    from .triton import _ChunkEndAttention

    ctx = KernelContext()
    out = _ChunkEndAttention.forward(ctx, q, k_own, v_own, k_ends, v_ends, query_chunk, scale)
    return out, ctx.saved_tensors[7]


@chunk_end_attention_fwd.register_fake
def _(q, k_own, v_own, k_ends, v_ends, query_chunk, scale):
    return _attention_fakes(q, k_own)


@kernel_op("chunk_end_attention_bwd")
def chunk_end_attention_bwd(
    q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, k_ends: torch.Tensor, v_ends: torch.Tensor,
    query_chunk: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import _ChunkEndAttention, _Geometry

    saved = _chunk_end_inputs(q, k_own, v_own, k_ends, v_ends, query_chunk) + (out, lse)
    geo = _Geometry(True, k_ends.shape[1], 1, 0, 0, 0)
    return _ChunkEndAttention.backward(KernelContext(saved, geo=geo, scale=scale), dout)[:5]


@chunk_end_attention_bwd.register_fake
def _(q, k_own, v_own, k_ends, v_ends, query_chunk, out, lse, dout, scale):
    dq, dk_own, dv_own, dk_ends, dv_ends = fake_like(q, k_own, v_own, k_ends, v_ends)
    return dq.new_empty(out.shape), dk_own.new_empty(q.shape), dv_own.new_empty(q.shape), dk_ends, dv_ends


def _chunk_end_setup(ctx, inputs, output):
    *tensors, scale = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.scale = scale


def _chunk_end_backward(ctx, dout, _dlse):
    grads = chunk_end_attention_bwd(*ctx.saved_tensors, dout, ctx.scale)
    return (*grads, None, None)


chunk_end_attention_fwd.register_autograd(_chunk_end_backward, setup_context=_chunk_end_setup)


@kernel_op("chunk_end_decode")
def chunk_end_decode(
    q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, k_ends: torch.Tensor, v_ends: torch.Tensor,
    query_chunk: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per row against a cache's chunk ends (the streaming decode kernel); no gradient."""
    from .decode import chunk_end_decode_triton

    return chunk_end_decode_triton(q, k_own, v_own, k_ends, v_ends, query_chunk, scale)


@chunk_end_decode.register_fake
def _(q, k_own, v_own, k_ends, v_ends, query_chunk, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)



def rat_decode_step(
    q_groups: torch.Tensor, k_groups: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor,
    gate_bias: torch.Tensor, state_key: torch.Tensor, state_value: torch.Tensor, position: torch.Tensor,
    chunk_size: int, cos_sin: tuple[torch.Tensor, torch.Tensor] | None, key_buffer: torch.Tensor,
    value_buffer: torch.Tensor, scale: float | None = None, output_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """RAT's whole decode step in one Triton kernel (rat_decode.py states it); writes the new state
    and the token's chunk-end slot into state_key / state_value / key_buffer / value_buffer in place
    and returns y [B, 1, H, D], times sigmoid(output_gate) ([B, 1, H, D] logits: the layer's output
    gate) when given. Not differentiable."""
    cos, sin = cos_sin if cos_sin is not None else (None, None)
    if output_gate is not None and tuple(output_gate.shape) != tuple(v.shape):
        raise ValueError(f"rat_decode_step: output_gate must be shaped like v {tuple(v.shape)}; got {tuple(output_gate.shape)}.")
    return rat_decode_step_op(
        q_groups, k_groups, v, gate_logits, gate_bias, state_key, state_value, position, int(chunk_size), cos, sin,
        key_buffer, value_buffer, scale, output_gate,
    )


@kernel_op("rat_decode_step", mutates_args=("state_key", "state_value", "key_buffer", "value_buffer"))
def rat_decode_step_op(
    q_groups: torch.Tensor, k_groups: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor,
    gate_bias: torch.Tensor, state_key: torch.Tensor, state_value: torch.Tensor, position: torch.Tensor,
    chunk_size: int, cos: torch.Tensor | None, sin: torch.Tensor | None, key_buffer: torch.Tensor,
    value_buffer: torch.Tensor, scale: float | None, output_gate: torch.Tensor | None,
) -> torch.Tensor:
    from .rat_decode_triton import rat_decode_step_triton

    cos_sin = (cos, sin) if cos is not None else None
    return rat_decode_step_triton(
        q_groups, k_groups, v, gate_logits, gate_bias, state_key, state_value, position, chunk_size, cos_sin,
        key_buffer, value_buffer, scale, output_gate,
    )


@rat_decode_step_op.register_fake
def _(q_groups, k_groups, v, gate_logits, gate_bias, state_key, state_value, position, chunk_size, cos, sin,
      key_buffer, value_buffer, scale, output_gate):
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def _check_rat_plus_decode(q, k, v, gate_logits, state_key, state_value, keys, values, stored, layout, sink_valid):
    op = "rat_plus_decode_step"
    batch, _, heads, dim = q.shape
    kv_heads = keys.shape[2]
    if q.shape[1] != 1 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}: q must be [batch, 1, heads, head_dim] with heads a multiple of the store's {kv_heads} kv heads; got {tuple(q.shape)}.")
    token = (batch, 1, kv_heads, dim)
    for name, t in (("k", k), ("v", v), ("gate_logits", gate_logits)):
        if t is not None and tuple(t.shape) != token:
            raise ValueError(f"{op}: {name} must be {list(token)}, got {tuple(t.shape)}.")
    if gate_logits is not None:
        for name, t in (("state_key", state_key), ("state_value", state_value)):
            if t is None or tuple(t.shape) != (batch, kv_heads, dim) or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be a contiguous float32 [{batch}, {kv_heads}, {dim}] tensor (the recurrent state).")
    if tuple(values.shape) != tuple(keys.shape) or keys.stride() != values.stride() or keys.shape[0] != batch or keys.shape[3] != dim:
        raise ValueError(f"{op}: keys / values must be [{batch}, columns, kv_heads, {dim}] buffers of equal strides.")
    if tuple(stored.shape) != tuple(keys.shape[:2]) or stored.dtype != torch.long:
        raise ValueError(f"{op}: stored must be a long [{batch}, {keys.shape[1]}] tensor of column positions.")
    if layout.sinks and (sink_valid is None or tuple(sink_valid.shape) != (batch, layout.sinks)):
        raise ValueError(f"{op}: sink_valid must be a bool [{batch}, {layout.sinks}] tensor for a layout with sinks.")


def rat_plus_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor | None,
    state_key: torch.Tensor | None, state_value: torch.Tensor | None, position: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None, keys: torch.Tensor, values: torch.Tensor,
    stored: torch.Tensor, layout: StoreLayout, sink_valid: torch.Tensor | None = None,
    scale: float | None = None, output_gate: torch.Tensor | None = None, backend: str = "auto",
) -> torch.Tensor:
    """RAT+'s decode step on a static store (rat_plus_decode.py states it): writes the recurrent
    state, the store's columns and ``stored`` in place and returns y [B, 1, H, D], times
    sigmoid(output_gate) ([B, 1, H, D] logits: the layer's output gate) when given. Not
    differentiable. Triton: two launches (rat_plus_decode_triton.py); head_dim a power of two in [16, 256]."""
    _check_rat_plus_decode(q, k, v, gate_logits, state_key, state_value, keys, values, stored, layout, sink_valid)
    if output_gate is not None and tuple(output_gate.shape) != tuple(q.shape):
        raise ValueError(f"rat_plus_decode_step: output_gate must be shaped like q {tuple(q.shape)}; got {tuple(output_gate.shape)}.")
    if resolve_backend(backend, q.device, "rat_plus_decode_step") == "reference":
        y = rat_plus_decode_step_reference(
            q, k, v, gate_logits, state_key, state_value, position, cos_sin, keys, values, stored, layout, sink_valid, scale
        )
        return y if output_gate is None else sigmoid_gate_reference(output_gate, y)
    _check_triton_head_dim("rat_plus_decode_step", q)
    cos, sin = cos_sin if cos_sin is not None else (None, None)
    return rat_plus_decode_step_op(
        q, k, v, gate_logits, state_key, state_value, position, cos, sin, keys, values, stored, sink_valid,
        layout.first_end, layout.first_ring, layout.ring, layout.dilation, layout.window, layout.sinks, scale,
        output_gate,
    )


@kernel_op("rat_plus_decode_step", mutates_args=("state_key", "state_value", "keys", "values", "stored"))
def rat_plus_decode_step_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor | None,
    state_key: torch.Tensor | None, state_value: torch.Tensor | None, position: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
    stored: torch.Tensor, sink_valid: torch.Tensor | None, first_end: int, first_ring: int, ring: int,
    dilation: int, window: int, sinks: int, scale: float | None, output_gate: torch.Tensor | None,
) -> torch.Tensor:
    from .rat_plus_decode_triton import rat_plus_decode_step_triton

    layout = StoreLayout(first_end, first_ring, ring, dilation, window, sinks)
    cos_sin = (cos, sin) if cos is not None else None
    return rat_plus_decode_step_triton(
        q, k, v, gate_logits, state_key, state_value, position, cos_sin, keys, values, stored, layout, sink_valid, scale,
        output_gate,
    )


@rat_plus_decode_step_op.register_fake
def _(q, k, v, gate_logits, state_key, state_value, position, cos, sin, keys, values, stored, sink_valid,
      first_end, first_ring, ring, dilation, window, sinks, scale, output_gate):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
