"""benchmarks/swa_first_use.py: every way it times computes the sliding-window op's band."""
from __future__ import annotations

import pytest
import torch

from benchmarks import swa_first_use
from hf_hybrid.kernels._backend import triton_interpreting


@pytest.mark.parametrize("way", [w for w in swa_first_use.WAYS if w != "sdpa"])
def test_every_way_computes_the_same_band_as_sdpa(way):
    if way == "window" and not (torch.cuda.is_available() or triton_interpreting()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    if way == "flash" and not torch.cuda.is_available():
        pytest.skip("FlashAttention-2 needs CUDA")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g) for _ in range(3))
    if way == "flash":  # half precision on the GPU
        q, k, v = (x.cuda().half() for x in (q, k, v))
    window = 9  # keys before each query: 10 visible, itself included
    expected = swa_first_use.band_attention("sdpa", *(x.float() for x in (q, k, v)), window, 0.25)
    got = swa_first_use.band_attention(way, q, k, v, window, 0.25)
    tol = 2e-3 if way == "flash" else 1e-4
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_an_unknown_way_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="flex, sdpa, window, flash"):
        swa_first_use.band_attention("cudnn", *(torch.zeros(1, 4, 1, 16) for _ in range(3)), 2, 1.0)


def test_it_needs_a_gpu_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert swa_first_use.main(["--seq", "64"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err
