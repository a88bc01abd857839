"""Residual add + RMSNorm in one kernel (kernels/residual_norm) against its reference, which is
the block's own add and hf_hybrid.layers.norm.RMSNorm."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.residual_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(2, 5, 64), (7, 96), (1, 3, 4, 100)])  # odd rows; rows that do not fill their tile
def test_trainable_norm_matches_reference_forward_and_backward(dtype, tol, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE).requires_grad_()
    dy = torch.randn(shape, generator=g).to(DEVICE, dtype)
    y = rms_norm(x, weight, 1e-6, backend="triton")
    dx, dw = torch.autograd.grad(y, (x, weight), dy)
    y_ref = rms_norm_reference(x, weight, 1e-6)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, weight), dy)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(dx, dx_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(dw, dw_ref, rtol=tol, atol=tol * shape[0] * 4)  # summed over the rows
    assert dx.dtype == x.dtype and dw.dtype == weight.dtype


def test_trainable_norm_takes_a_strided_gradient_and_padding_rows():
    x = torch.randn(3, 6, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(32, device=DEVICE, requires_grad=True)
    dy = torch.randn(3, 32, 6, device=DEVICE).transpose(1, 2)  # not contiguous
    x.data[1, :2] = 0.0  # all-zero rows (padding): finite gradients
    grads = torch.autograd.grad(rms_norm(x, weight, 1e-6, backend="triton"), (x, weight), dy)
    want = torch.autograd.grad(rms_norm_reference(x, weight, 1e-6), (x, weight), dy)
    for got, ref in zip(grads, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_trainable_norm_names_bad_inputs():
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(16, device=DEVICE), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, torch.ones(32, device=DEVICE), 1e-6, backend="cuda")
    with pytest.raises(ValueError, match="rows of at most"):
        rms_norm(torch.randn(1, 16385, device=DEVICE), torch.ones(16385, device=DEVICE), 1e-6, backend="triton")


def test_model_norm_runs_the_kernel_and_matches_the_plain_module(monkeypatch):
    from hf_hybrid.layers import backbone_fusion

    norm = RMSNorm(48, eps=1e-5).to(DEVICE)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 7, 48, device=DEVICE, requires_grad=True)
    plain = norm(x)
    monkeypatch.setattr(backbone_fusion, "_allow_cpu", True)
    monkeypatch.setattr(backbone_fusion, "_min_tokens", 0)
    calls = []
    monkeypatch.setattr(backbone_fusion, "rms_norm", lambda *a, **k: calls.append(1) or rms_norm(*a, **k))
    fused = norm(x)
    assert calls and fused.grad_fn is not plain.grad_fn
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(plain)
    for got, want in zip(torch.autograd.grad(fused, (x, norm.weight), dy), torch.autograd.grad(plain, (x, norm.weight), dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
