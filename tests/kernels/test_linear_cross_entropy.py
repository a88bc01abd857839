"""linear_cross_entropy (kernels/linear_cross_entropy): the chunked Triton path against the plain
float32 cross-entropy of the full logits, forward and backward, fp32 and bf16, several chunks and
vocabulary blocks, ignored rows, both reductions, an upstream gradient other than 1, a frozen
weight, bad targets, and no host synchronisation on the GPU."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from hf_hybrid.kernels.linear_cross_entropy import triton as lce_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (the test session sets it)


def inputs(rows, hidden, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(DEVICE, dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 2 / hidden**0.5).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    targets[1] = targets[rows - 2] = -100  # prompt / padding tokens are not scored
    return h, w, targets


def run(fn, h, w, targets, upstream=1.0, **kwargs):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, targets, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_full_logits(monkeypatch, reduction, dtype, tol):
    # Three chunks of rows (the last one short) and a vocabulary of two blocks plus a remainder.
    monkeypatch.setattr(lce_triton, "CHUNK_BYTES", 8 * 70 * torch.tensor([], dtype=dtype).element_size())
    monkeypatch.setattr(lce_triton, "BLOCK_V", 32)
    h, w, targets = inputs(19, 24, 70, dtype)
    got = run(linear_cross_entropy, h, w, targets, upstream=3.0, reduction=reduction, backend="triton")
    want = run(linear_cross_entropy_reference, h.double(), w.double(), targets, upstream=3.0, reduction=reduction)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)
    assert got[1].dtype == dtype and got[2].dtype == dtype


def test_frozen_weight_and_no_grad():
    h, w, targets = inputs(9, 16, 40, torch.float32)
    h = h.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, backend="triton")
    loss.backward()
    torch.testing.assert_close(loss, linear_cross_entropy_reference(h, w, targets))
    assert w.grad is None and h.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, targets, backend="triton"), loss.detach())


def test_strided_hidden_gets_its_gradient():
    h, w, targets = inputs(9, 16, 40, torch.float32)
    wide = torch.cat([h, h], dim=1).requires_grad_()
    linear_cross_entropy(wide[:, ::2], w, targets, backend="triton").backward()
    exact = wide.detach().clone().requires_grad_()
    linear_cross_entropy_reference(exact[:, ::2], w, targets).backward()
    torch.testing.assert_close(wide.grad, exact.grad)


def test_no_counted_target_is_nan_as_in_pytorch():
    h, w, _ = inputs(5, 8, 12, torch.float32)
    targets = torch.full((5,), -100, device=DEVICE)
    assert torch.isnan(linear_cross_entropy(h, w, targets, backend="triton"))
    assert torch.isnan(linear_cross_entropy_reference(h, w, targets))
    assert linear_cross_entropy(h, w, targets, reduction="sum", backend="triton") == 0


def test_out_of_range_target_is_nan_not_a_wrong_number():
    h, w, targets = inputs(5, 8, 12, torch.float32)
    targets[0] = 12
    h = h.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, backend="triton")
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(h.grad[0]).all()


def test_bad_inputs_name_the_argument():
    h, w, targets = inputs(5, 8, 12, torch.float32)
    with pytest.raises(ValueError, match="hidden must be"):
        linear_cross_entropy(h[None], w, targets)
    with pytest.raises(ValueError, match="targets must be integer"):
        linear_cross_entropy(h, w, targets.float())
    with pytest.raises(ValueError, match="share a dtype"):
        linear_cross_entropy(h, w.double(), targets)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, targets, reduction="none")


def test_chunk_rows_fit_the_budget():
    assert lce_triton.chunk_rows(8192, 32000, 2) == 2048
    assert lce_triton.chunk_rows(100, 32000, 2) == 100
    assert lce_triton.chunk_rows(10**6, 10**9, 4) == 16


def test_kernel_compiles_for_sm90_without_spills():
    from sm90_check import sm90_report

    (row,) = sm90_report("linear_cross_entropy_report()")
    assert "error" not in row and row["stack_bytes"] == 0, row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_does_not_synchronise():
    """The model-sized step (8K rows, 32K vocabulary, bf16) raises if anything waits for the GPU."""
    h, w, targets = inputs(8192, 2048, 32000, torch.bfloat16)
    h, w = h.requires_grad_(), w.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = linear_cross_entropy(h, w, targets)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = run(linear_cross_entropy_reference, h.detach().float(), w.detach().float(), targets)
    torch.testing.assert_close(loss.float(), want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(h.grad.float(), want[1], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad.float(), want[2], atol=2e-2, rtol=2e-2)
