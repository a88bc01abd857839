"""Depthwise causal conv1d (Mamba's short convolution) in readable PyTorch: the oracle of the Triton
kernels and the CPU path.

Channel c, kernel width K, inputs x_t (channels last, [batch, seq, channels]):

    out_t[c] = act( bias[c] + sum_{k=0}^{K-1} weight[c, k] * x_{t - (K-1) + k}[c] )

with x_t = 0 before the sequence start, or the carried inputs of ``initial_state``. A state is the
last K inputs of a channel, [batch, channels, K] (the oldest first): transformers'
``LinearAttentionLayer`` conv-state layout, of which the newest K - 1 columns are read.
``act`` is SiLU or the identity. Math in float32, the result in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ACTIVATIONS = (None, "silu", "swish")


def _activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(out) if activation in ("silu", "swish") else out


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = None,
    return_final_state: bool = False,
):
    """x [batch, seq, channels]; weight [channels, K]; bias [channels] or None; initial_state
    [batch, channels, K] or None (zeros). Returns out [batch, seq, channels] (x's dtype) and, with
    return_final_state, the state after the sequence [batch, channels, K] (x's dtype)."""
    batch, seq, channels = x.shape
    width = weight.shape[-1]
    history = x.new_zeros(batch, channels, width) if initial_state is None else initial_state
    args = (x, weight, bias, history, activation)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:4]):
        # Recomputed in the backward: keeps x (alive anyway) instead of the padded input, the
        # pre-activation and the output (3 x [batch, channels, seq] float32 per layer).
        out = checkpoint(_conv, *args, use_reentrant=False)
    else:
        out = _conv(*args)
    if not return_final_state:
        return out
    final_state = torch.cat([history.to(x.dtype), x.transpose(1, 2)], dim=-1)[..., -width:]
    return out, final_state


def _conv(x, weight, bias, history, activation):
    xt = x.transpose(1, 2).float()  # [batch, channels, seq]
    padded = torch.cat([history[..., 1:].float(), xt], dim=-1)  # the K - 1 inputs before x_0, then x
    channels = x.shape[-1]
    out = F.conv1d(padded, weight.float()[:, None, :], bias.float() if bias is not None else None, groups=channels)
    return _activate(out, activation).transpose(1, 2).to(x.dtype)


def causal_conv1d_step_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One new input x [batch, channels]: shifts ``conv_state`` [batch, channels, K] left by one in
    place (x becomes its newest column) and returns the output [batch, channels] in x's dtype."""
    window = torch.cat([conv_state[..., 1:].float(), x.float()[..., None]], dim=-1)
    conv_state.copy_(window.to(conv_state.dtype))
    out = (window * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return _activate(out, activation).to(x.dtype)
