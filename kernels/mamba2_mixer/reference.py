"""The Mamba-2 mixer between its two projections, in plain PyTorch: the composition of this
package's references (the oracle of triton.py, which runs the same steps with one gradient buffer).

zxbcdt = in_proj(hidden) = [z | xBC | dt_raw]   widths I = heads * head_dim, I + 2 * groups * N, heads
    xBC'      = act(causal depthwise conv1d(xBC)) * keep            (keep: 1 on real tokens, 0 on padding)
    x, B, C   = xBC' split [I | groups * N | groups * N]
    dt        = clamp(softplus(dt_raw + dt_bias), *dt_limit)
    y         = SSD(x, dt, A, B, C) + D x                           (kernels/ssd_scan/reference.py)
    normed    = gated RMSNorm(y, z) with weight, per group of norm_group_size features
returns (normed, y), both [batch, seq, I]; out_proj(normed) is the mixer's output.
"""
from __future__ import annotations

import torch

from ..causal_conv1d.reference import causal_conv1d_reference
from ..gated_rms_norm.reference import gated_rms_norm_reference
from ..ssd_scan.reference import DEFAULT_CHUNK_SIZE, discretize_dt, ssd_scan_reference


def mamba2_mixer_reference(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    keep: torch.Tensor | None,
    head_dim: int,
    state_size: int,
    norm_group_size: int,
    eps: float,
    dt_limit: tuple[float, float],
    activation: str | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, _ = zxbcdt.shape
    heads, channels = A.shape[0], conv_weight.shape[0]
    inner = heads * head_dim
    z, xBC, dt_raw = zxbcdt.split([inner, channels, heads], dim=-1)
    xBC = causal_conv1d_reference(xBC, conv_weight, conv_bias, None, activation, False)
    if keep is not None:
        xBC = xBC * keep[..., None].to(xBC.dtype)
    group_width = (channels - inner) // 2
    x, B, C = xBC.split([inner, group_width, group_width], dim=-1)
    groups = group_width // state_size
    y = ssd_scan_reference(
        x.reshape(batch, seq, heads, head_dim),
        discretize_dt(dt_raw, dt_bias, True, tuple(dt_limit)),
        A,
        B.reshape(batch, seq, groups, state_size),
        C.reshape(batch, seq, groups, state_size),
        D, None, chunk_size, False,
    ).reshape(batch, seq, inner)
    return gated_rms_norm_reference(y, z, norm_weight, norm_group_size, eps), y
