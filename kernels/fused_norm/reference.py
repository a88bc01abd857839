"""Reference per-head RMSNorm (+ rotate-half RoPE) and the RATTENTION branch-norm sum.

Both functions repeat, op for op, what the layers compute today with
``hf_hybrid.layers.norm.RMSNorm`` and ``hf_hybrid.layers.rotary.apply_rotary``, so they are
bit-identical to them (the tests check ``torch.equal``). Per row (one (token, head) vector of
head_dim D, weight row w_h of the [heads, head_dim] weight):

    RMSNorm(x) = (w_h * (x / sqrt(mean(x^2) + eps))).to(x.dtype)          math in float32
    RoPE(n)    = (n * cos + rotate_half(n) * sin).to(x.dtype),   rotate_half([n1, n2]) = [-n2, n1]

    rms_norm_rotary(x)      = RoPE(RMSNorm(x))           (RMSNorm(x) alone when cos_sin is None)
    branch_norm_sum(a, b)   = RMSNorm_a(a) + RMSNorm_b(b) (either branch may be absent)

Rounding: like the layers, the references round to the input dtype after each norm (and the
branch sum adds the two rounded terms in that dtype). The Triton kernels keep the whole row in
float32 and round once, at the output; in float32 the two agree to float32 rounding, in bfloat16
they differ by about one bfloat16 ulp of the result.
"""
from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hf_hybrid.layers.norm.RMSNorm.forward with an explicit weight and eps."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(torch.float32) * x).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary_reference(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """hf_hybrid.layers.rotary.apply_rotary: float32 math, result in x's dtype; None = identity."""
    if cos_sin is None:
        return x
    cos, sin = cos_sin
    xf = x.to(torch.float32)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def rms_norm_rotary_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [B, T, H, D], weight [H, D], cos/sin broadcastable to [B, T, 1, D] (float32).

    RoPE(RMSNorm(x)), rounded to x.dtype between the two steps as the layer does."""
    return rotary_reference(rms_norm_reference(x, weight, eps), cos_sin)


def split_eps(eps: float | tuple[float, float]) -> tuple[float, float]:
    """One eps for both branches, or (eps_a, eps_b)."""
    if isinstance(eps, (tuple, list)):
        eps_a, eps_b = eps
        return float(eps_a), float(eps_b)
    return float(eps), float(eps)


def branch_norm_sum_reference(
    a: torch.Tensor | None,
    weight_a: torch.Tensor | None,
    b: torch.Tensor | None,
    weight_b: torch.Tensor | None,
    eps: float | tuple[float, float],
) -> torch.Tensor:
    """RMSNorm_a(a) + RMSNorm_b(b) for a, b [B, T, H, D] and weights [H, D]; a missing branch
    (None) drops its term. Each term is rounded to its input dtype and the sum is taken in that
    dtype, exactly as ``swa_norm(o_swa) + rla_norm(o_rla)`` in the layer."""
    eps_a, eps_b = split_eps(eps)
    out = None
    if a is not None:
        out = rms_norm_reference(a, weight_a, eps_a)
    if b is not None:
        term = rms_norm_reference(b, weight_b, eps_b)
        out = term if out is None else out + term
    return out
