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


class MixerShape:
    """The widths of zxbcdt's parts and the SSD's tensor shapes."""

    def __init__(self, zxbcdt: torch.Tensor, heads: int, head_dim: int, channels: int, state_size: int):
        self.batch, self.seq, _ = zxbcdt.shape
        self.heads, self.head_dim, self.state_size = heads, head_dim, state_size
        self.inner, self.channels = heads * head_dim, channels
        self.groups = (channels - self.inner) // (2 * state_size)

    def parts(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z, xBC, dt_raw) views."""
        return zxbcdt.split([self.inner, self.channels, self.heads], dim=-1)

    def ssd_operands(self, xBC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [batch, seq, heads, head_dim], B, C [batch, seq, groups, N]) views of a conv output."""
        group_width = self.groups * self.state_size
        x, B, C = xBC.split([self.inner, group_width, group_width], dim=-1)
        grouped = (self.groups, self.state_size)
        return x.unflatten(-1, (self.heads, self.head_dim)), B.unflatten(-1, grouped), C.unflatten(-1, grouped)


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
    shape = MixerShape(zxbcdt, A.shape[0], head_dim, conv_weight.shape[0], state_size)
    z, xBC, dt_raw = shape.parts(zxbcdt)
    xBC = causal_conv1d_reference(xBC, conv_weight, conv_bias, None, activation, False)
    if keep is not None:
        xBC = xBC * keep[..., None].to(xBC.dtype)
    x, B, C = shape.ssd_operands(xBC)
    dt = discretize_dt(dt_raw, dt_bias, True, tuple(dt_limit))
    y = ssd_scan_reference(x, dt, A, B, C, D, None, chunk_size, False).flatten(-2)
    return gated_rms_norm_reference(y, z, norm_weight, norm_group_size, eps), y
