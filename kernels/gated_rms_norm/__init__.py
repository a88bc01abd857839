"""Gated RMSNorm, Mamba-2's output norm (transformers' ``BambaRMSNormGated``), fused.

    gated_rms_norm(y, z, weight) = weight * (RMSNorm_per_group(y * silu(z))).to(y.dtype)

y, z [..., D_total], weight [D_total], the norm per group of group_size consecutive features.
The Triton path reads y and z once and writes the output once (forward), and reads y, z and the
output gradient once and writes dy and dz once (backward), with BambaRMSNormGated's two roundings.
See reference.py for the math, triton.py for the kernels.
"""
from __future__ import annotations

import torch

from .._backend import resolve_backend
from .._custom_ops import fake_like, kernel_op
from .reference import gated_rms_norm_reference

__all__ = ["gated_rms_norm", "gated_rms_norm_reference"]

OP = "gated_rms_norm"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_GROUP_SIZE = 8192  # = triton.MAX_GROUP_SIZE (kept here so the check needs no Triton import)


# ---------------------------------------------------------------- input checks


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        got = "a 0-dim tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{OP}: {name} must be a [..., D_total] tensor; got {got}.")
    if t.dtype not in DTYPES:
        raise ValueError(
            f"{OP}: {name} must be float16, bfloat16 or float32; got {t.dtype}. "
            "Cast it with .to(torch.bfloat16) or .float()."
        )


def _check_inputs(y, z, weight, group_size, eps) -> None:
    for name, t in (("y", y), ("z", z), ("weight", weight)):
        _check_tensor(name, t)
    if z.shape != y.shape:
        raise ValueError(f"{OP}: z (the gate) must have y's shape {tuple(y.shape)}; got {tuple(z.shape)}.")
    d_total = y.shape[-1]
    if tuple(weight.shape) != (d_total,):
        raise ValueError(f"{OP}: weight must be [D_total] = ({d_total},), y's last dim; got {tuple(weight.shape)}.")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or d_total % group_size:
        raise ValueError(
            f"{OP}: group_size must be a positive int dividing D_total = {d_total} "
            f"(D_total // n_groups; = D_total for one group); got {group_size!r}."
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{OP}: eps must be a float >= 0; got {eps!r}.")
    devices = {name: t.device for name, t in (("z", z), ("weight", weight)) if t.device != y.device}
    if devices:
        raise ValueError(
            f"{OP}: z and weight must be on y's device {y.device}; got {devices}. Move them with .to(y.device)."
        )


def _pick_impl(backend: str, y: torch.Tensor, group_size: int) -> str:
    """"triton" or "reference"; "auto" falls back to the reference where the kernel does not apply."""
    impl = resolve_backend(backend, y.device, OP)
    if impl != "triton":
        return impl
    too_large = group_size > TRITON_MAX_GROUP_SIZE
    if too_large and backend == "triton":
        raise ValueError(
            f"{OP}: backend='triton' supports group_size <= {TRITON_MAX_GROUP_SIZE}; got {group_size}. "
            "Pass backend='reference'."
        )
    return "reference" if too_large or y.numel() == 0 else "triton"


# ---------------------------------------------------------------- public op


def gated_rms_norm(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """BambaRMSNormGated.forward(y, gate=z) with an explicit weight, group size and eps.

    y (the scan output) and z (the gate) [..., D_total], one shape, any of float16 / bfloat16 /
    float32 (strided views are fine while the last dim is contiguous: z may be a slice of the input
    projection's output); weight [D_total]; group_size divides D_total (D_total // n_groups).
    Returns [..., D_total] in torch.result_type(weight, y), differentiable in y, z and weight.
    backend: "auto" (Triton on CUDA, the reference elsewhere), "triton", "reference"; both give
    the module's numbers (the same two roundings), to float32 summation order.
    """
    _check_inputs(y, z, weight, group_size, eps)
    if _pick_impl(backend, y, group_size) == "reference":
        return gated_rms_norm_reference(y, z, weight, group_size, eps)
    return gated_rms_norm_fwd(y, z, weight, group_size, float(eps))


# ---------------------------------------------------------------- custom ops (see .._custom_ops)


@kernel_op("gated_rms_norm_fwd")
def gated_rms_norm_fwd(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    from .triton import gated_rms_norm_forward

    return gated_rms_norm_forward(y, z, weight, group_size, eps)


@gated_rms_norm_fwd.register_fake
def _(y, z, weight, group_size, eps):
    return torch.empty(y.shape, dtype=torch.result_type(weight, y), device=y.device)


@kernel_op("gated_rms_norm_bwd")
def gated_rms_norm_bwd(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, dout: torch.Tensor, group_size: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import gated_rms_norm_backward

    return gated_rms_norm_backward(y, z, weight, dout, group_size, eps)


@gated_rms_norm_bwd.register_fake
def _(y, z, weight, dout, group_size, eps):
    return fake_like(y, z, weight)


def _setup(ctx, inputs, output):
    y, z, weight, group_size, eps = inputs
    ctx.save_for_backward(y, z, weight)
    ctx.group_size, ctx.eps = group_size, eps


def _backward(ctx, dout):
    y, z, weight = ctx.saved_tensors
    dy, dz, dweight = gated_rms_norm_bwd(y, z, weight, dout, ctx.group_size, ctx.eps)
    return dy, dz, dweight, None, None


gated_rms_norm_fwd.register_autograd(_backward, setup_context=_setup)
