"""The `hf-hybrid` console script: `hf-hybrid <command> [options]`.

Imports the standard library and the package's standard-library-only modules (the architecture table),
nothing else: the console script's launcher (hf_hybrid_cli.py) runs this file without the package's
__init__, so the command table and `--help` answer at once (tests/test_cli.py checks both); a command's
module is imported when that command runs. Register a command with one line in COMMANDS.
"""
from __future__ import annotations

import ast
import importlib
import sys

from .architectures import ARCHITECTURES

# command -> (module, function taking argv, one-line help)
COMMANDS = {
    "demo": ("hf_hybrid.demo", "main", "train, save, reload and compare tiny models of every architecture on generated recall + language data"),
    "convert": ("hf_hybrid.conversion.cli", "main", "convert dense-to-rat-plus | fox | rat-plus-official | rat-official SRC DST: other formats -> hf-hybrid checkpoints"),
    "adapt": ("hf_hybrid.adapt", "main_adapt", "resolution adaptation of a RAT+ checkpoint (joint objective, Trainer)"),
    "bench": ("hf_hybrid.bench.__main__", "main", "op / layer / model benchmarks vs SDPA on the GPU (table, JSON, PNG)"),
    "reproduce": ("hf_hybrid.reproduce.__main__", "main", "small-scale reproductions of each paper's claim "
                  f"({', '.join(arch.reproduction for arch in ARCHITECTURES)})"),
    "eval": ("hf_hybrid.eval.cli", "main", "per-token loss / perplexity vs context length and needle heatmaps for saved models"),
}


def parse_overrides(pairs: list[str]) -> dict:
    """--set key=value pairs; values are Python literals when they parse as one (8, 1e-3, ['a','b'])."""
    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    return overrides


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: hf-hybrid <command> [options]\n\ncommands:")
        for name, (_, _, help_text) in COMMANDS.items():
            print(f"  {name:<10} {help_text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module, function, _ = COMMANDS[argv[0]]
    getattr(importlib.import_module(module), function)(argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
