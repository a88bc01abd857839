"""Per-token loss by position and perplexity vs context length (FoX paper, Sec. 4.2), for any causal LM.

With M validation sequences, the per-token loss at position i is
``L(i) = 1/M * sum_j -log p(x_i^(j) | x_<i^(j))`` and the perplexity over a context length l is
``P(l) = exp(1/l * sum_{i=1..l} L(i))``. A monotonically falling L(i) means the model uses the whole
context; a plateau after position k means tokens more than ~k back no longer help (FoX App. C).
P(l) is a cumulative average, so its slope says little; L(i) is the curve to read.

Index convention: ``loss[i]`` is the loss of predicting token ``i + 1`` from tokens ``0..i``, i.e. with
``i + 1`` tokens of context, so a sequence of T tokens gives T - 1 values and ``P(l)`` needs T > l.
A causal model's L(i) does not depend on later tokens, so one pass over sequences of the longest
length gives P(l) for every shorter l too.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclass
class PositionLoss:
    """Per-position mean loss (nats) and how many tokens were scored at each position."""

    loss: torch.Tensor  # [T - 1] float64, nan where nothing was scored
    count: torch.Tensor  # [T - 1] int64

    @property
    def context_lengths(self) -> torch.Tensor:
        return torch.arange(1, self.loss.numel() + 1)

    def perplexity(self, lengths: Sequence[int]) -> dict[int, float]:
        """P(l) = exp(mean of L over the first l positions) for each l (positions with no score skipped)."""
        out = {}
        for length in lengths:
            if not 1 <= length <= self.loss.numel():
                raise ValueError(
                    f"context length {length} needs sequences of more than {length} tokens; these give {self.loss.numel()} positions."
                )
            values = self.loss[:length]
            values = values[~torch.isnan(values)]
            out[int(length)] = math.exp(values.mean().item()) if values.numel() else float("nan")
        return out

    def bucketed(self, edges: Sequence[int]) -> list[float]:
        """Mean L over positions (edges[k-1], edges[k]] (1-based context lengths), one value per bucket."""
        means = []
        for low, high in zip([0, *edges[:-1]], edges):
            values = self.loss[low:high]
            values = values[~torch.isnan(values)]
            means.append(values.mean().item() if values.numel() else float("nan"))
        return means

    def to_dict(self) -> dict:
        return {"loss": [None if math.isnan(v) else v for v in self.loss.tolist()], "count": self.count.tolist()}


def _as_tensor(rows, name: str) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows
    rows = list(rows)
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"{name}: every sequence must have the same length (pad with labels=-100 or bucket by length).")
    return torch.tensor(rows, dtype=torch.long)


def _accepts(model, keyword: str) -> bool:
    parameters = inspect.signature(model.forward).parameters
    return keyword in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


@torch.no_grad()
def per_token_loss(
    model,
    input_ids,
    labels=None,
    attention_mask: torch.Tensor | None = None,
    batch_size: int = 8,
    chunk_size: int = 1024,
    **forward_kwargs,
) -> PositionLoss:
    """L(i) for a causal LM over equal-length sequences (FoX Sec. 4.2).

    Args:
        model: any ``*ForCausalLM`` returning ``.logits`` ([batch, seq, vocab]); hf-hybrid models and
            plain transformers models (e.g. ``LlamaForCausalLM``) alike.
        input_ids: [N, T] tensor, list of equal-length lists, or a ``datasets.Dataset`` with an
            ``input_ids`` column (its ``labels`` column is used when ``labels`` is None).
        labels: same shape; -100 marks unscored targets. Default: every next token is scored.
        chunk_size: positions whose log-softmax is taken at once in fp32 (bounds extra memory).
        forward_kwargs: passed to every forward (e.g. ``sparse_config=...``, ``attention_mode="se"``).
    """
    if hasattr(input_ids, "column_names"):  # datasets.Dataset
        dataset = input_ids
        if "input_ids" not in dataset.column_names:
            raise ValueError("the dataset needs an input_ids column.")
        input_ids = dataset["input_ids"]
        if labels is None and "labels" in dataset.column_names:
            labels = dataset["labels"]
    ids = _as_tensor(input_ids, "input_ids")
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [num_sequences, seq_len >= 2], got shape {tuple(ids.shape)}.")
    target = ids.clone() if labels is None else _as_tensor(labels, "labels")
    if target.shape != ids.shape:
        raise ValueError(f"labels shape {tuple(target.shape)} must equal input_ids shape {tuple(ids.shape)}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and int(ids.max()) >= vocab:
        raise ValueError(f"input_ids hold token {int(ids.max())} but the model's vocab_size is {vocab}: data and model do not match.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros(ids.shape[1] - 1, dtype=torch.float64)
    count = torch.zeros(ids.shape[1] - 1, dtype=torch.long)
    if _accepts(model, "use_cache"):
        forward_kwargs.setdefault("use_cache", False)
    try:
        for start in range(0, ids.shape[0], batch_size):
            batch = ids[start : start + batch_size].to(device)
            kwargs = dict(forward_kwargs)
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask[start : start + batch_size].to(device)
            logits = model(batch, **kwargs).logits[:, :-1]
            answer = target[start : start + batch_size, 1:].to(device)
            for p in range(0, logits.shape[1], chunk_size):  # fp32 log-softmax, a slice at a time
                piece = logits[:, p : p + chunk_size].float()
                nll = F.cross_entropy(piece.transpose(1, 2), answer[:, p : p + chunk_size], ignore_index=IGNORE_INDEX, reduction="none")
                scored = answer[:, p : p + chunk_size] != IGNORE_INDEX
                total[p : p + chunk_size] += (nll * scored).sum(0).double().cpu()
                count[p : p + chunk_size] += scored.sum(0).cpu()
    finally:
        model.train(was_training)
    loss = torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))
    return PositionLoss(loss=loss, count=count)


def perplexity_by_length(result: PositionLoss, lengths: Sequence[int]) -> dict[int, float]:
    """P(l) for each context length l (see :meth:`PositionLoss.perplexity`)."""
    return result.perplexity(lengths)
