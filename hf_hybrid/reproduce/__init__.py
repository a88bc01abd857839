"""Small-scale reproductions of each paper's headline claim: ``hf-hybrid reproduce NAME``.

One module per reproduction (``hf_hybrid/reproduce/<name>.py``). Each defines

* ``PAPER``: the figure or table it mirrors (one line),
* ``PRESETS``: {"cpu": {...}, "gpu": {...}} keyword settings (``cpu``: toy size for CI; ``gpu``:
  under 9 minutes on one H200),
* ``run(settings: dict, out: Path, seeds: tuple[int, ...]) -> Reproduction``: trains the project's own
  models on generated data and returns the table, the raw numbers and a plotting function.

:func:`hf_hybrid.reproduce.report.write_reproduction` writes ``<name>.md``, ``<name>.png`` and
``<name>.json`` into the output folder; the CLI (``__main__.py``) ties them together.
"""
from __future__ import annotations

from ..architectures import ARCHITECTURES

# One per architecture (its entry's ``reproduction``), in the table's order.
REPRODUCTIONS = tuple(arch.reproduction for arch in ARCHITECTURES)
