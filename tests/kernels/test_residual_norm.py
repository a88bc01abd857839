"""Residual add + RMSNorm in one kernel (kernels/residual_norm) against its reference, which is
the block's own add and hf_hybrid.layers.norm.RMSNorm."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.residual_norm import add_rms_norm, add_rms_norm_reference
from hf_hybrid.layers.norm import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hidden", [64, 96, 2048])  # 96: a row that does not fill its power-of-two tile
@pytest.mark.parametrize("with_delta", [True, False])
def test_kernel_matches_reference(dtype, tol, hidden, with_delta):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(3, 2, hidden, generator=g).to(DEVICE, dtype)
    delta = torch.randn(3, 2, hidden, generator=g).to(DEVICE, dtype) if with_delta else None
    weight = torch.randn(hidden, generator=g).to(DEVICE)
    h, y = add_rms_norm(x, delta, weight, 1e-6, backend="triton")
    h_ref, _ = add_rms_norm_reference(x, delta, weight, 1e-6)
    if dtype == torch.float32:
        assert torch.equal(h, h_ref)
    else:  # one rounding of the float32 sum (Triton's CPU interpreter may round a bf16 cast differently by an ulp)
        torch.testing.assert_close(h, h_ref, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(y, add_rms_norm_reference(h, None, weight, 1e-6)[1], rtol=tol, atol=tol)  # y = RMSNorm(h)


def test_reference_is_the_blocks_add_and_norm():
    x, delta = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    norm = RMSNorm(32, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    h, y = add_rms_norm_reference(x, delta, norm.weight, norm.eps)
    assert torch.equal(h, x + delta) and torch.equal(y, norm(x + delta))


def test_bad_inputs_are_named():
    x = torch.randn(2, 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(16, device=DEVICE), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, x.half(), torch.ones(32, device=DEVICE), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="no backward"):
        add_rms_norm(x.requires_grad_(), None, torch.ones(32, device=DEVICE), 1e-6, backend="triton")
