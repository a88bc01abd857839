"""Sigmoid output gate out = sigmoid(z) * y in one pass (RAT's output gate); math in reference.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import KernelContext, fake_like, kernel_op
from .reference import sigmoid_gate_reference

__all__ = ["sigmoid_gate", "sigmoid_gate_reference"]


def sigmoid_gate(z: torch.Tensor, y: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """sigmoid(z) * y for z, y of one shape (any), float32 math, result in y's dtype."""
    if not isinstance(z, torch.Tensor) or not isinstance(y, torch.Tensor) or z.shape != y.shape:
        shapes = tuple(getattr(z, "shape", ())), tuple(getattr(y, "shape", ()))
        raise ValueError(f"sigmoid_gate: z and y must be tensors of one shape; got {shapes[0]} and {shapes[1]}.")
    if resolve_backend(backend, y.device, "sigmoid_gate") == "triton":
        return sigmoid_gate_fwd(z, y)
    return sigmoid_gate_reference(z, y)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("sigmoid_gate_fwd")
def sigmoid_gate_fwd(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from .triton import _SigmoidGate

    return _SigmoidGate.forward(KernelContext(), z, y)


@sigmoid_gate_fwd.register_fake
def _(z, y):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


@kernel_op("sigmoid_gate_bwd")
def sigmoid_gate_bwd(z: torch.Tensor, y: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton import _SigmoidGate

    return _SigmoidGate.backward(KernelContext((z.contiguous(), y.contiguous())), dout)


@sigmoid_gate_bwd.register_fake
def _(z, y, dout):
    return fake_like(z, y)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout):
    return sigmoid_gate_bwd(*ctx.saved_tensors, dout)


sigmoid_gate_fwd.register_autograd(_backward, setup_context=_setup)
