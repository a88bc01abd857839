"""The architectures of hf-hybrid. Each entry of ARCHITECTURES is a subpackage exposing register()."""
from __future__ import annotations

import importlib

ARCHITECTURES = [
    "rat",
    "rat_plus",
    "fox",
    "se_hybrid",
    "rattention",
]


def register_all() -> None:
    for name in ARCHITECTURES:
        importlib.import_module(f"{__name__}.{name}").register()
