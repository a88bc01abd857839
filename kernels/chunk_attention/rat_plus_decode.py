"""One RAT+ decode step on generate()'s fixed store buffers: recurrence, RoPE, store writes, attention.

The store (hf_hybrid/models/rat_plus/cache_rat_plus.py, StaticFullStore / StaticDilatedStore) is
one key buffer, one value buffer [B, C, H_kv, D] and ``stored`` [B, C]: the position each column
shows, -1 for none. Its columns (:class:`StoreLayout`) are

    [sinks (I) | block ends (one per D tokens) | ring of the last W + 1 tokens]

(the dense pattern: a ring as long as the buffer, i.e. column p holds position p). Every stored
position >= 0 is a key the decoded token sees, and each key appears once. For a token at position
p (every row at the same p), with the recurrence state (k~, v~ of token p - 1, float32):

    g      = sigmoid(gate_logits)                                    float32, per kv head and dim
    k~, v~ = g * state + (1 - g) * (k, v)                            float32 (state <- k~, v~)
    q_rot  = RoPE_p(q);  k_rot = RoPE_p(round(k~));  v_new = round(v~)   (round: to the model dtype)
    writes (:func:`store_decoded_token`): ring column first_ring + p % (W + 1) <- (k_rot, v_new) at
        position p; with block ends also column first_end + p // D (hidden: -1 until it leaves the
        ring); the token leaving the ring (p - W - 1) shows in its block-end column if it closes a
        block; sinks show once they have left the ring (and are no block end)
    y      = softmax_j(scale q_rot . keys_j) values_j over the columns with stored_j >= 0

Without a recurrence (``use_recurrence=False``: the paper's attention baseline) k~, v~ = k, v.
Op by op that is ~30 small launches per layer (`python -m benchmarks.profile decode rat_plus_d16`);
the Triton path (rat_plus_decode_triton.py) is two: the
element-wise part with the writes, then a split-K pass over the store (kernels/_split_decode.py).
Everything moving per token is read on the device, so a CUDA graph replays the step at any p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fused_norm.reference import rotary_reference
from ..topk_block_attention.reference import masked_attention_reference

CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StoreLayout:
    """Where a decoded token goes in a static store. ``dilation`` 0: no block ends (dense)."""

    first_end: int
    first_ring: int
    ring: int
    dilation: int = 0
    window: int = 0
    sinks: int = 0

    @classmethod
    def dense(cls, capacity: int) -> "StoreLayout":
        return cls(first_end=0, first_ring=0, ring=capacity)


def store_decoded_token(
    keys: torch.Tensor,
    values: torch.Tensor,
    stored: torch.Tensor,
    k_rot: torch.Tensor,
    v_new: torch.Tensor,
    position: torch.Tensor,
    layout: StoreLayout,
    sink_valid: torch.Tensor | None = None,
    sink_positions: torch.Tensor | None = None,
) -> None:
    """The writes above, in place. keys / values [B, C, H_kv, D], stored [B, C] long; k_rot / v_new
    [B, 1, H_kv, D]; position [1] long on the device; sink_valid [B, I] bool (which sinks the rows
    hold); sink_positions: arange(I) on the device (a constant, so a captured step allocates nothing)."""
    batch = keys.shape[0]
    ring_col = layout.first_ring + position % layout.ring
    columns = [ring_col]
    if layout.dilation:  # the block-end slot's K/V stay hidden until the block end leaves the ring
        columns.append(layout.first_end + torch.div(position, layout.dilation, rounding_mode="floor"))
    for col in columns:
        keys.index_copy_(1, col, k_rot)
        values.index_copy_(1, col, v_new)
    stored.index_copy_(1, ring_col, position.expand(batch, 1))
    if not layout.dilation:
        return
    # The position leaving the ring now (p - W - 1) becomes visible in its own column.
    leaving = position - layout.window - 1
    closes = (leaving >= 0) & ((leaving + 1) % layout.dilation == 0)
    leaving_end_col = layout.first_end + torch.div(leaving.clamp(min=0), layout.dilation, rounding_mode="floor")
    # Slot leaving // D holds no visible block end before its own one leaves: writing -1 is harmless.
    stored.index_copy_(1, leaving_end_col, torch.where(closes, leaving, -1).expand(batch, 1))
    if layout.sinks:
        stored[:, : layout.sinks] = visible_sinks(sink_valid, sink_positions, position - layout.window, layout.dilation)


def visible_sinks(sink_valid: torch.Tensor, sink_positions: torch.Tensor, left, dilation: int) -> torch.Tensor:
    """The sink columns' positions: held sinks that have left the ring (below ``left``, an int or a
    device tensor) and are no block end, else -1."""
    shown = sink_valid & (sink_positions < left) & ((sink_positions + 1) % dilation != 0)
    return torch.where(shown, sink_positions, -1)


def rat_plus_decode_step_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_logits: torch.Tensor | None,
    state_key: torch.Tensor | None,
    state_value: torch.Tensor | None,
    position: torch.Tensor,
    cos_sin: CosSin | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    stored: torch.Tensor,
    layout: StoreLayout,
    sink_valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The whole step above, op by op; writes the state and the store in place and returns y
    [B, 1, H, D]. q [B, 1, H, D]; k, v, gate_logits [B, 1, H_kv, D] (gate_logits None: no
    recurrence, and the states are unused); state_key / state_value [B, H_kv, D] float32;
    cos_sin: RoPE tables at p, broadcastable to [B, 1, 1, D], or None (NoPE)."""
    if gate_logits is not None:
        gate = torch.sigmoid(gate_logits[:, 0].float())
        k_tilde = gate * state_key + (1.0 - gate) * k[:, 0].float()
        v_tilde = gate * state_value + (1.0 - gate) * v[:, 0].float()
        state_key.copy_(k_tilde)
        state_value.copy_(v_tilde)
    else:
        k_tilde, v_tilde = k[:, 0].float(), v[:, 0].float()
    q_rot = rotary_reference(q, cos_sin)
    k_rot = rotary_reference(k_tilde.to(keys.dtype)[:, None], cos_sin)
    sink_positions = torch.arange(layout.sinks, device=keys.device)
    store_decoded_token(keys, values, stored, k_rot, v_tilde.to(values.dtype)[:, None], position, layout,
                        sink_valid, sink_positions)
    visible = (stored >= 0)[:, None, None, :]
    return masked_attention_reference(q_rot, keys, values, visible, scale)
