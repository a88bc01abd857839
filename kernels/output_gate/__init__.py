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


def _autograd_backward(backward_op):
    def backward(ctx, dout):
        return backward_op(*ctx.saved_tensors, dout)

    return backward


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


@kernel_op("sigmoid_gate_fwd")
def sigmoid_gate_fwd(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _forward(z, y, silu=False)


@kernel_op("sigmoid_gate_bwd")
def sigmoid_gate_bwd(z: torch.Tensor, y: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(z, y, dout, silu=False)


@kernel_op("silu_gate_fwd")
def silu_gate_fwd(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _forward(z, y, silu=True)


@kernel_op("silu_gate_bwd")
def silu_gate_bwd(z: torch.Tensor, y: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(z, y, dout, silu=True)


for _fwd, _bwd in ((sigmoid_gate_fwd, sigmoid_gate_bwd), (silu_gate_fwd, silu_gate_bwd)):
    _fwd.register_fake(lambda z, y: torch.empty(y.shape, dtype=y.dtype, device=y.device))
    _bwd.register_fake(lambda z, y, dout: fake_like(z, y))
    _fwd.register_autograd(_autograd_backward(_bwd), setup_context=_setup)
