"""RAT+'s joint objective in ONE forward: the batch once per training pattern, stacked along the rows.

Rows [0:B] run under the first pattern, [B:2B] under the second, ... (``RowPatterns.stacked``): the
embeddings, norms, projections, recurrence, MLPs and the LM head run once over every row, and only
each layer's attention splits the rows by pattern (``RatPlusAttention._row_group_attention``). Each
copy's loss is taken against the batch's own targets, and the total is sum_i w_i L_i as with one
forward per pattern, so loss, ``pattern_losses`` and every gradient equal the plain sum of the
patterns' forwards.

Why: every parameter is used by one forward, once per step. DeepSpeed ZeRO-3 gathers a module's
parameters around its forward and reduces each gradient once per backward, so one forward per
pattern fails there (a parameter reduced twice); FSDP2 gathers each layer once instead of once per
pattern. The cost is the memory of every pattern's activations at once, as when every pattern's
graph is kept until the backward; the default path (``joint_objective.py``) holds one pass's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ...layers.loss import lm_head_and_row_group_losses
from ...sparse import RowPatterns, SparseInferenceConfig

# Inputs with one entry per row (a [batch, ...] tensor), copied once per pattern.
ROW_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "seq_idx")
# Cumulative document lengths over the flattened batch: each copy's continue after the previous copy's.
CUMULATIVE_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k")


def stack_rows(inputs: dict, copies: int, batch: int) -> dict:
    """``inputs`` of a [batch, ...] batch made into ``copies`` copies of it stacked along the rows."""
    out = dict(inputs)
    for name in ROW_INPUTS:
        value = inputs.get(name)
        # (position_ids of one row, shared by every row, stay as they are)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
            out[name] = torch.cat([value] * copies)
    for name in CUMULATIVE_INPUTS:
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() >= 2:
            total = value[-1:]
            out[name] = torch.cat([value[:1]] + [value[1:] + i * total for i in range(copies)])
    return out


def stacked_joint_forward(model, patterns: Sequence[SparseInferenceConfig], weights: Sequence[float], inputs: dict):
    """Run the joint objective as one forward of ``model`` (a RatPlusForCausalLM); returns (the
    first pattern's rows of the outputs, the weighted total loss, the unweighted loss of each
    pattern, detached), as ``joint_loss`` does. ``inputs``: the forward's keywords (labels,
    logits_to_keep and the loss keywords among them)."""
    inputs = dict(inputs)
    labels, logits_to_keep = inputs.pop("labels", None), inputs.pop("logits_to_keep", 0)
    rows = inputs["input_ids"] if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
    batch, copies = rows.shape[0], len(patterns)
    outputs = model.model(
        **stack_rows(inputs, copies, batch), use_cache=False, sparse_config=RowPatterns.stacked(patterns, batch)
    )
    logits, losses = lm_head_and_row_group_losses(model, outputs.last_hidden_state, labels, logits_to_keep, inputs, copies)
    total = sum(w * losses[i] for i, w in enumerate(weights))

    def first_rows(tensors):
        return None if tensors is None else tuple(None if t is None else t[:batch] for t in tensors)

    first = dict(
        logits=None if logits is None else logits[:batch],
        hidden_states=first_rows(outputs.hidden_states),
        attentions=first_rows(outputs.attentions),
    )
    return first, total, losses.detach()


__all__ = ["stack_rows", "stacked_joint_forward"]
