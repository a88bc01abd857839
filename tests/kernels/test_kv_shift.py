"""kv_shift (kernels/kv_shift): the Triton passes against the float32 reference, forward and
backward, fp32 and bf16, lengths that are not a multiple of the kernel's token block, a head_dim
that is not a power of two, with and without the previous token, strided inputs."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.kv_shift import kv_shift, kv_shift_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and not triton_interpreting(),
                                  reason="needs CUDA or TRITON_INTERPRET=1")


def _inputs(batch, seq, heads, dim, dtype, previous: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, dim, generator=g)
    logits = 2 * torch.randn(batch, seq, heads, generator=g)
    prev = torch.randn(batch, heads, dim, generator=g) if previous else None
    dout = torch.randn(batch, seq, heads, dim, generator=g)
    cast = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return cast(x), cast(logits), cast(prev), cast(dout)


def test_reference_states_the_math():
    """out_t = a_t x_{t-1} + (1 - a_t) x_t token by token, x_{-1} = previous or zeros."""
    x, logits, prev, _ = _inputs(2, 5, 3, 4, torch.float64, previous=True)
    for previous in (prev, None):
        out = kv_shift_reference(x, logits, previous)
        for t in range(5):
            before = x[:, t - 1] if t else (previous if previous is not None else torch.zeros_like(x[:, 0]))
            a = torch.sigmoid(logits[:, t])[..., None]
            torch.testing.assert_close(out[:, t], a * before + (1 - a) * x[:, t])


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seq,dim,previous", [(37, 16, True), (37, 16, False), (5, 24, True), (1, 16, True)])
def test_triton_matches_reference_forward_and_backward(dtype, tol, seq, dim, previous):
    x, logits, prev, dout = _inputs(2, seq, 3, dim, dtype, previous)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, logits, prev)]
    exact = [t.detach().double().requires_grad_() if t is not None else None for t in (x, logits, prev)]
    out = kv_shift(*leaves, backend="triton")
    want = kv_shift_reference(*exact)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    out.backward(dout)
    want.backward(dout.double())
    for got, ref in zip(leaves, exact):
        if got is not None:
            assert got.grad.dtype == dtype
            torch.testing.assert_close(got.grad.double(), ref.grad, rtol=tol, atol=tol)


@needs_triton
def test_strided_inputs_match_contiguous_copies():
    """x a view of a wider projection output, logits a column slice: the same as contiguous copies."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 9, 3 * 16 + 5, generator=g).to(DEVICE)
    x = wide[..., :48].view(2, 9, 3, 16)
    logits = torch.randn(2, 9, 7, generator=g).to(DEVICE)[..., 2:5]
    out = kv_shift(x, logits, backend="triton")
    torch.testing.assert_close(out, kv_shift_reference(x.contiguous(), logits.contiguous()), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    x = torch.zeros(2, 4, 3, 8)
    with pytest.raises(ValueError, match="logits must be"):
        kv_shift(x, torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="previous must be"):
        kv_shift(x, torch.zeros(2, 4, 3), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="x must be"):
        kv_shift(torch.zeros(4, 3, 8), torch.zeros(4, 3))


def test_kernels_compile_for_sm90_without_spills():
    from sm90_check import sm90_report

    rows = sm90_report("kv_shift_report()")
    assert len(rows) == 2 and all("error" not in r and r["stack_bytes"] == 0 for r in rows), rows
