"""benchmarks/mixer_kernels.py: its step runs the mixer op forward and backward at the SE hybrid's
widths, and on a CPU-only machine it says that it needs a GPU."""
from __future__ import annotations

import pytest
import torch

from benchmarks import mixer_kernels


def test_the_step_returns_every_gradient_at_the_se_hybrids_widths():
    grads = mixer_kernels.mixer_step(8, torch.device("cpu"))()  # the reference op on CPU
    inner = mixer_kernels.HEADS * mixer_kernels.HEAD_DIM
    channels = inner + 2 * mixer_kernels.STATE
    assert grads[0].shape == (1, 8, inner + channels + mixer_kernels.HEADS)
    assert grads[1].shape == (channels, mixer_kernels.CONV)
    assert all(torch.isfinite(g.float()).all() for g in grads)


def test_it_needs_a_gpu_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit):
        mixer_kernels.main(["--seq", "64"])
    assert "run it on a GPU machine" in capsys.readouterr().err
