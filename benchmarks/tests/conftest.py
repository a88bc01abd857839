"""Setup of the benchmarks' own tests (``pytest benchmarks/tests``).

``import benchmarks.<name>`` works here without the repository root on sys.path (that would also
make the top-level ``kernels/`` folder importable as ``kernels``, the name of Hugging Face's
kernel-hub package, which transformers probes). Without CUDA the Triton kernels run in Triton's
CPU interpreter, set before any kernel module is imported, as in tests/conftest.py.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)

_PACKAGE = Path(__file__).resolve().parent.parent

if "benchmarks" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("benchmarks", _PACKAGE / "__init__.py",
                                                   submodule_search_locations=[str(_PACKAGE)])
    sys.modules["benchmarks"] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)

