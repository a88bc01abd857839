"""The repository's benchmarks/ scripts (not installed) for the few product tests that measure with
them, e.g. the saved-tensor count of benchmarks/saved_tensors.py. Loaded by path: the repository
root never goes on sys.path (it would make the top-level ``kernels/`` folder importable as
``kernels``, the name of Hugging Face's kernel-hub package, which transformers probes)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    """``benchmarks.<name>`` (benchmarks/<name>.py), importing the package by path on first use."""
    if "benchmarks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("benchmarks", BENCHMARKS / "__init__.py",
                                                      submodule_search_locations=[str(BENCHMARKS)])
        sys.modules["benchmarks"] = package = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(package)
    return importlib.import_module(f"benchmarks.{name}")
