"""A CPU training step at T = 16,384 stays under 3 GB of peak RSS for every model, and the blocked
CPU paths that make it so compute the dense references' results and gradients.

The memory checks run one forward + backward (hidden 256, 4 layers, vocab 256, float32, batch 1)
in a fresh interpreter each (hf_hybrid/bench/cpu_step_memory.py) and read its peak RSS, imports
included. The SE-Attn hybrid in ``se`` mode runs in every test run; the other models (one to two
minutes each on two cores) run with HF_HYBRID_SLOW=1.
"""
from __future__ import annotations

import pytest
import torch

from hf_hybrid.bench.cpu_step_memory import MODELS, measure_in_subprocess
from hf_hybrid.kernels import _query_blocks
from hf_hybrid.kernels.chunk_attention import (
    block_end_mask,
    chunk_end_attention_query_blocks,
    chunk_end_attention_reference,
    chunk_ends,
)
from hf_hybrid.kernels.forgetting_attention import forgetting_attention_query_blocks, forgetting_attention_reference
from hf_hybrid.kernels.residual_linear_attention.sliding_window import band_mask, sliding_window_attention_sdpa
from hf_hybrid.kernels.span_expanded_attention import (
    span_expanded_attention_query_blocks,
    span_expanded_attention_reference,
)
from hf_hybrid.layers.attention import softmax_attention
from hf_hybrid.layers.context import SequenceContext

SEQ = 16384
LIMIT = 3 * 2**30
SLOW = [name for name in MODELS if name != "se"]


def _check_peak(name: str) -> None:
    result = measure_in_subprocess(name, SEQ, timeout=900)
    assert result["finite"], f"{name}: the loss or a gradient is not finite"
    assert result["peak_rss_bytes"] < LIMIT, (
        f"{name}: one CPU training step at T={SEQ} peaked at {result['peak_rss_bytes'] / 2**30:.2f} GiB of RSS (limit 3 GiB)"
    )


def test_se_hybrid_cpu_training_step_stays_under_3gb():
    _check_peak("se")


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_cpu_training_step_stays_under_3gb(name):
    _check_peak(name)


# ---------------------------------------------------------------- blocked paths against the oracles

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
T_ODD = 203  # not a multiple of any block, chunk or window below


def _inputs(dtype, batch=2, heads=4, kv_heads=2, seq=T_ODD, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dim, generator=generator).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=generator).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v


def _assert_same(dense, blocked, inputs, dtype):
    """Same outputs and same gradients (for one random output gradient) as the dense oracle."""
    grad = torch.randn(dense.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = torch.autograd.grad(dense, inputs, grad)
    got = torch.autograd.grad(blocked, inputs, grad)
    torch.testing.assert_close(blocked, dense, **TOLERANCE[dtype])
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["se", "se_random", "se_nomem", "full", "swa"])
def test_span_expanded_query_blocks_match_the_dense_reference(mode, dtype):
    q, k, v = _inputs(dtype)
    kwargs = dict(mode=mode, chunk_size=64, block_size=8, top_k=3, select_every=16, window=37, seed=1, scale=None)
    dense = span_expanded_attention_reference(q, k, v, **kwargs)
    blocked = span_expanded_attention_query_blocks(q, k, v, **kwargs, query_block=29)
    _assert_same(dense, blocked, (q, k, v), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, packed", [(None, False), (23, False), (None, True), (17, True)])
def test_forgetting_attention_query_blocks_match_the_dense_reference(window, packed, dtype):
    batch = 1 if packed else 2
    q, k, v = _inputs(dtype, batch=batch)
    log_f = torch.nn.functional.logsigmoid(torch.randn(batch, T_ODD, 4) + 2).to(dtype).requires_grad_()
    cu_seqlens = torch.tensor([0, 50, 51, T_ODD]) if packed else None
    dense = forgetting_attention_reference(q, k, v, log_f, None, window, cu_seqlens)
    blocked = forgetting_attention_query_blocks(q, k, v, log_f, None, window, cu_seqlens, query_block=29)
    _assert_same(dense, blocked, (q, k, v, log_f), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_end_attention_query_blocks_match_the_dense_reference(dtype):
    q, k, v = _inputs(dtype, kv_heads=4)
    chunk = 8
    # Row 1 is left-padded by 5 tokens: its chunks start 5 columns later.
    query_chunk = torch.stack([torch.arange(T_ODD) // chunk, (torch.arange(T_ODD) - 5).clamp(min=0) // chunk])
    k_ends, v_ends = chunk_ends(k, chunk), chunk_ends(v, chunk)
    dense = chunk_end_attention_reference(q, k, v, k_ends, v_ends, query_chunk)
    blocked = chunk_end_attention_query_blocks(q, k, v, k_ends, v_ends, query_chunk, query_block=29)
    _assert_same(dense, blocked, (q, k, v), dtype)


@pytest.fixture
def small_score_budget(monkeypatch):
    """Blocks of ~23 queries at T_ODD (the default budget holds these shapes in one block)."""
    monkeypatch.setattr(_query_blocks, "SCORE_BUDGET", 2 * 4 * T_ODD * 23)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_sdpa_blocks_match_the_dense_mask(dtype, small_score_budget):
    q, k, v = _inputs(dtype)
    window = 19
    with pytest.MonkeyPatch.context() as patch:  # the dense band mask: the path other devices take
        patch.setattr(_query_blocks, "SCORE_BUDGET", 1 << 30)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dense = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=band_mask(T_ODD, window, q.device), enable_gqa=True).transpose(1, 2)
    blocked = sliding_window_attention_sdpa(q, k, v, window)
    _assert_same(dense, blocked, (q, k, v), dtype)


class _Layer(torch.nn.Module):
    """What transformers' SDPA function reads from a layer."""

    def __init__(self):
        super().__init__()
        self.is_causal, self.num_key_value_groups, self.config = True, 2, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, padded", [(17, False), (None, True), (17, True)])
def test_softmax_attention_blocks_match_the_dense_mask(window, padded, dtype, small_score_budget):
    attention_mask = torch.ones(2, T_ODD, dtype=torch.long)
    if padded:
        attention_mask[1, :11] = 0
    q, k, v = (x.transpose(1, 2) for x in _inputs(dtype))
    context = SequenceContext.build(2, T_ODD, 0, attention_mask, None, torch.device("cpu"))
    blocked = softmax_attention(_Layer(), q, k, v, context, key_start=0, window=window)
    mask = context.dense_mask(T_ODD, 0, window)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    _assert_same(dense, blocked, (q, k, v), dtype)


def test_context_mask_rows_are_the_dense_mask_rows():
    attention_mask = torch.ones(2, 40, dtype=torch.long)
    attention_mask[0, :3] = 0
    context = SequenceContext.build(2, 40, 0, attention_mask, None, torch.device("cpu"))
    dense = context.dense_mask(40, 0, 9)
    assert torch.equal(context.mask_rows(40, 0, 9, 7, 19, 2, 30), dense[:, :, 7:19, 2:30])


def test_rat_plus_dilated_rows_are_the_block_end_mask():
    """The RAT+ CPU path builds block_end_mask's rows for a query block at its absolute start."""
    full = block_end_mask(50, 50, 8, local_window=3, num_sink_tokens=2)
    rows = block_end_mask(12, 41, 8, local_window=3, num_sink_tokens=2, query_start=29)
    assert torch.equal(rows, full[29:41, :41])
