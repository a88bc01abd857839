"""The Mamba-2 mixer between its projections on this package's Triton kernels (math: reference.py),
with one gradient buffer for the whole input projection.

Run as separate differentiable ops, the mixer's backward concatenates twice: the conv output's
gradient from the SSD's dx, dB and dC, and the input projection's from dz, dxBC and ddt (autograd's
backward of a split). Here every backward kernel writes its part of one [batch, seq, width] buffer
in place: the gated norm's dz, the conv's dxBC (from an SSD gradient written the same way into one
[batch, seq, conv channels] buffer) and ddt.

Saved for the backward: zxbcdt, y, and where the SSD keeps its chunk states, those and the conv
output (else the backward rebuilds them from zxbcdt); the step sizes and their log decay are rebuilt
from dt_raw (one launch, ssd_scan/step_sizes.py).
"""
from __future__ import annotations

import torch

from ..causal_conv1d.triton import _CausalConv1d, causal_conv1d_backward
from ..gated_rms_norm.triton import gated_rms_norm_backward, gated_rms_norm_forward
from ..ssd_scan.step_sizes import discretized_step_sizes, discretized_step_sizes_backward
from ..ssd_scan.triton import chunk_length, ssd_scan_backward, ssd_scan_forward
from .._custom_ops import KernelContext
from .reference import MixerShape


def _conv(xBC, conv_weight, conv_bias, keep, silu):
    out = _CausalConv1d.forward(KernelContext(), xBC, conv_weight, conv_bias, None, silu)
    return out if keep is None else out.mul_(keep[..., None])


def mixer_forward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, head_dim, state_size,
                  norm_group_size, eps, dt_limit, silu, keep_states):
    """(normed, y [batch, seq, I], the SSD's chunk states and the conv output kept for the backward).
    ``keep_states`` (a training forward whose chunk states fit ssd_scan.triton's KEEP_STATES_MAX_BYTES)
    keeps both, the conv output being half the states' size (71 MB a layer at 8K tokens of the SE
    hybrid's 1.3B mixer), so the backward runs no conv forward; else both are empty tensors."""
    shape = MixerShape(zxbcdt, A.shape[0], head_dim, conv_weight.shape[0], state_size)
    z, xBC, dt_raw = shape.parts(zxbcdt)
    conv_out = _conv(xBC, conv_weight, conv_bias, keep, silu)
    x, B, C = shape.ssd_operands(conv_out)
    dt, g = discretized_step_sizes(dt_raw, dt_bias, A, dt_limit, chunk_length())
    y, _, kept = ssd_scan_forward(x, dt, A, B, C, D, None, keep_states, g=g)
    y = y.flatten(-2)
    kept_conv = conv_out if keep_states else zxbcdt.new_empty(0)
    return gated_rms_norm_forward(y, z, norm_weight, norm_group_size, eps), y, kept, kept_conv


def mixer_backward(zxbcdt, conv_weight, conv_bias, A, D, dt_bias, norm_weight, keep, y, kept, kept_conv, dnormed,
                   head_dim, state_size, norm_group_size, eps, dt_limit, silu):
    """(dzxbcdt, dconv_weight, dconv_bias or None, dA, dD, ddt_bias, dnorm_weight)."""
    shape = MixerShape(zxbcdt, A.shape[0], head_dim, conv_weight.shape[0], state_size)
    z, xBC, dt_raw = shape.parts(zxbcdt)
    dzxbcdt = torch.empty_like(zxbcdt)
    dz, dxBC, ddt_raw = shape.parts(dzxbcdt)
    dy, _, dnorm_weight = gated_rms_norm_backward(y, z, norm_weight, dnormed, norm_group_size, eps, dz=dz)

    conv_out = kept_conv if kept_conv.numel() else _conv(xBC, conv_weight, conv_bias, keep, silu)
    x, B, C = shape.ssd_operands(conv_out)
    dxBC_conv = torch.empty((shape.batch, shape.seq, shape.channels), dtype=zxbcdt.dtype, device=zxbcdt.device)
    dx, dB, dC = shape.ssd_operands(dxBC_conv)
    dt, g = discretized_step_sizes(dt_raw, dt_bias, A, dt_limit, chunk_length())
    _, ddt, dA, _, _, dD, _ = ssd_scan_backward(
        x, dt, A, B, C, D, None, kept, dy.unflatten(-1, (shape.heads, head_dim)), None, dx=dx, dB=dB, dC=dC, g=g,
    )
    del x, B, C, conv_out
    if keep is not None:
        dxBC_conv.mul_(keep[..., None])
    _, dconv_weight, dconv_bias, _ = causal_conv1d_backward(xBC, conv_weight, conv_bias, None, dxBC_conv, silu, dx=dxBC)
    del dxBC_conv
    ddt_bias = discretized_step_sizes_backward(ddt, dt_raw, dt_bias, dt_limit, ddt_raw).to(dt_bias.dtype)
    return dzxbcdt, dconv_weight, dconv_bias, dA, dD, ddt_bias, dnorm_weight
