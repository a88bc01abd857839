"""Gated linear recurrence h_t = g_t * h_{t-1} + (1 - g_t) * x_t (RAT, RAT+); see reference.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import KernelContext, fake_like, kernel_op, optional, placeholder
from .rat_keys_values import rat_keys_values, rat_keys_values_reference
from .reference import gated_recurrence_reference, gated_recurrence_scan

__all__ = [
    "gated_recurrence",
    "gated_recurrence_reference",
    "gated_recurrence_scan",
    "rat_keys_values",
    "rat_keys_values_reference",
]


def gated_recurrence(
    x: torch.Tensor,
    g: torch.Tensor,
    chunk_size: int = 0,
    start_position: int = 0,
    initial_state: torch.Tensor | None = None,
    backend: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x, g: [batch, seq, heads, head_dim] (any trailing shape); g in (0, 1) after the sigmoid.

    chunk_size > 0 restarts the state at every multiple of chunk_size (RAT); 0 runs over the
    whole sequence (RAT+). start_position is the absolute position of x[:, 0] and initial_state
    [batch, ...] the state carried from earlier tokens (both for cached continuation).
    backend "scan" is the log-depth pure-PyTorch scan ("auto" off CUDA); "reference" the loop.
    out_dtype: the states' dtype (default x's); torch.float32 with 16-bit x gives what x.float()
    would, without that copy (the Triton kernel reads x in its own dtype and accumulates in float32).
    """
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"gated_recurrence: out_dtype must be None, x's dtype or torch.float32; got {out_dtype}.")
    if x.shape != g.shape:
        raise ValueError(f"gated_recurrence: x {tuple(x.shape)} and g {tuple(g.shape)} must have the same shape.")
    if chunk_size < 0:
        raise ValueError(f"gated_recurrence: chunk_size must be >= 0 (0 = no restarts), got {chunk_size}.")
    if initial_state is not None and initial_state.shape != x[:, 0].shape:
        raise ValueError(
            f"gated_recurrence: initial_state must have shape {tuple(x[:, 0].shape)}, got {tuple(initial_state.shape)}."
        )
    impl = resolve_backend(backend, x.device, "gated_recurrence", extra=("scan",))
    if backend == "auto" and impl == "reference":
        impl = "scan"  # same function, vectorised: the loop is only the oracle
    if impl == "triton":
        if x.dim() < 2:
            raise ValueError(f"gated_recurrence: x must be [batch, seq, ...], got shape {tuple(x.shape)}.")
        if x.numel() == 0:
            return x.to(out_dtype or x.dtype, copy=True)
        float32_out = out_dtype == torch.float32 and x.dtype != torch.float32
        return gated_recurrence_fwd(x, g, int(chunk_size), int(start_position), initial_state, float32_out)
    if out_dtype is not None:
        x = x.to(out_dtype)
    if impl == "reference":
        return gated_recurrence_reference(x, g, chunk_size, start_position, initial_state)
    return gated_recurrence_scan(x, g, chunk_size, start_position, initial_state)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("gated_recurrence_fwd")
def gated_recurrence_fwd(
    x: torch.Tensor, g: torch.Tensor, chunk_size: int, start_position: int, initial_state: torch.Tensor | None,
    float32_out: bool = False,
) -> torch.Tensor:
    """The states in x's dtype, or in float32 with ``float32_out``."""
    from .triton import _GatedRecurrence

    return _GatedRecurrence.forward(KernelContext(), x, g, chunk_size, start_position, initial_state, float32_out)


@gated_recurrence_fwd.register_fake
def _(x, g, chunk_size, start_position, initial_state, float32_out=False):
    return torch.empty(x.shape, dtype=torch.float32 if float32_out else x.dtype, device=x.device)


@kernel_op("gated_recurrence_bwd")
def gated_recurrence_bwd(
    x: torch.Tensor, g: torch.Tensor, h: torch.Tensor, initial_state: torch.Tensor | None, dh: torch.Tensor,
    chunk_size: int, start_position: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import _GatedRecurrence

    batch, seq = x.shape[:2]
    rows = (t.contiguous().view(batch, seq, -1) for t in (x, g, h))
    init = initial_state.contiguous().view(batch, -1) if initial_state is not None else None
    init_shape = initial_state is not None and initial_state.shape
    ctx = KernelContext((*rows, init), config=(chunk_size, start_position, x.shape, init_shape))
    dx, dg, _, _, dinit, _ = _GatedRecurrence.backward(ctx, dh)
    return dx, dg, placeholder(x) if dinit is None else dinit


@gated_recurrence_bwd.register_fake
def _(x, g, h, initial_state, dh, chunk_size, start_position):
    return fake_like(x, g, initial_state)


def _setup(ctx, inputs, output):
    x, g, chunk_size, start_position, initial_state, _float32_out = inputs
    ctx.save_for_backward(x, g, output, initial_state)
    ctx.config = (chunk_size, start_position, initial_state is not None)


def _backward(ctx, dh):
    x, g, h, initial_state = ctx.saved_tensors
    chunk_size, start_position, has_init = ctx.config
    dx, dg, dinit = gated_recurrence_bwd(x, g, h, initial_state, dh, chunk_size, start_position)
    return dx, dg, None, None, optional(dinit, has_init), None


gated_recurrence_fwd.register_autograd(_backward, setup_context=_setup)


def _rat_kv_inputs(k_groups, v, gate_logits, gate_bias, cos, sin):
    """What the kernels read: contiguous inputs, float32 RoPE tables (empty without RoPE)."""
    tensors = tuple(t.contiguous() for t in (k_groups, v, gate_logits, gate_bias))
    tables = tuple(t.float().contiguous() for t in (cos, sin)) if cos is not None else (v.new_empty(0), v.new_empty(0))
    return tensors + tables


@kernel_op("rat_keys_values_fwd")
def rat_keys_values_fwd(
    k_groups: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor, gate_bias: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_rot, v~) of :func:`rat_keys_values` (inputs checked there); cos/sin both or neither."""
    from .rat_keys_values_triton import _RatKeysValues

    inputs = _rat_kv_inputs(k_groups, v, gate_logits, gate_bias, cos, sin)
    return _RatKeysValues.forward(KernelContext(), *inputs, chunk_size, cos is not None)


@rat_keys_values_fwd.register_fake
def _(k_groups, v, gate_logits, gate_bias, cos, sin, chunk_size):
    return torch.empty(v.shape, dtype=k_groups.dtype, device=v.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)


@kernel_op("rat_keys_values_bwd")
def rat_keys_values_bwd(
    k_groups: torch.Tensor, v: torch.Tensor, gate_logits: torch.Tensor, gate_bias: torch.Tensor,
    cos: torch.Tensor | None, sin: torch.Tensor | None, k_rot: torch.Tensor, v_tilde: torch.Tensor,
    d_k_rot: torch.Tensor, d_v_tilde: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .rat_keys_values_triton import _RatKeysValues

    inputs = _rat_kv_inputs(k_groups, v, gate_logits, gate_bias, cos, sin)
    ctx = KernelContext((*inputs, k_rot.contiguous(), v_tilde.contiguous()), meta=(chunk_size, cos is not None))
    return _RatKeysValues.backward(ctx, d_k_rot, d_v_tilde)[:4]


@rat_keys_values_bwd.register_fake
def _(k_groups, v, gate_logits, gate_bias, cos, sin, k_rot, v_tilde, d_k_rot, d_v_tilde, chunk_size):
    return fake_like(k_groups, v, gate_logits, gate_bias)


def _rat_kv_setup(ctx, inputs, output):
    *tensors, chunk_size = inputs
    ctx.save_for_backward(*tensors, *output)
    ctx.chunk_size = chunk_size


def _rat_kv_backward(ctx, d_k_rot, d_v_tilde):
    k_groups, v, gate_logits, gate_bias, cos, sin, k_rot, v_tilde = ctx.saved_tensors
    d_k_rot = torch.zeros_like(k_rot) if d_k_rot is None else d_k_rot
    d_v_tilde = torch.zeros_like(v_tilde) if d_v_tilde is None else d_v_tilde
    grads = rat_keys_values_bwd(
        k_groups, v, gate_logits, gate_bias, cos, sin, k_rot, v_tilde, d_k_rot, d_v_tilde, ctx.chunk_size
    )
    return (*grads, None, None, None)


rat_keys_values_fwd.register_autograd(_rat_kv_backward, setup_context=_rat_kv_setup)
