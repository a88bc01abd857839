"""Several bias-free linears of one input with few rows (a decode step's projections) in one launch.

``few_row_linear(x, (W_0, ..., W_n))`` = ``(F.linear(x, W_0), ..., F.linear(x, W_n))`` (reference.py
states it), for x [..., K] with at most MAX_ROWS rows in all: the Triton kernel (triton.py) gives
every (weight, 32 outputs) its own program, where cuBLAS runs each weight as its own launch over few
thread blocks. Inference only (no autograd): layers call it where no gradient is recorded.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import kernel_op
from .reference import few_row_linear_reference

__all__ = ["MAX_ROWS", "few_row_linear", "few_row_linear_applies", "few_row_linear_reference"]

MAX_ROWS = 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def few_row_linear_applies(x: torch.Tensor, weights: tuple[torch.Tensor, ...], backend: str = "auto") -> bool:
    """Whether ``few_row_linear`` runs the kernel for these operands (else the caller's own path is
    as fast): no gradient recorded, at most MAX_ROWS rows, one float dtype, contiguous weights, the
    Triton backend (CUDA, or the interpreter with backend="triton")."""
    from .triton import MAX_WEIGHTS

    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        0 < rows <= MAX_ROWS and 0 < len(weights) <= MAX_WEIGHTS and x.dtype in _DTYPES and x.shape[-1] > 0
        and all(w.dim() == 2 and w.shape[1] == x.shape[-1] and w.dtype == x.dtype and w.is_contiguous()
                and w.device == x.device for w in weights)
        and resolve_backend(backend, x.device, "few_row_linear") == "triton"
    )


def few_row_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...], backend: str = "auto") -> tuple[torch.Tensor, ...]:
    """(F.linear(x, w) for w in weights) through one kernel launch where :func:`few_row_linear_applies`,
    else through F.linear. Not differentiable on the kernel path."""
    weights = tuple(weights)
    if not few_row_linear_applies(x, weights, backend):
        if backend == "triton":
            raise ValueError(
                f"few_row_linear: the kernel needs at most {MAX_ROWS} rows, 1-6 contiguous weights [N, {x.shape[-1]}] of "
                f"x's dtype and device, and no gradient; got x {tuple(x.shape)} {x.dtype}, weights "
                f"{[tuple(w.shape) for w in weights]}. Pass backend='auto' to fall back to F.linear."
            )
        return few_row_linear_reference(x, weights)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    outs = few_row_linear_op(x2d, list(weights))
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)


@kernel_op("few_row_linear")
def few_row_linear_op(x2d: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    from .triton import few_row_linear_triton

    return list(few_row_linear_triton(x2d, tuple(weights)))


@few_row_linear_op.register_fake
def _(x2d, weights):
    return [x2d.new_empty(x2d.shape[0], w.shape[0]) for w in weights]
