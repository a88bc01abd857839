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
# Child processes (the reload checks' helper processes) inherit it through OMP_NUM_THREADS: the same
# thread count keeps their CPU reductions in the same order, so "bit-identical" logits stay comparable.
if not torch.cuda.is_available():
    _threads = os.environ.get("HF_HYBRID_TEST_THREADS", "1")
    os.environ["OMP_NUM_THREADS"] = _threads
    torch.set_num_threads(int(_threads))
    # torch.compile's tiny test graphs compile in the test's own process: no pool of compile
    # subprocesses per pytest worker on a 2-core runner (read when inductor's config is first imported).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# What a test calls or requests when it shares an expensive setup with others in its pytest worker:
# a helper process (tests/helper_process.py: 10-20 s of imports at its start) or the demo's smoke run.
_SHARED_SETUP = {"sm90_report", "sm90_compile", "_json_from_compile_helper", "assert_save_load_roundtrip",
                 "remote_code_helper", "smoke_run"}


def _shares_setup(item) -> bool:
    function = getattr(item, "function", None)
    used = set(function.__code__.co_names) if function is not None else set()
    return bool((used | set(getattr(item, "fixturenames", ()))) & _SHARED_SETUP)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    skip_slow = pytest.mark.skip(reason="slow check: set HF_HYBRID_SLOW=1 to run")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("HF_HYBRID_SLOW") != "1":
            item.add_marker(skip_slow)
    # Tests sharing a setup run first, back to back (otherwise in collection order): under `-n 2`
    # xdist hands each worker a block of consecutive tests first, so one worker takes them all and
    # pays each helper's start and the demo run once, instead of both workers paying them.
    items.sort(key=lambda item: not _shares_setup(item))


@pytest.fixture(scope="session", autouse=True)
def _close_helper_processes():
    """Helper processes (tests/helper_process.py) live for the session; stop them at its end."""
    yield
    from helper_process import close_helpers

    close_helpers()
