"""RATTENTION's local-layer decode step on its full window ring, RLA half: read the leaving token,
fold it into S, read out, and put the new token in its place.

The ring (hf_hybrid/models/rattention/cache_rattention.py) holds the last w + 1 tokens; column c
sits at slot c % (w + 1), and ``next_column`` (a [1] long device counter) is the new token's
column, so its slot holds the token leaving the window. For every row and kv head:

    slot = next_column % (w + 1)
    S   <- S + phi(raw_keys[slot]) values[slot]^T             float32 (the RLA's recurrence)
    o_h  = phi(q_h)^T S          for the query heads h of the kv head (GQA), rounded to q's dtype
    keys[slot], values[slot], raw_keys[slot] <- k_swa, v, k    (the new token; in place)

``next_column`` is not advanced here (the caller does, after the step's last reader). Op by op
that is a slot computation, two gathers, the RLA step, its halves' sum and cast, three scatters;
the Triton kernel (ring_decode_triton.py) is one launch, one program per row and kv head, so the
reads of a slot precede its writes within a program. The SWA half of the step then attends over
the updated ring.
"""
from __future__ import annotations

import torch

from .reference import residual_linear_attention_decode_reference


def ring_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    k_swa: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    ring_keys: torch.Tensor,
    ring_values: torch.Tensor,
    ring_raw_keys: torch.Tensor,
    next_column: torch.Tensor,
    feature_map: str = "softmax",
) -> torch.Tensor:
    """The step above, op by op. q [B, H, D] (raw query); k, k_swa, v [B, H_kv, D] (the new token's
    raw key, SWA key and value); state [B, H_kv, F, D] float32; rings [B, w + 1, H_kv, D];
    next_column [1] long. Writes state and rings in place; returns o [B, H, D]."""
    slot = next_column % ring_raw_keys.shape[1]
    k_leaving = ring_raw_keys.index_select(1, slot)[:, 0]
    v_leaving = ring_values.index_select(1, slot)[:, 0]
    o, new_state = residual_linear_attention_decode_reference(q, state, k_leaving, v_leaving, None, feature_map)
    state.copy_(new_state)
    for ring, new in ((ring_keys, k_swa), (ring_values, v), (ring_raw_keys, k)):
        ring.index_copy_(1, slot, new[:, None].to(ring.dtype))
    return o
