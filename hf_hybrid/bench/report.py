"""Results of a bench run: the ratio table (stdout / Markdown), a JSON file and a PNG plot."""
from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class Result:
    group: str
    name: str
    params: dict
    variant: str
    baseline: str
    unit: str  # "ms" (lower is better) or "tokens/s" (higher is better)
    value: float | None  # None when the variant did not run (status says why)
    status: str = "ok"  # "ok", "OOM", "skipped: ...", "error: ..."
    speedup: float | None = None  # > 1: faster than the baseline of the same case
    peak_mem_gb: float | None = None
    repeat: int | None = None
    notes: str = ""
    x_key: str = "seq"
    info: dict | None = None  # what the variant reported about itself (e.g. the batch it fit)


def fill_speedups(results: list[Result]) -> None:
    """speedup = baseline time / variant time (or variant throughput / baseline throughput)."""
    base = {}
    for r in results:
        if r.variant == r.baseline and r.value is not None:
            base[(r.group, r.name, json.dumps(r.params, sort_keys=True))] = r.value
    for r in results:
        b = base.get((r.group, r.name, json.dumps(r.params, sort_keys=True)))
        if b is None or r.value is None or r.value <= 0:
            continue
        r.speedup = b / r.value if r.unit == "ms" else r.value / b


def _fmt_params(params: dict) -> str:
    def short(v):
        if isinstance(v, int) and v >= 1024 and v % 1024 == 0:
            return f"{v // 1024}K"
        return str(v)

    return " ".join(f"{k}={short(v)}" for k, v in params.items())


def table(results: list[Result], markdown: bool = False) -> str:
    header = ["group", "case", "shape", "variant", "value", "vs baseline", "peak GB"]
    rows = []
    for r in results:
        value = f"{r.value:.3f} {r.unit}" if r.value is not None else r.status
        if r.variant == r.baseline:
            ratio = "baseline"
        else:
            ratio = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        mem = f"{r.peak_mem_gb:.1f}" if r.peak_mem_gb is not None else "-"
        rows.append([r.group, r.name, _fmt_params(r.params), r.variant, value, ratio, mem])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in rows])


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # triton missing: the reference paths still run
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = platform.processor() or "cpu"
    return info


def write_json(results: list[Result], path: Path, command: str) -> None:
    payload = {"command": command, "environment": environment(), "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(payload, indent=1))


def write_png(results: list[Result], path: Path) -> bool:
    """One panel per case name: value against the x parameter, one line per variant (log-log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        if r.value is not None:
            panels.setdefault((r.group, r.name), []).append(r)
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, ((group, name), items) in zip(axes.flat, panels.items()):
        x_key = items[0].x_key
        by_variant: dict[str, list[tuple[float, float]]] = {}
        for r in items:
            x = r.params.get(x_key)
            if isinstance(x, (int, float)):
                by_variant.setdefault(r.variant, []).append((x, r.value))
        if all(len(pts) == 1 for pts in by_variant.values()):  # one shape: bars per variant
            labels = list(by_variant)
            ax.bar(range(len(labels)), [by_variant[v][0][1] for v in labels], color=[f"C{i}" for i in range(len(labels))])
            ax.set_xticks(range(len(labels)), labels, fontsize=7)
            ax.set_title(f"{group}: {name}", fontsize=9)
            ax.set_ylabel(items[0].unit)
            ax.set_yscale("log")
            ax.grid(True, axis="y", alpha=0.3)
            continue
        for variant, pts in by_variant.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.set_title(f"{group}: {name}", fontsize=9)
        ax.set_xlabel(x_key)
        ax.set_ylabel(items[0].unit)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
