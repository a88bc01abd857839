"""benchmarks/window_ways.py: every way it times computes the reference's band; it needs a GPU and says so."""
from __future__ import annotations

import pytest
import torch

from benchmarks import window_ways


def test_the_error_check_is_zero_for_the_reference_itself():
    from hf_hybrid.kernels.residual_linear_attention import sliding_window_attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 40, 2, 16, generator=g, requires_grad=i < 3) for i in range(4))
    errors = window_ways._errors(lambda *x: sliding_window_attention_reference(*x, window_ways.WINDOW), q, k, v, do)
    assert len(errors) == 4 and max(errors) < 1e-6


def test_it_needs_a_gpu_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert window_ways.main([]) == 1
    assert "run it on a GPU machine" in capsys.readouterr().err
