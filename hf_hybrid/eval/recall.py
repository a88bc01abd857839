"""Recall accuracy on labelled synthetic tasks (e.g. MQAR): argmax prediction at every labelled token."""
from __future__ import annotations

import torch


@torch.no_grad()
def recall_accuracy(model, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 64, **forward_kwargs) -> float:
    """Fraction of labelled positions (label != -100) whose next-token argmax equals the label."""
    device = next(model.parameters()).device
    correct = total = 0
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size].to(device)
        target = labels[start : start + batch_size].to(device)
        predictions = model(ids, use_cache=False, **forward_kwargs).logits[:, :-1].argmax(-1)
        answer = target[:, 1:]
        scored = answer != -100
        correct += int((predictions[scored] == answer[scored]).sum())
        total += int(scored.sum())
    return correct / max(total, 1)
