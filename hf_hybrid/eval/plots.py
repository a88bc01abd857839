"""PNG charts for the evaluation results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install matplotlib (or hf-hybrid[test]).") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_buckets(num_positions: int, per_octave: int = 4) -> list[int]:
    """Bucket edges (1-based context lengths) spaced evenly in log2, ending at num_positions."""
    edges, k = [], 0
    while True:
        edge = min(num_positions, max(1, round(2 ** (k / per_octave))))
        if not edges or edge > edges[-1]:
            edges.append(edge)
        if edge >= num_positions:
            return edges
        k += 1


def _smoothed(loss: Sequence[float], per_octave: int = 4) -> tuple[list[float], list[float]]:
    """(bucket centre, mean loss) pairs over log-spaced buckets, skipping missing values."""
    xs, ys, low = [], [], 0
    for high in log_buckets(len(loss), per_octave):
        values = [v for v in loss[low:high] if v is not None and not math.isnan(v)]
        if values:
            xs.append(math.sqrt((low + 1) * high))
            ys.append(sum(values) / len(values))
        low = high
    return xs, ys


def plot_loss_by_position(
    curves: Mapping[str, Sequence[float]],
    path,
    perplexities: Mapping[str, Mapping[int, float]] | None = None,
    title: str = "per-token loss by position",
) -> Path:
    """Left: L(i) against context length (log x, log-bucket means); right: P(l) against l if given.

    ``curves`` maps a model name to its per-position losses (``PositionLoss.loss.tolist()``).
    """
    plt = _pyplot()
    panels = 2 if perplexities else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    for name, loss in curves.items():
        xs, ys = _smoothed(list(loss))
        ax.plot(xs, ys, marker=".", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position (context length)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if perplexities:
        ax = axes[0][1]
        for name, by_length in perplexities.items():
            items = sorted((int(k), v) for k, v in by_length.items())
            ax.plot([k for k, _ in items], [v for _, v in items], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length l")
        ax.set_ylabel("perplexity P(l)")
        ax.set_title("perplexity vs context length", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_needle_heatmaps(grids: Mapping[str, object], path, title: str | None = None) -> Path:
    """One heatmap per model side by side: depth (rows) x context length (columns), 0..1 accuracy.

    ``grids`` maps a model name to a :class:`hf_hybrid.eval.needle.NeedleGrid`.
    """
    plt = _pyplot()
    if not grids:
        raise ValueError("plot_needle_heatmaps needs at least one grid.")
    columns = max(len(g.lengths) for g in grids.values())
    width = len(grids) * (1.6 + 0.7 * columns) + 1.0
    fig, axes = plt.subplots(1, len(grids), figsize=(width, 3.6), squeeze=False)
    image = None
    for index, (ax, (name, grid)) in enumerate(zip(axes[0], grids.items())):
        image = ax.imshow(grid.accuracy, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(grid.lengths)), [str(l) for l in grid.lengths], fontsize=8)
        ax.set_yticks(range(len(grid.depths)), [f"{d:.0%}" for d in grid.depths], fontsize=8)
        ax.set_xlabel("context length")
        if index == 0:
            ax.set_ylabel("needle depth")
        ax.set_title(f"{name} (mean {grid.mean:.0%})", fontsize=10)
        for i, row in enumerate(grid.accuracy):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=list(axes[0]), fraction=0.03, label="accuracy")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path, tight=False)


def _save(fig, plt, path, tight: bool = True) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
