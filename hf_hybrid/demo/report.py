"""The demo's outputs: the comparison table (text) and the PNG chart."""
from __future__ import annotations

from pathlib import Path

COLUMNS = [  # (header, row key, format)
    ("model", "model", "{}"),
    ("params", "parameters", "{:,}"),
    ("train loss", "train_loss", "{:.3f}"),
    ("lang loss", "language_eval_loss", "{:.3f}"),
    ("recall acc", "recall_accuracy", "{:.1%}"),
    ("gen recall", "generated_recall", "{:.1%}"),
    ("decode tok/s", "decode_tokens_per_s", "{:,.0f}"),
    ("KV cache @4K", "kv_cache_bytes_4k", None),
]


def human_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _measured(entries: list[tuple], results: list[dict]) -> list[tuple]:
    """The columns / panels every row has a value for (no decode speed without a GPU)."""
    return [entry for entry in entries if all(entry[1] in r for r in results)]


def format_table(results: list[dict]) -> str:
    columns = _measured(COLUMNS, results)
    rows = [[human_bytes(r[key]) if fmt is None else fmt.format(r[key]) for _, key, fmt in columns] for r in results]
    headers = [title for title, _, _ in columns]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *map(line, rows)])


# (title, row key, scale, x label, bar label format); one horizontal-bar panel each
PANELS = [
    ("recall accuracy (MQAR, teacher forced)", "recall_accuracy", 100.0, "%", "{:.0f}%"),
    ("language eval loss (lower is better)", "language_eval_loss", 1.0, "nats / token", "{:.3f}"),
    ("KV cache after a 4K-token prefill", "kv_cache_bytes_4k", 1 / 2**20, "MiB", "{:.2f}"),
    ("decode speed", "decode_tokens_per_s", 1.0, "tokens / s", "{:,.0f}"),
]


def plot_results(results: list[dict], path, title: str, oracle_loss: float | None = None) -> Path:
    """A bar panel per measured quantity, one bar per row; rows sharing trained weights share a colour."""
    from ..eval.plots import _pyplot, _save  # matplotlib only when a chart is drawn

    plt = _pyplot()
    names = [r["model"] for r in results]
    trained = list(dict.fromkeys(r["contestant"] for r in results))
    palette = plt.get_cmap("tab10")
    colours = [palette(trained.index(r["contestant"]) % 10) for r in results]
    panels = _measured(PANELS, results)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.9 + 0.38 * len(results)), sharey=True)
    for ax, (panel, key, scale, unit, fmt) in zip(axes, panels):
        values = [r[key] * scale for r in results]
        ax.barh(range(len(results)), values, color=colours)
        for y, value in enumerate(values):
            ax.text(value, y, " " + fmt.format(value), va="center", fontsize=7)
        if key == "language_eval_loss" and oracle_loss is not None:
            ax.axvline(oracle_loss, color="black", linestyle="--", linewidth=1, label=f"ideal predictor {oracle_loss:.2f}")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(unit, fontsize=8)
        ax.margins(x=0.25)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(results)), names, fontsize=8)
    axes[0].invert_yaxis()  # table order, top to bottom
    fig.suptitle(title, fontsize=10)
    return _save(fig, plt, path)
