"""The Triton scan for c = cumsum(log f) (cumulative.py) against the reference's torch scan: values
and gradient, float32 and bfloat16 gates, batch rows and packed sequences (a one-token one included),
sequences longer than one scan block, a gate tensor that is a strided view; and the public op takes it.

CPU runs the kernel in the interpreter (blocks of 16 tokens, so 50 tokens span four); the `gpu`
test uses the GPU's 2048-token blocks on long rows.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.forgetting_attention import cumulative_log_forget_by_head, forgetting_attention
from hf_hybrid.kernels.forgetting_attention import cumulative as cumulative_module
from hf_hybrid.kernels.forgetting_attention.cumulative import cumulative_log_forget_by_head_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _gate(shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return F.logsigmoid(torch.randn(shape, generator=g) * 2 + 1).to(DEVICE, dtype)


def _check(log_f, cu_seqlens, atol_grad, rtol=1e-5):
    leaf = log_f.detach().requires_grad_()
    ref_leaf = log_f.detach().requires_grad_()
    c = cumulative_log_forget_by_head_triton(leaf, cu_seqlens)
    ref = cumulative_log_forget_by_head(ref_leaf, cu_seqlens)
    assert c.dtype == torch.float32 and c.shape == ref.shape
    torch.testing.assert_close(c, ref, rtol=rtol, atol=1e-5)
    dc = torch.randn_like(ref)
    (grad,) = torch.autograd.grad(c, leaf, dc)
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf, dc)
    assert grad.dtype == log_f.dtype and grad.shape == log_f.shape
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=0, atol=atol_grad)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, lengths", [((3, 37, 5), None), ((2, 50, 4), None), ((1, 50, 3), [1, 19, 13, 17])])
def test_scan_matches_reference(dtype, shape, lengths):
    log_f = _gate(shape, dtype, seed=shape[1])
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    # float32: sums of ~50 terms in another order; bfloat16: the gradient rounds to bf16 (one unit
    # in the last place of values up to ~50; the CPU interpreter truncates where CUDA rounds).
    _check(log_f, cu, atol_grad=1e-4 if dtype == torch.float32 else 0.25)


@needs_triton
def test_scan_reads_a_strided_gate():
    """log f as a transposed view (heads-major storage) gives the same c as its contiguous copy."""
    stored = _gate((4, 2, 33), torch.float32, seed=3)  # [heads, batch, seq]
    log_f = stored.permute(1, 2, 0)  # [batch, seq, heads], not contiguous
    assert not log_f.is_contiguous()
    _check(log_f, None, atol_grad=1e-4)


@needs_triton
def test_public_op_takes_the_scan(monkeypatch):
    calls = []
    real = cumulative_module._CumulativeLogForget.apply
    monkeypatch.setattr(cumulative_module._CumulativeLogForget, "apply", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g).to(DEVICE) for _ in range(3))
    log_f = _gate((1, 20, 2), torch.float32, seed=1).requires_grad_()
    out = forgetting_attention(q, k, v, log_f, backend="triton")
    out.sum().backward()
    assert calls and torch.isfinite(log_f.grad).all()


@pytest.mark.gpu
def test_scan_long_rows_on_gpu():
    # Sums of up to 10,000 terms (|c| ~ 3,000) in two float32 orders: ~1e-5 relative apart.
    _check(_gate((2, 9000, 16), torch.float32, seed=5), None, atol_grad=2e-3, rtol=1e-4)
    lengths = [1, 4097, 2048, 10000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    _check(_gate((1, sum(lengths), 8), torch.bfloat16, seed=6), cu, atol_grad=4.0, rtol=1e-4)
