"""The Mamba-2 mixer between its projections on this package's Triton kernels (math: reference.py),
with one gradient buffer for the whole input projection.

Run as separate differentiable ops, the mixer's backward concatenates twice: the conv output's
gradient from the SSD's dx, dB and dC, and the input projection's from dz, dxBC and ddt (autograd's
backward of a split). Here every backward kernel writes its part of one [batch, seq, width] buffer
in place: the gated norm's dz, the conv's dxBC (from an SSD gradient written the same way into one
[batch, seq, conv channels] buffer) and ddt.

Saved for the backward: zxbcdt, y and the SSD's kept chunk states (what the separate ops keep too);
the conv output is rebuilt from zxbcdt, the step sizes from dt_raw.
"""
from __future__ import annotations

import torch

from ..causal_conv1d.triton import _CausalConv1d, causal_conv1d_backward
from ..gated_rms_norm.triton import gated_rms_norm_backward, gated_rms_norm_forward
from ..ssd_scan.reference import discretize_dt
from ..ssd_scan.triton import _SSDScan, ssd_scan_backward
from .._custom_ops import KernelContext


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


def _conv(xBC, conv_weight, conv_bias, keep, silu):
    out = _CausalConv1d.forward(KernelContext(), xBC, conv_weight, conv_bias, None, silu)
    return out if keep is None else out.mul_(keep[..., None])


def mixer_forward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size,
                  norm_group_size, eps, dt_limit, silu, keep_states):
    """(normed, y [batch, seq, I], the SSD's kept chunk states or an empty tensor)."""
    shape = MixerShape(zxbcdt, A.shape[0], head_dim, conv_weight.shape[0], state_size)
    z, xBC, dt_raw = shape.parts(zxbcdt)
    x, B, C = shape.ssd_operands(_conv(xBC, conv_weight, conv_bias, keep, silu))
    dt = discretize_dt(dt_raw, dt_bias, True, dt_limit)
    y, _, kept = _SSDScan.forward(KernelContext(), x, dt, A, B, C, D, None, keep_states)
    y = y.flatten(-2)
    return gated_rms_norm_forward(y, z, norm_weight, norm_group_size, eps), y, kept


def mixer_backward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, y, kept, dnormed,
                   head_dim, state_size, norm_group_size, eps, dt_limit, silu):
    """(dzxbcdt, dconv_weight, dconv_bias or None, dA, dD, ddt_bias, dnorm_weight)."""
    shape = MixerShape(zxbcdt, A.shape[0], head_dim, conv_weight.shape[0], state_size)
    z, xBC, dt_raw = shape.parts(zxbcdt)
    dzxbcdt = torch.empty_like(zxbcdt)
    dz, dxBC, ddt_raw = shape.parts(dzxbcdt)
    dy, _, dnorm_weight = gated_rms_norm_backward(y, z, norm_weight, dnormed, norm_group_size, eps, dz=dz)

    x, B, C = shape.ssd_operands(_conv(xBC, conv_weight, conv_bias, keep, silu))
    dxBC_conv = torch.empty((shape.batch, shape.seq, shape.channels), dtype=zxbcdt.dtype, device=zxbcdt.device)
    dx, dB, dC = shape.ssd_operands(dxBC_conv)
    pre = dt_raw.float() + dt_bias.float()
    softplus = torch.nn.functional.softplus(pre)  # discretize_dt's steps
    dt = softplus.clamp(*dt_limit) if tuple(dt_limit) != (0.0, float("inf")) else softplus
    _, ddt, dA, _, _, dD, _ = ssd_scan_backward(
        x, dt, A, B, C, D, None, kept, dy.unflatten(-1, (shape.heads, head_dim)), None, dx=dx, dB=dB, dC=dC,
    )
    del x, B, C
    if keep is not None:
        dxBC_conv.mul_(keep[..., None])
    _, dconv_weight, dconv_bias, _ = causal_conv1d_backward(xBC, conv_weight, conv_bias, None, dxBC_conv, silu, dx=dxBC)
    del dxBC_conv

    # dt = clamp(softplus(pre), low, high): softplus' derivative is sigmoid; clamp passes the
    # gradient where low <= softplus(pre) <= high (torch's clamp, bounds included).
    ddt_pre = ddt * torch.sigmoid(pre)
    if dt is not softplus:
        ddt_pre = ddt_pre * ((softplus >= dt_limit[0]) & (softplus <= dt_limit[1]))
    ddt_raw.copy_(ddt_pre)
    ddt_bias = ddt_pre.sum((0, 1)).to(dt_bias.dtype)
    return dzxbcdt, dconv_weight, dconv_bias, dA, dD, ddt_bias, dnorm_weight
