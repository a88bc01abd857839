"""The RAT/RAT+ reference ops agree with each other and with their definitions."""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.kernels.chunk_attention import (
    block_end_attention,
    block_end_attention_reference,
    block_end_mask,
    chunk_end_attention,
    chunk_ends,
)
from hf_hybrid.kernels.gated_recurrence import gated_recurrence, gated_recurrence_reference, gated_recurrence_scan


@pytest.mark.parametrize("chunk_size,start,with_state", [(0, 0, False), (0, 5, True), (4, 0, False), (4, 3, True), (1, 0, False), (50, 2, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_equals_loop_forward_and_backward(chunk_size, start, with_state, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 29, 3, 4, dtype=dtype, requires_grad=True)
    g = torch.rand(2, 29, 3, 4, requires_grad=True)
    state = torch.randn(2, 3, 4, requires_grad=True) if with_state else None
    outputs, grads = [], []
    for fn in (gated_recurrence_reference, gated_recurrence_scan):
        out = fn(x, g, chunk_size, start, state)
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out.float() * weights).sum().backward()
        outputs.append(out.float())
        grads.append([t.grad.clone() for t in (x, g, state) if t is not None])
        for t in (x, g, state):
            if t is not None:
                t.grad = None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outputs[0] - outputs[1]).abs().max() < tol
    for a, b in zip(*grads):
        assert (a.float() - b.float()).abs().max() < tol * 10


def test_recurrence_restarts_exactly_at_chunk_boundaries():
    x = torch.ones(1, 8, 1)
    g = torch.full((1, 8, 1), 0.5)
    h = gated_recurrence(x, g, chunk_size=4, backend="reference")[0, :, 0]
    # 0.5, 0.75, 0.875, 0.9375, then the same again after the restart at position 4
    assert torch.allclose(h, torch.tensor([0.5, 0.75, 0.875, 0.9375] * 2))


@pytest.mark.parametrize("block_size,window,sinks", [(1, 0, 0), (4, 0, 0), (4, 3, 0), (5, 0, 2), (8, 2, 4)])
def test_block_end_mask_matches_definition(block_size, window, sinks):
    mask = block_end_mask(13, 13, block_size, window, sinks)
    for i in range(13):
        for j in range(13):
            expected = j <= i and ((j + 1) % block_size == 0 or i - j <= window or j < sinks)
            assert bool(mask[i, j]) == expected


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16])
def test_compact_chunk_end_attention_equals_dense_masked_attention(chunk_size):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 21, 2, 8).unbind(0)
    dense = block_end_attention_reference(q, k, v, chunk_size)
    compact = chunk_end_attention(q, k, v, chunk_ends(k, chunk_size), chunk_ends(v, chunk_size), chunk_size)
    assert (dense - compact).abs().max() < 1e-5


def test_chunk_ends_respect_start_position():
    x = torch.arange(10).view(1, 10, 1, 1)
    # positions 6..15 with L = 4: chunk ends at positions 7, 11, 15 -> offsets 1, 5, 9
    assert chunk_ends(x, 4, start_position=6).flatten().tolist() == [1, 5, 9]


def test_bad_arguments_name_the_parameter():
    x = torch.randn(1, 4, 2, 2)
    with pytest.raises(ValueError, match="same shape"):
        gated_recurrence(x, torch.rand(1, 3, 2, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        gated_recurrence(x, torch.rand_like(x), chunk_size=-1)
    with pytest.raises(ValueError, match="backend"):
        gated_recurrence(x, torch.rand_like(x), backend="cuda")
    with pytest.raises(ValueError, match="block_size"):
        block_end_attention(x, x, x, block_size=0)


def test_triton_backend_without_gpu_or_interpreter_explains_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(1, 4, 2, 2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gated_recurrence(x, torch.rand_like(x), backend="triton")
