"""``hf-hybrid convert <kind> ...``: one entry point for every checkpoint conversion."""
from __future__ import annotations

import importlib
import sys

# kind -> (module, function taking the remaining argv, help)
CONVERSIONS = {
    "dense-to-rat-plus": ("hf_hybrid.conversion.dense_to_rat_plus", "main_convert", "SRC DST: Llama checkpoint -> RAT+"),
    "fox": ("hf_hybrid.conversion.fox", "main", "SRC DST [--to fla|official]: FoX checkpoints (official code, FLA) <-> hf-hybrid"),
    "rat-plus-official": ("hf_hybrid.conversion.rat_official", "main_rat_plus",
                          "SRC DST [--preset 1b|3b|7b] [--to official]: the RAT+ authors' checkpoints <-> hf-hybrid"),
    "rat-official": ("hf_hybrid.conversion.rat_official", "main_rat",
                     "SRC DST [--preset 1b] [--to official]: the RAT authors' checkpoints <-> hf-hybrid"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in CONVERSIONS:
        print("usage: hf-hybrid convert <kind> ...\n\nkinds:")
        for kind, (_, _, help_text) in CONVERSIONS.items():
            print(f"  {kind:<18} {help_text}")
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(f"unknown conversion {argv[0]!r}")
        return
    module, function, _ = CONVERSIONS[argv[0]]
    getattr(importlib.import_module(module), function)(argv[1:])
