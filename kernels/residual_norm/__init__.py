"""Residual add + RMSNorm in one kernel: h = x + d, y = RMSNorm(h) (reference.py states it).

The pre-norm block adds its mixer's and its MLP's output to the residual stream, and the next norm
reads the sum right away; in a decode step each add is a kernel of its own (two per block). Here
the add rides on the norm. Forward only: generate()'s static decode step uses it
(hf_hybrid/layers/backbone.py, ``DecoderLayer.forward_deferred_add``).

Without the add, :func:`rms_norm` is the backbone's RMSNorm for training too: the same forward
kernel and a backward kernel (dx per row, dweight as float32 partials summed over rows), each one
launch through the compiled launcher, as a custom op with autograd.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import fake_like, kernel_op
from .reference import add_rms_norm_reference

__all__ = ["add_rms_norm", "add_rms_norm_reference", "add_rms_norm_supported", "rms_norm", "rms_norm_reference"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 16384  # one row per program in registers


def add_rms_norm_supported(x: torch.Tensor) -> bool:
    """Whether the Triton kernel takes rows like x (dtype, row length)."""
    return x.dtype in _DTYPES and x.shape[-1] <= _MAX_HIDDEN


def _runs_triton(op: str, x: torch.Tensor, weight: torch.Tensor, backend: str) -> bool:
    """Checks the weight against x's rows; whether the Triton kernel runs (False: the reference),
    naming the limit when backend="triton" asks for rows it does not take."""
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"{op}: weight must be [{n}] (x's last dim); got {tuple(weight.shape)}.")
    if resolve_backend(backend, x.device, op) == "reference" or x.numel() == 0:
        return False
    if not add_rms_norm_supported(x):
        if backend == "triton":
            raise ValueError(f"{op}: the Triton kernel takes {_DTYPES} rows of at most {_MAX_HIDDEN}; pass backend='reference'.")
        return False
    return True


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + delta, RMSNorm(h) with ``weight``): x, delta [..., N] of one dtype (delta None: h = x),
    weight [N]. No gradient on the Triton path (it raises when one is needed); backend "auto"
    (Triton on CUDA), "triton", "reference"."""
    op = "add_rms_norm"
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"{op}: delta must match x ({tuple(x.shape)}, {x.dtype}); got {tuple(delta.shape)}, {delta.dtype}.")
    if not _runs_triton(op, x, weight, backend):
        return add_rms_norm_reference(x, delta, weight, eps)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, delta, weight)):
        raise ValueError(f"{op}: the Triton kernel has no backward; call it under torch.no_grad() or pass backend='reference'.")
    x = x if x.stride(-1) == 1 else x.contiguous()
    delta = delta if delta is None or delta.stride(-1) == 1 else delta.contiguous()
    if delta is None:
        return x, rms_norm_rows_op(x, weight, float(eps))
    return add_rms_norm_op(x, delta, weight, float(eps))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) with weight: the reference's y without the add."""
    return add_rms_norm_reference(x, None, weight, eps)[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """y = RMSNorm(x) with ``weight`` [N] over x [..., N] (float32 math, one rounding to x's dtype),
    differentiable in x and weight. backend "auto" (Triton on CUDA), "triton", "reference"."""
    if not _runs_triton("rms_norm", x, weight, backend):
        return rms_norm_reference(x, weight, eps)
    return rms_norm_rows_op(x if x.stride(-1) == 1 else x.contiguous(), weight, float(eps))


@kernel_op("add_rms_norm")
def add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton import add_rms_norm_triton

    return add_rms_norm_triton(x, delta, weight, eps)


@add_rms_norm_op.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@kernel_op("rms_norm_rows")
def rms_norm_rows_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same kernel without the add (a block whose residual stream starts here)."""
    from .triton import add_rms_norm_triton

    return add_rms_norm_triton(x, None, weight, eps)[1]


@rms_norm_rows_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@kernel_op("rms_norm_rows_bwd")
def rms_norm_rows_bwd(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton import rms_norm_backward_triton

    return rms_norm_backward_triton(x, weight, dy if dy.is_contiguous() else dy.contiguous(), eps)


@rms_norm_rows_bwd.register_fake
def _(x, weight, dy, eps):
    return fake_like(x, weight)


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dweight = rms_norm_rows_bwd(x, weight, dy, ctx.eps)
    return dx, dweight, None


rms_norm_rows_op.register_autograd(_backward, setup_context=_setup)
