"""Test-session setup shared by every test.

Without CUDA the Triton kernels run in Triton's CPU interpreter; TRITON_INTERPRET must be set
before any kernel module is imported (``triton.jit`` reads it at decoration time).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The test models are tiny: with one intra-op thread they run many times faster on a busy 2-core
# CI runner than with threads contending for its cores (a pretrain example: 2 s instead of 60 s).
# Results do not depend on it. HF_HYBRID_TEST_THREADS overrides.
# Child processes (fresh-process reload checks) inherit it through OMP_NUM_THREADS: the same thread
# count keeps their CPU reductions in the same order, so "bit-identical" logits stay comparable.
if not torch.cuda.is_available():
    _threads = os.environ.get("HF_HYBRID_TEST_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = _threads
    torch.set_num_threads(int(_threads))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    skip_slow = pytest.mark.skip(reason="slow check: set HF_HYBRID_SLOW=1 to run")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("HF_HYBRID_SLOW") != "1":
            item.add_marker(skip_slow)
