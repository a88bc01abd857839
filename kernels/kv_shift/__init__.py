"""KV-shift of FoX's Pro block, out_t = a_t x_{t-1} + (1 - a_t) x_t (math: reference.py), in one
Triton pass forward and one backward (triton.py)."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import fake_like, kernel_op, optional, placeholder
from .reference import kv_shift_reference

__all__ = ["kv_shift", "kv_shift_reference"]

_OP = "kv_shift"


def kv_shift(x: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """x [B, T, H, D] (keys or values), logits [B, T, H] (the shift gates before the sigmoid), previous
    [B, H, D] (x of the token before the segment; zeros when None). Differentiable in all three.
    backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "reference"."""
    if x.dim() != 4:
        raise ValueError(f"{_OP}: x must be [batch, seq, heads, head_dim]; got shape {tuple(x.shape)}.")
    if tuple(logits.shape) != tuple(x.shape[:3]):
        raise ValueError(f"{_OP}: logits must be [batch, seq, heads] = {tuple(x.shape[:3])}; got {tuple(logits.shape)}.")
    if previous is not None and tuple(previous.shape) != (x.shape[0], *x.shape[2:]):
        raise ValueError(
            f"{_OP}: previous must be [batch, heads, head_dim] = {(x.shape[0], *x.shape[2:])}; got {tuple(previous.shape)}."
        )
    if resolve_backend(backend, x.device, _OP) == "triton":
        return kv_shift_fwd(x, logits, previous)
    return kv_shift_reference(x, logits, previous)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("kv_shift_fwd")
def kv_shift_fwd(x: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    from .triton import kv_shift_forward

    return kv_shift_forward(x, logits, previous)


@kv_shift_fwd.register_fake
def _(x, logits, previous):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kernel_op("kv_shift_bwd")
def kv_shift_bwd(
    x: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor | None, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import kv_shift_backward

    dx, dlogits, dprevious = kv_shift_backward(x, logits, previous, dout)
    return dx, dlogits, placeholder(x) if dprevious is None else dprevious


@kv_shift_bwd.register_fake
def _(x, logits, previous, dout):
    return fake_like(x, logits, previous)


def _setup(ctx, inputs, output):
    x, logits, previous = inputs
    ctx.has_previous = previous is not None
    ctx.save_for_backward(x, logits, previous)


def _backward(ctx, dout):
    x, logits, previous = ctx.saved_tensors
    dx, dlogits, dprevious = kv_shift_bwd(x, logits, previous, dout)
    return dx, dlogits, optional(dprevious, ctx.has_previous)


kv_shift_fwd.register_autograd(_backward, setup_context=_setup)
