"""ssd_scan.step_sizes (the Triton discretisation of the step sizes and the chunks' log decay):
forward and backward against discretize_dt with autograd and a torch cumsum, read from a strided
slice as the mixer passes it (odd lengths, padded last chunk, clamped steps, large inputs on
softplus' linear side, no bias)."""
from __future__ import annotations

import importlib

import pytest
import torch

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.ssd_scan.reference import discretize_dt

step_sizes = importlib.import_module("hf_hybrid.kernels.ssd_scan.step_sizes")

pytestmark = pytest.mark.skipif(not (triton_interpreting() or torch.cuda.is_available()),
                                reason="Triton kernels: a GPU or TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() and not triton_interpreting() else "cpu"
NO_LIMIT = (0.0, float("inf"))


def reference_log_decay(dt: torch.Tensor, A: torch.Tensor, chunk: int) -> torch.Tensor:
    """g: cumulative dt * A within each chunk of ``chunk`` tokens, the last chunk padded with dt = 0."""
    batch, seq, heads = dt.shape
    padded = torch.nn.functional.pad(dt * A.float(), (0, 0, 0, -seq % chunk))
    return padded.view(batch, -1, chunk, heads).cumsum(2).view(batch, -1, heads)


def raw_slice(batch, seq, heads, dtype, seed=0):
    """dt_raw as the mixer reads it: the last ``heads`` columns of a wider in_proj output, with
    entries past softplus' threshold of 20 too."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, seq, heads + 24, generator=gen) * 2
    wide[0, :3, -1] = 25.0
    return wide.to(dtype).to(DEVICE)[..., -heads:]


@pytest.mark.parametrize("seq,heads,chunk", [(37, 5, 16), (16, 4, 16), (3, 80, 16)])
@pytest.mark.parametrize("dt_limit", [NO_LIMIT, (0.05, 0.8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_discretized_step_sizes_match_discretize_dt(seq, heads, chunk, dt_limit, dtype, bias):
    raw = raw_slice(2, seq, heads, dtype)
    gen = torch.Generator().manual_seed(1)
    dt_bias = (torch.randn(heads, generator=gen) * 0.5).to(dtype).to(DEVICE) if bias else None
    A = -torch.exp(torch.randn(heads, generator=gen)).to(DEVICE)

    dt, g = step_sizes.discretized_step_sizes(raw, dt_bias, A, dt_limit, chunk)
    exact_dt = discretize_dt(raw, dt_bias, True, dt_limit)
    torch.testing.assert_close(dt, exact_dt, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, reference_log_decay(exact_dt, A, chunk), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_sizes.chunk_log_decay(exact_dt, A, chunk), reference_log_decay(exact_dt, A, chunk),
                               rtol=1e-5, atol=1e-5)

    leaf_raw = raw.detach().float().requires_grad_()
    leaf_bias = dt_bias.detach().float().requires_grad_() if bias else None
    upstream = torch.randn(2, seq, heads, generator=gen).to(DEVICE)
    (discretize_dt(leaf_raw, leaf_bias, True, dt_limit) * upstream).sum().backward()
    out = torch.full((2, seq, heads + 3), float("nan"), dtype=dtype, device=DEVICE)[..., 1:-2]
    dbias = step_sizes.discretized_step_sizes_backward(upstream, raw, dt_bias, dt_limit, out)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), leaf_raw.grad, **tol)
    if bias:
        torch.testing.assert_close(dbias, leaf_bias.grad, rtol=1e-5, atol=1e-5)
    else:
        assert dbias is None
    if dt_limit != NO_LIMIT:  # the clamp cut some gradients and passed others
        assert (leaf_raw.grad == 0).any() and (leaf_raw.grad != 0).any()


def test_backward_names_a_bad_output_buffer():
    raw = raw_slice(1, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="ddt_raw must be"):
        step_sizes.discretized_step_sizes_backward(torch.zeros(1, 8, 4, device=DEVICE), raw, None, NO_LIMIT,
                                                   torch.empty(1, 8, 3, device=DEVICE))
