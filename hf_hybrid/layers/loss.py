"""The causal-LM head and loss of HybridForCausalLM: logits = lm_head(hidden), loss = ForCausalLMLoss.

In training the logits are usually not wanted, only the loss: there, on CUDA (backbone_fusion.py),
the LM head and the cross-entropy run fused, chunk by chunk (kernels/linear_cross_entropy), and the
float32 logits of the whole sequence ([T, vocab] x 4 bytes, plus their gradient) never exist. The loss is
transformers' ForCausalLMLoss: labels shifted left by one (the last position predicts nothing),
``ignore_index`` (-100) skipped, mean over the counted tokens, or a sum divided by
``num_items_in_batch`` when the Trainer passes it (gradient accumulation). ``shift_labels``, when
given, are the targets as they are (already shifted: context-parallel and sequence-parallel
trainers split them with the tokens, so the target of a shard's last token comes from the next
shard); ``labels`` may then be None.

Which path runs (``skip_logits``, Liger's name for the same switch):
- ``skip_logits=None`` (default): fused when training with labels, the fusion applies and the
  LM head is a plain nn.Linear (a PEFT-wrapped head keeps the plain path), with logits_to_keep=0;
- ``skip_logits=False``: always the plain path, ``outputs.logits`` is filled (callers that need
  the logits in training, e.g. for distillation or logging, pass it);
- ``skip_logits=True``: no logits are returned; the loss is fused where the fusion applies.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from .backbone_fusion import fused_loss_applies

# The loss keywords of transformers' causal LMs (ForCausalLMLoss), taken from forward()'s kwargs.
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


def shifted_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels[..., 1:] padded with ignore_index at the end: position t is scored on token t + 1."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def causal_lm_loss_from_hidden(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """ForCausalLMLoss(hidden_states @ lm_head_weight.T, labels) computed from the hidden states:
    fused (kernels/linear_cross_entropy) where the fusion applies, else through float32 logits as
    transformers does.
    ``shift_labels`` (already shifted targets) replace ``labels`` when given."""
    if shift_labels is None:
        shift_labels = shifted_labels(labels, ignore_index)
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    if fused_loss_applies(hidden):
        loss = linear_cross_entropy(hidden, lm_head_weight.to(hidden.dtype), targets, ignore_index, reduction, backend="triton")
    else:
        loss = linear_cross_entropy_reference(hidden, lm_head_weight, targets, ignore_index, reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _fuse_loss(model, hidden_states, has_targets, logits_to_keep, skip_logits) -> bool:
    if not has_targets or skip_logits is False:
        return False
    if skip_logits:
        return True
    return (
        model.training
        and isinstance(logits_to_keep, int) and logits_to_keep == 0
        and fused_loss_applies(hidden_states)
    )


def _plain_head(head: nn.Module) -> bool:
    """Whether the LM head's weight may be read directly. A head with hooks (PEFT, accelerate
    offload, DeepSpeed ZeRO-3's gather) must be called, not read."""
    return type(head) is nn.Linear and head.bias is None and not (head._forward_hooks or head._forward_pre_hooks or hasattr(head, "_hf_hook"))


def lm_head_and_loss(model, hidden_states, labels, logits_to_keep, kwargs: dict):
    """(logits, loss) of a causal LM with ``model.lm_head`` and ``model.loss_function``; logits is
    None when the fused loss ran (see the module docstring). ``kwargs``: the forward's extra keywords
    (the loss keywords LOSS_KWARGS and skip_logits are read from it). The loss is computed when
    ``labels`` or ``shift_labels`` is given."""
    skip_logits = kwargs.get("skip_logits")
    loss_kwargs = {k: v for k, v in kwargs.items() if k in LOSS_KWARGS and v is not None}
    has_targets = labels is not None or "shift_labels" in loss_kwargs
    # logits_to_keep: an int keeps the last N positions (0 = all), a tensor selects indices.
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    if _plain_head(model.lm_head) and _fuse_loss(model, hidden_states, has_targets, logits_to_keep, skip_logits):
        return None, causal_lm_loss_from_hidden(hidden_states[:, keep, :], model.lm_head.weight, labels, **loss_kwargs)
    logits = model.lm_head(hidden_states[:, keep, :])
    loss = None
    if has_targets:
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs)
    return (None if skip_logits and has_targets else logits), loss


def lm_head_and_row_group_losses(model, hidden_states, labels, logits_to_keep, kwargs: dict, num_groups: int):
    """``lm_head_and_loss`` over ``num_groups`` copies of one batch stacked along the rows (rows
    [0:B] the first copy, [B:2B] the second, ...; RAT+'s joint forward): the LM head runs once over
    every row, and each copy's loss is taken against the batch's own targets (``labels`` /
    ``shift_labels`` of B rows, the loss keywords as given). Returns (logits of every row, or None
    where ``lm_head_and_loss`` returns none, the [num_groups] losses)."""
    skip_logits = kwargs.get("skip_logits")
    loss_kwargs = {k: v for k, v in kwargs.items() if k in LOSS_KWARGS and v is not None}
    if labels is None and "shift_labels" not in loss_kwargs:
        raise ValueError("lm_head_and_row_group_losses needs labels or shift_labels.")
    if hidden_states.shape[0] % num_groups:
        raise ValueError(f"{hidden_states.shape[0]} rows do not split into {num_groups} equal row groups.")
    rows = hidden_states.shape[0] // num_groups
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    if _plain_head(model.lm_head) and _fuse_loss(model, hidden_states, True, logits_to_keep, skip_logits):
        losses = [
            causal_lm_loss_from_hidden(hidden_states[g * rows : (g + 1) * rows, keep, :], model.lm_head.weight, labels, **loss_kwargs)
            for g in range(num_groups)
        ]
        return None, torch.stack(losses)
    logits = model.lm_head(hidden_states[:, keep, :])
    losses = [
        model.loss_function(logits=logits[g * rows : (g + 1) * rows], labels=labels, vocab_size=model.config.vocab_size, **loss_kwargs)
        for g in range(num_groups)
    ]
    return (None if skip_logits else logits), torch.stack(losses)
