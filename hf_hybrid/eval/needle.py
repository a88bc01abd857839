"""Needle-in-a-haystack accuracy by context length x needle depth, for any causal LM.

Scoring is teacher-forced exact match: an answer value counts as retrieved when the model's argmax
prediction is right at every one of its tokens (the tokens before it, including earlier answers of
the same example, are the true ones). For one value this equals greedy decoding of that value
from the prompt; for several it is greedy decoding of each value with the answer template and the
earlier values given. An example's score is the fraction of its values retrieved (RULER's
"all" metric), and ``exact`` says whether all were. Data: :func:`hf_hybrid.data.make_needle_dataset`.
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .positions import _accepts


@dataclass
class NeedleGrid:
    """Mean score per (depth, length) cell: ``accuracy[d][l]`` for ``depths[d]`` and ``lengths[l]``."""

    lengths: list[int]
    depths: list[float]
    accuracy: list[list[float]]
    count: list[list[int]]
    tasks: list[str] = field(default_factory=list)

    @property
    def mean(self) -> float:
        cells = [(a, c) for row_a, row_c in zip(self.accuracy, self.count) for a, c in zip(row_a, row_c) if c]
        return sum(a * c for a, c in cells) / max(sum(c for _, c in cells), 1)

    def by_length(self) -> dict[int, float]:
        """Mean over depths, weighted by examples, for every length."""
        out = {}
        for j, length in enumerate(self.lengths):
            weight = sum(self.count[i][j] for i in range(len(self.depths)))
            out[length] = sum(self.accuracy[i][j] * self.count[i][j] for i in range(len(self.depths))) / max(weight, 1)
        return out

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "depths": self.depths, "accuracy": self.accuracy, "count": self.count,
                "tasks": self.tasks, "mean": self.mean, "by_length": {str(k): v for k, v in self.by_length().items()}}

    def plot(self, path, title: str | None = None) -> Path:
        """Heatmap PNG (depth rows x length columns); see hf_hybrid.eval.plots.plot_needle_heatmaps."""
        from .plots import plot_needle_heatmaps

        return plot_needle_heatmaps({title or "needle": self}, path)


def _keep_argument(model, start: int, length: int) -> dict:
    """Ask only for the logits from ``start`` on where the model supports logits_to_keep."""
    parameters = inspect.signature(model.forward).parameters
    return {"logits_to_keep": length - start} if "logits_to_keep" in parameters and start > 0 else {}


@torch.no_grad()
def needle_scores(model, dataset, batch_size: int = 8, **forward_kwargs) -> list[dict]:
    """One dict per example: task, length, depth, score (fraction of values right), exact (all right)."""
    for column in ("input_ids", "answer_spans", "length", "depth"):
        if column not in dataset.column_names:
            raise ValueError(f"needle dataset needs a {column!r} column (build it with hf_hybrid.data.make_needle_dataset).")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    device = next(model.parameters()).device
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    groups: dict[int, list[int]] = defaultdict(list)  # equal-length rows batch together
    for index, ids in enumerate(dataset["input_ids"]):
        if vocab is not None and max(ids) >= vocab:
            raise ValueError(
                f"example {index} holds token {max(ids)} but the model's vocab_size is {vocab}: build the dataset with the "
                "model's tokenizer (tokenizer=...) or train the model on NeedleVocab ids."
            )
        groups[len(ids)].append(index)
    spans_all, meta = dataset["answer_spans"], dataset.select_columns([c for c in ("task", "length", "depth") if c in dataset.column_names])
    was_training = model.training
    model.eval()
    results: dict[int, dict] = {}
    if _accepts(model, "use_cache"):
        forward_kwargs.setdefault("use_cache", False)
    try:
        for length, indices in groups.items():
            for start in range(0, len(indices), batch_size):
                rows = indices[start : start + batch_size]
                ids = torch.tensor([dataset[i]["input_ids"] for i in rows], device=device)
                first = min(span[0] for i in rows for span in spans_all[i])
                keep = _keep_argument(model, first - 1, length)
                logits = model(ids, **keep, **forward_kwargs).logits
                offset = length - logits.shape[1]  # logits[:, k] predicts token offset + k + 1
                predictions = logits.argmax(-1)
                for b, i in enumerate(rows):
                    right = [
                        bool((predictions[b, s - 1 - offset : e - 1 - offset] == ids[b, s:e]).all()) for s, e in spans_all[i]
                    ]
                    row = meta[i]
                    results[i] = {**row, "score": sum(right) / len(right), "exact": all(right)}
    finally:
        model.train(was_training)
    return [results[i] for i in range(len(dataset))]


def needle_grid(scores: list[dict]) -> NeedleGrid:
    """Average per-example scores into a depth x length grid."""
    lengths = sorted({r["length"] for r in scores})
    depths = sorted({r["depth"] for r in scores})
    total = defaultdict(float)
    count = defaultdict(int)
    for r in scores:
        total[r["depth"], r["length"]] += r["score"]
        count[r["depth"], r["length"]] += 1
    return NeedleGrid(
        lengths=lengths,
        depths=depths,
        accuracy=[[total[d, l] / count[d, l] if count[d, l] else float("nan") for l in lengths] for d in depths],
        count=[[count[d, l] for l in lengths] for d in depths],
        tasks=sorted({r.get("task", "") for r in scores}),
    )


def needle_accuracy(model, dataset, batch_size: int = 8, **forward_kwargs) -> NeedleGrid:
    """Needle accuracy of ``model`` on ``dataset`` by length x depth (see the module docstring)."""
    return needle_grid(needle_scores(model, dataset, batch_size=batch_size, **forward_kwargs))
