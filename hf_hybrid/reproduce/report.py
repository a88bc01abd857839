"""What every reproduction returns and how it is written: a Markdown table, a PNG and raw JSON."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Reproduction:
    """One reproduction's result.

    ``table``: Markdown (a table plus the outcome in words, including where the small scale does not
    show the paper's effect); ``raw``: JSON-able numbers (per seed where there are seeds);
    ``plot(ax_or_fig)``: draws the figure on a matplotlib Figure; ``outcome``: {claim: bool} for the
    checks the reproduction states (the test of a CPU preset asserts they ran, not that they hold).
    """

    name: str
    paper: str
    table: str
    raw: dict
    plot: Callable
    outcome: dict[str, bool] = field(default_factory=dict)


def write_reproduction(result: Reproduction, out: Path, settings: dict, command: str, device: str) -> dict[str, Path]:
    """<name>.md / .png / .json in ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{result.name}.{kind}" for kind in ("md", "png", "json")}
    outcome = "\n".join(f"- {claim}: {'yes' if held else 'no'}" for claim, held in result.outcome.items())
    paths["md"].write_text(
        f"# Reproduction `{result.name}`: {result.paper}\n\n```bash\n{command}\n```\n\nDevice: {device}. "
        f"Settings: `{json.dumps(settings, sort_keys=True)}`\n\n{result.table}\n\n## Checks\n\n{outcome}\n",
        encoding="utf-8",
    )
    figure = plt.figure(figsize=(7, 4.5))
    result.plot(figure)
    figure.tight_layout()
    figure.savefig(paths["png"], dpi=120)
    plt.close(figure)
    paths["json"].write_text(json.dumps(
        {"name": result.name, "paper": result.paper, "settings": settings, "device": device, "command": command,
         "outcome": result.outcome, "raw": result.raw}, indent=2, sort_keys=True), encoding="utf-8")
    return paths
