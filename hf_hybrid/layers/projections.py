"""Several bias-free projections of one input, with the input's gradient summed inside the GEMMs.

Called as separate ``nn.Linear`` modules, n projections of x give autograd n input gradients
g_i W_i, which it sums with n - 1 element-wise adds (each reads two [tokens, hidden] tensors and
writes one; `python -m benchmarks.profile train rat` shows them). Here the backward computes
dx = g_0 W_0 and then dx += g_i W_i with ``addmm_`` (beta = 1), so the sums ride on the GEMMs.
Forward outputs and weight gradients are the modules' own (x W_i^T, g_i^T x).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.few_row_linear import few_row_linear, few_row_linear_applies

# The few-row kernel's backend: "auto" runs it on CUDA only; tests set "triton" to run it in
# Triton's CPU interpreter, "reference" turns it off (the modules' own F.linear everywhere).
FEW_ROW_BACKEND = "auto"


class _SharedInputLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        ctx.set_materialize_grads(False)  # an unused output gives None: its GEMMs are skipped
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        dx, dweights = None, []
        for i, (grad, weight) in enumerate(zip(grads, weights)):
            if grad is None:
                dweights.append(None)
                continue
            grad = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[0]:
                dx = grad @ weight if dx is None else dx.addmm_(grad, weight)
            dweights.append(grad.t() @ rows if ctx.needs_input_grad[i + 1] else None)
        return (None if dx is None else dx.view(x.shape), *dweights)


def _plain_linear(module: nn.Module) -> bool:
    """An unwrapped, bias-free nn.Linear without hooks: its forward is exactly F.linear(x, weight).
    (PEFT's LoRA layers, quantised linears and modules with accelerate / user hooks are not.)"""
    return (
        type(module) is nn.Linear and module.bias is None and not module._forward_hooks
        and not module._forward_pre_hooks and not hasattr(module, "_hf_hook")
    )


def shared_input_applies(x: torch.Tensor, projections: tuple[nn.Module, ...]) -> bool:
    """Whether project_shared_input takes the Function above: a gradient is being recorded, autocast
    is off and every projection is a plain bias-free nn.Linear. Then every output is exactly
    ``F.linear(x, proj.weight)``, which a backward may run again instead of keeping the output."""
    weights = [getattr(p, "weight", None) for p in projections]
    recording = torch.is_grad_enabled() and (x.requires_grad or any(w is not None and w.requires_grad for w in weights))
    # Under autocast the GEMMs' dtypes are autocast's to choose: the Function's own backward would
    # mix the casted gradients with the saved full-precision weights.
    autocast = torch.is_autocast_enabled(x.device.type)
    return recording and not autocast and all(_plain_linear(p) for p in projections)


def project_shared_input(x: torch.Tensor, projections: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """(proj(x) for proj in projections), with the summed-input-gradient backward above when
    :func:`shared_input_applies`; otherwise as :func:`project_few_rows` (inference, autocast, LoRA,
    quantisation, hooks: the modules themselves)."""
    if shared_input_applies(x, projections):
        return _SharedInputLinear.apply(x, *(p.weight for p in projections))
    return project_few_rows(x, projections)


def project_few_rows(x: torch.Tensor, projections: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """(proj(x) for proj in projections): for a decode step's few rows (no gradient, two or more
    plain bias-free nn.Linear modules, the Triton backend) one few-row kernel launch for all of them
    (kernels/few_row_linear: cuBLAS streams such skinny products over few thread blocks, one launch
    per weight; `python -m benchmarks.few_row_sweep`); otherwise each module is
    called as usual (a single weight too: there cuBLAS is as fast or faster)."""
    weights = tuple(getattr(p, "weight", None) for p in projections)
    if (len(projections) > 1 and all(w is not None for w in weights) and all(_plain_linear(p) for p in projections)
            and not torch.is_autocast_enabled(x.device.type) and few_row_linear_applies(x, weights, FEW_ROW_BACKEND)):
        return few_row_linear(x, weights, FEW_ROW_BACKEND)
    return tuple(p(x) for p in projections)

