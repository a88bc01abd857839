"""A CPU training step at T = 16,384 stays under 3 GB of peak RSS for every model, and the blocked
CPU paths that make it so compute the dense references' results and gradients.

The memory checks run one forward + backward (hidden 256, 4 layers, vocab 256, float32, batch 1)
in a fresh interpreter each (benchmarks/cpu_step_memory.py) and read its peak RSS, imports
included. The SE-Attn hybrid in ``se`` mode runs in every test run; the other models (one to two
minutes each on two cores) run with HF_HYBRID_SLOW=1.
"""
from __future__ import annotations

import pytest
import torch

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

from benchmark_modules import load

_cpu_step_memory = load("cpu_step_memory")
MODELS, measure_in_subprocess = _cpu_step_memory.MODELS, _cpu_step_memory.measure_in_subprocess

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


# ---------------------------------------------------------------- whole models: blocked == one block

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _tiny_config(name: str):
    import hf_hybrid as H

    return {
        "rat": lambda: H.RatConfig(**TINY, chunk_size=8),
        "rat_swa": lambda: H.RatConfig(**TINY, chunk_size=8, sliding_window=9,
                                       layer_types=H.RatConfig.hybrid_layer_types(2, "rat")),
        "rat_plus": lambda: H.RatPlusConfig(**TINY, training_dilations=[1, 8]),
        "fox_llama": lambda: H.FoxConfig(**TINY, block_type="llama"),
        "fox_pro": lambda: H.FoxConfig(**TINY, block_type="pro"),
        "rattention": lambda: H.RattentionConfig(**TINY, window_size=8, layer_types=["local", "global"]),
        "se": lambda: H.SEHybridConfig(**TINY, attention_mode="se", layer_types=["mamba", "attention"],
                                       se_chunk_sizes=[32], se_block_size=4, se_top_k=2, se_select_every=8,
                                       mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
    }[name]()


def _loss_and_grads(name: str, padded: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(name)).train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 97), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(ids)
    if padded:
        attention_mask[1, :7] = 0
    loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["rat", "rat_swa", "rat_plus", "fox_llama", "fox_pro", "rattention", "se"])
def test_models_train_the_same_over_query_blocks(name, padded, monkeypatch):
    """A training step of a tiny model on CPU gives the same loss and gradients whether its
    attention-like ops run over blocks of ~16 queries or in one block (the dense path)."""
    if padded and name == "rat_plus":
        pytest.skip("a padded RAT+ batch attends with its dense pattern mask, not over query blocks")
    dense_loss, dense_grads = _loss_and_grads(name, padded)
    keys = 97 // 8 + 1 if name == "rat" else 97  # RAT's queries score the chunk ends and their own key
    monkeypatch.setattr(_query_blocks, "SCORE_BUDGET", 2 * 2 * keys * 16)
    calls = []
    blocks = _query_blocks._QueryBlocks.apply
    monkeypatch.setattr(_query_blocks._QueryBlocks, "apply", lambda *args: calls.append(args) or blocks(*args))
    blocked_loss, blocked_grads = _loss_and_grads(name, padded)
    assert calls, "the step never ran over query blocks"
    torch.testing.assert_close(blocked_loss, dense_loss, atol=1e-6, rtol=1e-6)
    assert blocked_grads.keys() == dense_grads.keys()
    for key in dense_grads:
        torch.testing.assert_close(blocked_grads[key], dense_grads[key], atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 23])
def test_forgetting_attention_padded_rows_over_query_blocks_match_the_reference(window, dtype):
    from hf_hybrid.kernels.forgetting_attention import _with_cache_query_blocks, forgetting_attention_with_cache_reference

    q, k, v = _inputs(dtype)
    log_f = torch.nn.functional.logsigmoid(torch.randn(2, T_ODD, 4) + 2).to(dtype)
    key_mask = torch.ones(2, T_ODD, dtype=torch.bool)
    key_mask[1, :9] = False
    log_f = log_f.masked_fill(~key_mask[..., None], 0.0).requires_grad_()
    c = torch.cumsum(log_f.float(), dim=1)
    dense = forgetting_attention_with_cache_reference(q, k, v, c, c, key_mask, None, window)
    blocked = _with_cache_query_blocks(q, k, v, c, c, key_mask, None, window, query_block=29)
    _assert_same(dense, blocked, (q, k, v, log_f), dtype)
