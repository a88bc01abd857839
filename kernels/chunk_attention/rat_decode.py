"""One RAT decode step in one kernel: gate, recurrence step, RoPE, cache writes and attention.

For every row at the same absolute position p (chunk c = p // L), with the cache's recurrent state
(k~, v~ of the open chunk) and its chunk-end buffers (RAT paper Listing 2, hf_hybrid/layers/rat_attention.py):

    g      = sigmoid(gate_logits + gate_bias)                   float32
    k~, v~ = g * state * [p % L != 0] + (1 - g) * (k, v)        float32, rounded to the input dtype
    q_rot, k_rot = RoPE(q), RoPE(k~) at chunk index c           q and k one per group of heads
    state  <- k~, v~;  key_buffer[:, c] <- k_rot;  value_buffer[:, c] <- v~     (in place)
    y      = softmax over {q_rot . key_buffer[:, i] for i < c} + {q_rot . k_rot}, applied to v

Op by op that is ~50 small launches around the chunk-end stream, a large share of the step's
time (`python -m benchmarks.profile decode rat`); here it is one launch, and the
open chunk's slot is written in the same pass because no query of this step reads it (a query of
chunk c reads slots < c). The position is read on the device, so the step can be captured in a
CUDA graph and replayed at every position. The kernel: rat_decode_triton.py.
"""
from __future__ import annotations

import torch

from ..fused_norm.reference import rotary_reference
from .._common import expand_groups

CosSin = tuple[torch.Tensor, torch.Tensor]


def rat_decode_inputs_reference(
    q_groups: torch.Tensor,
    k_groups: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor,
    gate_bias: torch.Tensor,
    state_key: torch.Tensor,
    state_value: torch.Tensor,
    position: torch.Tensor,
    chunk_size: int,
    cos_sin: CosSin | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The element-wise part above, op by op. q_groups, k_groups [B, 1, G, D]; v, gate_logits
    [B, 1, H, D]; gate_bias [H * D]; state_key / state_value [B, H, D]; position: [1] long (all
    rows); cos_sin: RoPE tables at the chunk index, [1, 1, 1, D] float32, or None (NoPE).
    Returns (q_rot, k_rot, v~ [B, 1, H, D]; k~, v~ [B, H, D]: the new state)."""
    heads, dim = v.shape[2], v.shape[3]
    gate = torch.sigmoid(gate_logits[:, 0].float() + gate_bias.float().view(heads, dim))
    keep = (position % chunk_size != 0).view(-1, 1, 1)  # False where the token opens a chunk: h_prev = 0
    k_new = expand_groups(k_groups, heads)[:, 0]
    k_tilde = (gate * (state_key.float() * keep) + (1.0 - gate) * k_new.float()).to(k_groups.dtype)
    v_tilde = (gate * (state_value.float() * keep) + (1.0 - gate) * v[:, 0].float()).to(v.dtype)
    q_rot = expand_groups(rotary_reference(q_groups, cos_sin), heads)
    return q_rot, rotary_reference(k_tilde[:, None], cos_sin), v_tilde[:, None], k_tilde, v_tilde


def decode_head_dim_supported(dim: int) -> bool:
    """The head sizes the decode-step kernels take (RAT's and RAT+'s): a power of two in [16, 256]."""
    return 16 <= dim <= 256 and not dim & (dim - 1)


def rat_decode_supported(v: torch.Tensor) -> bool:
    """Shapes the kernel takes: head_dim a power of two in [16, 256]."""
    return decode_head_dim_supported(v.shape[-1])
