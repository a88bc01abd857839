"""Output gates out = act(z) * y in one pass, act sigmoid (RAT's output gate) or SiLU (SwiGLU's
product); math in reference.py."""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import fake_like, kernel_op
from .reference import sigmoid_gate_reference, silu_gate_reference

__all__ = ["sigmoid_gate", "sigmoid_gate_reference", "silu_gate", "silu_gate_reference"]


def _check(op: str, z, y) -> None:
    if not isinstance(z, torch.Tensor) or not isinstance(y, torch.Tensor) or z.shape != y.shape:
        shapes = tuple(getattr(z, "shape", ())), tuple(getattr(y, "shape", ()))
        raise ValueError(f"{op}: z and y must be tensors of one shape; got {shapes[0]} and {shapes[1]}.")


def sigmoid_gate(z: torch.Tensor, y: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """sigmoid(z) * y for z, y of one shape (any), float32 math, result in y's dtype."""
    _check("sigmoid_gate", z, y)
    if resolve_backend(backend, y.device, "sigmoid_gate") == "triton":
        return sigmoid_gate_fwd(z, y)
    return sigmoid_gate_reference(z, y)


def silu_gate(z: torch.Tensor, y: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(z) * y (SwiGLU's product of gate z and up y) for z, y of one shape (any), float32 math,
    result in y's dtype."""
    _check("silu_gate", z, y)
    if resolve_backend(backend, y.device, "silu_gate") == "triton":
        return silu_gate_fwd(z, y)
    return silu_gate_reference(z, y)


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


def _forward(z: torch.Tensor, y: torch.Tensor, silu: bool) -> torch.Tensor:
    from .triton import gate_forward_triton

    return gate_forward_triton(z.contiguous(), y.contiguous(), silu)


def _backward(z: torch.Tensor, y: torch.Tensor, dout: torch.Tensor, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton import gate_backward_triton

    return gate_backward_triton(z.contiguous(), y.contiguous(), dout.contiguous(), silu)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gate_ops(name: str, silu: bool):
    """The forward and backward custom ops of one gate, with the forward's autograd."""

    @kernel_op(f"{name}_fwd")
    def forward(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _forward(z, y, silu)

    @kernel_op(f"{name}_bwd")
    def backward(z: torch.Tensor, y: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _backward(z, y, dout, silu)

    forward.register_fake(lambda z, y: torch.empty(y.shape, dtype=y.dtype, device=y.device))
    backward.register_fake(lambda z, y, dout: fake_like(z, y))
    forward.register_autograd(lambda ctx, dout: backward(*ctx.saved_tensors, dout), setup_context=_setup)
    return forward, backward


sigmoid_gate_fwd, sigmoid_gate_bwd = _gate_ops("sigmoid_gate", silu=False)
silu_gate_fwd, silu_gate_bwd = _gate_ops("silu_gate", silu=True)
