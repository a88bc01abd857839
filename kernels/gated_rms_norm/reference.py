"""Reference gated RMSNorm: Mamba-2's output norm, as transformers' ``BambaRMSNormGated`` computes it.

For y (the scan output, ``hidden_states``) and z (the gate), both [..., D_total], and a weight
[D_total], with D_total = groups * group_size and the norm taken per group of group_size
consecutive features:

    h   = y * silu(z)                                  float32 math
    r   = rsqrt(mean(h^2 over the group) + eps)
    n   = (h * r).to(y.dtype)                          first rounding, to the input dtype
    out = weight * n                                   in torch.result_type(weight, y): a second
                                                       rounding when that is bf16 / fp16

Backward (float32, per group row; s = silu(z), nh = h * r, g = dout * weight; the roundings
count as identity, as autograd treats ``.to``):

    dweight = sum over all rows of dout * nh
    dh      = r * (g - nh * mean(g * nh over the group))
    dy      = dh * s
    dz      = dh * y * sigmoid(z) * (1 + z * (1 - sigmoid(z)))      (= dh * y * silu'(z))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm_reference(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """BambaRMSNormGated.forward(y, z) with an explicit weight, group size and eps; bit-identical
    to it for float16 / bfloat16 / float32 inputs. Float64 inputs keep float64 math (the module
    would drop to float32), which makes this an exact oracle for the kernel's tests."""
    input_dtype = y.dtype
    math_dtype = torch.promote_types(input_dtype, torch.float32)
    h = y.to(math_dtype) * F.silu(z.to(math_dtype))
    grouped = h.unflatten(-1, (-1, group_size))
    r = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    normed = (grouped * r).flatten(-2).to(input_dtype)
    return weight * normed
