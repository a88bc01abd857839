"""Shared by the CPU multi-process tests: the model types they cover and how the ranks start."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "features"))
from tiny_models import MODEL_TYPES  # noqa: E402

# One variant of each architecture by default; every variant with HF_HYBRID_SLOW=1 (the slow checks).
ONE_PER_ARCHITECTURE = ("rat", "rat_plus", "fox_pro", "rattention", "se_hybrid")
TINY_TYPES = MODEL_TYPES if os.environ.get("HF_HYBRID_SLOW") == "1" else ONE_PER_ARCHITECTURE
TIMEOUT_S = 300  # a hung collective fails the test instead of blocking the run


def torchrun(script: str, nproc: int, *args: str) -> None:
    """Run ``script`` on ``nproc`` CPU ranks (gloo) with torchrun; fail with the ranks' output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{os.path.basename(script)} on {nproc} ranks did not finish in {TIMEOUT_S} s:\n{error.stderr}")
    if done.returncode != 0:
        pytest.fail(f"{os.path.basename(script)} on {nproc} ranks failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
