"""RATTENTION's local-layer ops: residual linear attention (RLA) and sliding-window attention (SWA).

    SWA:  query i sees keys j with 0 <= i - j <= w                      (softmax attention)
    RLA:  o_i = phi(q_i)^T S_i,  S_i = S_0 + sum_{j <= i - w - 1} phi(k_j) v_j^T   (no normaliser)

Together they cover the causal past exactly once. See reference.py for the full statement,
triton.py for the chunked kernels and sliding_window.py for the SWA fast paths.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend, triton_available
from .._custom_ops import KernelContext, fake_like, kernel_op, optional, placeholder
from .reference import (
    FEATURE_MAPS,
    feature_dim,
    feature_map_fn,
    lagged_mask,
    residual_linear_attention_chunked,
    residual_linear_attention_decode_reference,
    residual_linear_attention_reference,
    sliding_window_attention_reference,
)
from .ring_decode import ring_decode_reference
from ..window_attention import window_attention, window_attention_applies
from .sliding_window import sliding_window_attention_flex, sliding_window_attention_sdpa

__all__ = [
    "FEATURE_MAPS",
    "feature_dim",
    "feature_map_fn",
    "lagged_mask",
    "residual_linear_attention",
    "residual_linear_attention_chunked",
    "residual_linear_attention_decode",
    "residual_linear_attention_decode_reference",
    "residual_linear_attention_reference",
    "ring_decode",
    "ring_decode_reference",
    "ring_decode_supported",
    "sliding_window_attention",
    "sliding_window_attention_reference",
]

_OP = "residual_linear_attention"
_TRITON_HEAD_DIMS = (16, 32, 64, 128)
_TRITON_OPTIONS = ("chunk_size", "block_v", "state_every", "num_warps", "fuse_halves", "heads_per_tile", "chunk_parallel",
                   "half_launches")


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{op}: q, k, v must be [batch, seq, heads, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have equal shapes; got {tuple(k.shape)} and {tuple(v.shape)}.")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, sequence length and head_dim."
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{op}: the number of query heads ({q.shape[2]}) must be a multiple of the number of key/value "
            f"heads ({k.shape[2]}); repeat k and v to the query heads or use a divisor."
        )
    if not (q.is_floating_point() and k.dtype == q.dtype and v.dtype == q.dtype):
        raise ValueError(f"{op}: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")


def _check_window(op: str, window_size, minimum: int) -> None:
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < minimum:
        meaning = "-1 = pure linear attention, 0 = self-only window" if minimum < 0 else "0 = the token itself only"
        raise ValueError(f"{op}: window_size must be an int >= {minimum} ({meaning}); got {window_size!r}.")


def residual_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    feature_map: str = "softmax",
    initial_state: torch.Tensor | None = None,
    backend: str = "auto",
    **triton_options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual linear attention over the tokens that left a window of ``window_size`` (the paper's w).

    q [B, T, H, D]; k, v [B, T, H_kv, D] raw projections (pre-RoPE, pre-QK-norm), H_kv dividing H
    (pass them repeated to H heads, or not: the state has k's number of heads either way).
    ``window_size`` w >= -1: -1 is pure causal linear attention, 0 leaves only the token itself
    to the SWA. ``feature_map``: "softmax" (phi = [softmax(x), softmax(-x)], F = 2D), "relu"
    ([relu(x), relu(-x)]), "identity" (F = D). ``initial_state`` [B, H_kv, F, D]: the state of
    earlier tokens (zeros when None).

    Returns (o [B, T, H, D] in q's dtype, final_state [B, H_kv, F, D] float32), the state after
    folding every key j <= T - 1 - (w + 1): what a decode step for token T starts from.
    backend: "auto" (Triton on CUDA, the chunked PyTorch form elsewhere), "triton", "chunked",
    "reference" (explicit lagged mask, O(T^2)). ``triton_options`` (chunk_size, block_v,
    state_every, num_warps, fuse_halves, heads_per_tile, chunk_parallel, half_launches) tune the kernel without
    changing the result.
    """
    _check_qkv(_OP, q, k, v)
    _check_window(_OP, window_size, -1)
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"{_OP}: feature_map must be one of {FEATURE_MAPS}; got {feature_map!r}.")
    batch, _, _, dim = q.shape
    state_shape = (batch, k.shape[2], feature_dim(feature_map, dim), dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(
            f"{_OP}: initial_state must be [batch, kv_heads, features, head_dim] = {state_shape}; "
            f"got {tuple(initial_state.shape)}."
        )
    impl = resolve_backend(backend, q.device, _OP, extra=("chunked",))
    triton_ok = dim in _TRITON_HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if backend == "auto":
        impl = "triton" if impl == "triton" and triton_ok else "chunked"
    if triton_options and impl != "triton":
        raise ValueError(f"{_OP}: {sorted(triton_options)} only apply to backend='triton' (running {impl!r}).")
    if impl == "triton":
        if dim not in _TRITON_HEAD_DIMS:
            raise ValueError(
                f"{_OP}: the Triton kernel supports head_dim in {_TRITON_HEAD_DIMS}; got {dim}. "
                "Pass backend='chunked' or use a supported head_dim."
            )
        if q.shape[1] == 0:
            return residual_linear_attention_chunked(q, k, v, window_size, feature_map, initial_state)
        unknown = set(triton_options) - set(_TRITON_OPTIONS)
        if unknown:
            raise TypeError(f"{_OP}: unknown Triton options {sorted(unknown)}; the options are {_TRITON_OPTIONS}.")
        options = tuple(triton_options.get(name) for name in _TRITON_OPTIONS)
        o, final, _ = residual_linear_attention_fwd(q, k, v, initial_state, window_size, feature_map, *options)
        return o, final
    if impl == "reference":
        return residual_linear_attention_reference(q, k, v, window_size, feature_map, initial_state)
    return residual_linear_attention_chunked(q, k, v, window_size, feature_map, initial_state)


def residual_linear_attention_decode(
    q: torch.Tensor,
    state: torch.Tensor,
    k_leaving: torch.Tensor | None = None,
    v_leaving: torch.Tensor | None = None,
    leaving_mask: torch.Tensor | None = None,
    feature_map: str = "softmax",
    *,
    inplace: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: fold the token leaving the window into S, then o = phi(q)^T S.

    For token t the leaving token is t - w - 1 (for w = -1 it is token t itself); pass None
    while the window is not yet full. q [B, H, D]; state [B, H_s, F, D] float32 with H % H_s == 0;
    k_leaving / v_leaving [B, H_s, D]; leaving_mask [B] bool, False for rows whose leaving slot is
    padding (or pass zero values there). Returns (o [B, H, D] in q's dtype, new state).
    ``inplace=False`` leaves the state passed in untouched; ``inplace=True`` lets the step update
    it (for a cache's own tensor: saves a copy of S per step). backend: "auto" (one fused Triton
    kernel on CUDA: one read and one write of S; PyTorch elsewhere), "triton", "reference".
    """
    op = "residual_linear_attention_decode"
    if q.dim() != 3 or state.dim() != 4 or state.shape[0] != q.shape[0] or state.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{op}: q must be [batch, heads, head_dim] and state [batch, state_heads, features, head_dim] with the "
            f"same batch and head_dim; got {tuple(q.shape)} and {tuple(state.shape)}."
        )
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"{op}: feature_map must be one of {FEATURE_MAPS}; got {feature_map!r}.")
    if state.shape[2] != feature_dim(feature_map, q.shape[-1]) or q.shape[1] % state.shape[1]:
        raise ValueError(
            f"{op}: state {tuple(state.shape)} does not fit q {tuple(q.shape)} with feature_map={feature_map!r} "
            f"(features must be {feature_dim(feature_map, q.shape[-1])} and state heads must divide {q.shape[1]})."
        )
    if (k_leaving is None) != (v_leaving is None):
        raise ValueError(f"{op}: pass both k_leaving and v_leaving, or neither.")
    if k_leaving is not None and (k_leaving.shape != v_leaving.shape or k_leaving.shape != (q.shape[0], state.shape[1], q.shape[2])):
        raise ValueError(
            f"{op}: k_leaving and v_leaving must be [batch, state_heads, head_dim] = "
            f"{(q.shape[0], state.shape[1], q.shape[2])}; got {tuple(k_leaving.shape)} and {tuple(v_leaving.shape)}."
        )
    if leaving_mask is not None and tuple(leaving_mask.shape) != (q.shape[0],):
        raise ValueError(f"{op}: leaving_mask must be [batch] = ({q.shape[0]},); got {tuple(leaving_mask.shape)}.")
    impl = resolve_backend(backend, q.device, op)
    if backend == "auto" and q.shape[-1] not in _TRITON_HEAD_DIMS:
        impl = "reference"
    if impl == "triton":
        if q.shape[-1] not in _TRITON_HEAD_DIMS:
            raise ValueError(f"{op}: the Triton kernel supports head_dim in {_TRITON_HEAD_DIMS}; got {q.shape[-1]}.")
        if inplace:
            return residual_linear_attention_decode_inplace(q, state, k_leaving, v_leaving, leaving_mask, feature_map), state
        return residual_linear_attention_decode_step(q, state, k_leaving, v_leaving, leaving_mask, feature_map)
    o, new_state = residual_linear_attention_decode_reference(q, state, k_leaving, v_leaving, leaving_mask, feature_map)
    if inplace and new_state is not state:
        state.copy_(new_state)
        new_state = state
    return o, new_state


FLEX_MIN_HEAD_DIM = 16  # flex_attention's compiled kernels reject smaller head dims


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: int,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal softmax attention over a window: query i sees keys j with 0 <= i - j <= window_size.

    q [B, T, H, D]; k, v [B, T, H_kv, D] (GQA). Differentiable. backend: "auto" (kernels/window_attention
    on CUDA for the dtypes and head dims it takes: FlashAttention-2 for fp16 / bf16, Triton for
    float32; "flex" for other head dims >= 16, "sdpa" elsewhere), "flash" or "triton"
    (kernels/window_attention's two ways: tiles outside the band skipped, nothing compiled per
    shape), "flex" (flex_attention with a block-sparse band mask, compiled once per process), "sdpa"
    (a dense band mask through scaled_dot_product_attention) or "reference" (explicit float32
    softmax). ``window_size >= T - 1`` runs SDPA's causal kernel on every backend but "reference".
    """
    op = "sliding_window_attention"
    _check_qkv(op, q, k, v)
    _check_window(op, window_size, 0)
    impl = resolve_backend(backend, q.device, op, extra=("flash", "flex", "sdpa"))
    if backend == "auto":
        flex_ok = q.device.type == "cuda" and triton_available() and q.shape[-1] >= FLEX_MIN_HEAD_DIM
        impl = "triton" if flex_ok and window_attention_applies(q) else "flex" if flex_ok else "sdpa"
    small_for_flex = q.device.type == "cuda" and q.shape[-1] < FLEX_MIN_HEAD_DIM
    if impl == "flex" and small_for_flex and window_size < q.shape[1] - 1:
        raise ValueError(
            f"{op}: flex_attention needs head_dim >= {FLEX_MIN_HEAD_DIM}, got {q.shape[-1]}; "
            "pass backend='sdpa' (or 'auto', which picks it) or use a larger head_dim."
        )
    if impl == "reference":
        return sliding_window_attention_reference(q, k, v, window_size, scale)
    if impl == "sdpa" or window_size >= q.shape[1] - 1:
        return sliding_window_attention_sdpa(q, k, v, window_size, scale)
    if impl in ("triton", "flash"):  # its window counts the token itself
        return window_attention(q, k, v, window_size=window_size + 1, scale=scale,
                                backend="auto" if backend == "auto" else impl)
    return sliding_window_attention_flex(q, k, v, window_size, scale)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


def _rla_plan(q, k, window_size, feature_map, chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile,
              chunk_parallel, half_launches):
    from .triton import _check_tiling, _Plan

    plan = _Plan(q, k, feature_map, window_size, chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile,
                 chunk_parallel, half_launches)
    _check_tiling(plan)
    return plan


@kernel_op("residual_linear_attention_fwd")
def residual_linear_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None, window_size: int,
    feature_map: str, chunk_size: int | None, block_v: int | None, state_every: int | None,
    num_warps: int | None, fuse_halves: bool | None, heads_per_tile: int | None, chunk_parallel: bool | None,
    half_launches: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final_state, the states stored every few chunks for the backward, or a placeholder)."""
    from .triton import _ResidualLinearAttention

    plan = _rla_plan(q, k, window_size, feature_map, chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile,
                     chunk_parallel, half_launches)
    ctx = KernelContext()
    o, final = _ResidualLinearAttention.forward(ctx, q, k, v, initial_state, plan)
    states = ctx.saved_tensors[4]
    return o, final, placeholder(final) if states is None else states


@residual_linear_attention_fwd.register_fake
def _(q, k, v, initial_state, window_size, feature_map, chunk_size, block_v, state_every, num_warps, fuse_halves,
      heads_per_tile, chunk_parallel, half_launches):
    plan = _rla_plan(q, k, window_size, feature_map, chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile,
                     chunk_parallel, half_launches)
    state_shape = (q.shape[0], k.shape[2], plan.features, q.shape[3])
    final = q.new_empty(state_shape, dtype=torch.float32)
    if plan.chunk_parallel:  # every chunk's state, in the operand dtype (triton_chunk_parallel.py)
        states = q.new_empty((state_shape[0], state_shape[1], plan.num_chunks, *state_shape[2:]), dtype=q.dtype)
    else:
        states = q.new_empty((plan.nseg, *state_shape), dtype=torch.float32) if plan.nseg > 1 else placeholder(final)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), final, states


@kernel_op("residual_linear_attention_bwd")
def residual_linear_attention_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None, states: torch.Tensor,
    do: torch.Tensor, dfinal: torch.Tensor | None, window_size: int, feature_map: str, chunk_size: int | None,
    block_v: int | None, state_every: int | None, num_warps: int | None, fuse_halves: bool | None,
    heads_per_tile: int | None, chunk_parallel: bool | None, half_launches: bool | None, need_ds0: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d initial_state or a placeholder); ``states``: the forward's third output."""
    from .triton import _ResidualLinearAttention

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    plan = _rla_plan(q, k, window_size, feature_map, chunk_size, block_v, state_every, num_warps, fuse_halves, heads_per_tile,
                     chunk_parallel, half_launches)
    saved = (q, k, v, initial_state, states if plan.nseg > 1 or plan.chunk_parallel else None)
    ctx = KernelContext(saved, needs_input_grad=(True, True, True, need_ds0), plan=plan, has_s0=initial_state is not None)
    dq, dk, dv, ds0, _ = _ResidualLinearAttention.backward(ctx, do, dfinal)
    return dq, dk, dv, placeholder(q) if ds0 is None else ds0


@residual_linear_attention_bwd.register_fake
def _(q, k, v, initial_state, states, do, dfinal, window_size, feature_map, chunk_size, block_v, state_every,
      num_warps, fuse_halves, heads_per_tile, chunk_parallel, half_launches, need_ds0):
    dq, dk, dv, ds0 = fake_like(q, k, v, initial_state)
    return dq, dk, dv, ds0 if need_ds0 and initial_state is not None else placeholder(q)


def _rla_setup(ctx, inputs, output):
    q, k, v, initial_state, *args = inputs
    ctx.save_for_backward(q, k, v, initial_state, output[2])
    ctx.args = tuple(args)


def _rla_backward(ctx, do, dfinal, _dstates):
    q, k, v, initial_state, states = ctx.saved_tensors
    need_ds0 = initial_state is not None and ctx.needs_input_grad[3]
    dq, dk, dv, ds0 = residual_linear_attention_bwd(q, k, v, initial_state, states, do, dfinal, *ctx.args, need_ds0)
    return (dq, dk, dv, optional(ds0, need_ds0)) + (None,) * len(ctx.args)


residual_linear_attention_fwd.register_autograd(_rla_backward, setup_context=_rla_setup)


@kernel_op("residual_linear_attention_decode_step")
def residual_linear_attention_decode_step(
    q: torch.Tensor, state: torch.Tensor, k_leaving: torch.Tensor | None, v_leaving: torch.Tensor | None,
    leaving_mask: torch.Tensor | None, feature_map: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, new state) of one decode step; ``state`` is left untouched. No gradient (decoding)."""
    from .triton import residual_linear_attention_decode_triton

    o, new_state = residual_linear_attention_decode_triton(q, state, k_leaving, v_leaving, leaving_mask, feature_map, False)
    return o, new_state.clone() if new_state is state else new_state  # outputs never alias inputs


@residual_linear_attention_decode_step.register_fake
def _(q, state, k_leaving, v_leaving, leaving_mask, feature_map):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(state.shape, dtype=torch.float32, device=state.device)


@kernel_op("residual_linear_attention_decode_inplace", mutates_args=("state",))
def residual_linear_attention_decode_inplace(
    q: torch.Tensor, state: torch.Tensor, k_leaving: torch.Tensor | None, v_leaving: torch.Tensor | None,
    leaving_mask: torch.Tensor | None, feature_map: str,
) -> torch.Tensor:
    """o of one decode step; the new state is written into ``state`` (a cache's own tensor)."""
    from .triton import residual_linear_attention_decode_triton

    o, new_state = residual_linear_attention_decode_triton(q, state, k_leaving, v_leaving, leaving_mask, feature_map, True)
    if new_state is not state:  # the kernel worked on a float32 contiguous copy
        state.copy_(new_state)
    return o


@residual_linear_attention_decode_inplace.register_fake
def _(q, state, k_leaving, v_leaving, leaving_mask, feature_map):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def ring_decode_supported(head_dim: int) -> bool:
    """Whether the Triton ring step takes this head size."""
    return head_dim in _TRITON_HEAD_DIMS


def ring_decode(
    q: torch.Tensor, k: torch.Tensor, k_swa: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    ring_keys: torch.Tensor, ring_values: torch.Tensor, ring_raw_keys: torch.Tensor, next_column: torch.Tensor,
    feature_map: str = "softmax", backend: str = "auto",
) -> torch.Tensor:
    """RATTENTION's local decode step on a full window ring, RLA half (ring_decode.py states it):
    folds the leaving token into ``state``, writes the new token into its ring slot (in place) and
    returns the RLA output o [B, H, D]. Not differentiable. Triton: one launch; head_dim in (16, 32, 64, 128)."""
    op = "ring_decode"
    batch, heads, dim = q.shape
    kv_heads = state.shape[1] if state.dim() == 4 else 0
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"{op}: feature_map must be one of {FEATURE_MAPS}; got {feature_map!r}.")
    if (state.dim() != 4 or kv_heads == 0 or heads % kv_heads or state.dtype != torch.float32 or not state.is_contiguous()
            or tuple(state.shape) != (batch, kv_heads, feature_dim(feature_map, dim), dim)):
        raise ValueError(f"{op}: state must be a contiguous float32 [{batch}, kv_heads, {feature_dim(feature_map, dim)}, {dim}] "
                         f"tensor with kv_heads dividing the {heads} query heads; got {tuple(state.shape)} {state.dtype}.")
    for name, t in (("k", k), ("k_swa", k_swa), ("v", v)):
        if tuple(t.shape) != (batch, kv_heads, dim) or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be [{batch}, {kv_heads}, {dim}] with a contiguous last dim; got {tuple(t.shape)}.")
    rings = (("ring_keys", ring_keys), ("ring_values", ring_values), ("ring_raw_keys", ring_raw_keys))
    for name, t in rings:
        if (t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (kv_heads, dim) or t.shape != ring_raw_keys.shape
                or t.stride() != ring_raw_keys.stride()):
            raise ValueError(f"{op}: {name} must be a [{batch}, window + 1, {kv_heads}, {dim}] ring with ring_raw_keys' strides.")
    if resolve_backend(backend, q.device, op) == "reference":
        return ring_decode_reference(q, k, k_swa, v, state, ring_keys, ring_values, ring_raw_keys, next_column, feature_map)
    if not ring_decode_supported(dim):
        raise ValueError(f"{op}: the Triton kernel takes head_dim in {_TRITON_HEAD_DIMS}, got {dim}; pass backend='reference'.")
    return ring_decode_op(q.contiguous(), k, k_swa, v, state, ring_keys, ring_values, ring_raw_keys, next_column, feature_map)


@kernel_op("rattention_ring_decode", mutates_args=("state", "ring_keys", "ring_values", "ring_raw_keys"))
def ring_decode_op(
    q: torch.Tensor, k: torch.Tensor, k_swa: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    ring_keys: torch.Tensor, ring_values: torch.Tensor, ring_raw_keys: torch.Tensor, next_column: torch.Tensor,
    feature_map: str,
) -> torch.Tensor:
    from .ring_decode_triton import ring_decode_triton

    return ring_decode_triton(q, k, k_swa, v, state, ring_keys, ring_values, ring_raw_keys, next_column, feature_map)


@ring_decode_op.register_fake
def _(q, k, k_swa, v, state, ring_keys, ring_values, ring_raw_keys, next_column, feature_map):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
