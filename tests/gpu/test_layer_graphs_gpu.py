"""graph_training_layers on the GPU: training steps whose decoder layers replay captured CUDA graphs
give the eager steps' losses and gradients (float32), through gradient accumulation, an optimizer
step between captures, a second shape and a return to the first; two forwards before one backward
run eagerly and stay exact. The CPU tests of the same module: tests/test_layer_graphs.py."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_hybrid
from hf_hybrid.models.fox import FoxConfig
from hf_hybrid.models.rat import RatConfig
from hf_hybrid.models.rat_plus import RatPlusConfig
from hf_hybrid.models.rattention import RattentionConfig
from hf_hybrid.models.se_hybrid import SEHybridConfig
from hf_hybrid.training import layer_graph_report

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             head_dim=64, pad_token_id=0)
CONFIGS = {
    "rat": lambda: RatConfig(**SHAPE, chunk_size=16),
    "rat_swa": lambda: RatConfig(**SHAPE, chunk_size=16, num_key_value_heads=2, sliding_window=64,
                                 layer_types=RatConfig.hybrid_layer_types(4, "rat")),
    "fox_llama": lambda: FoxConfig(**SHAPE, num_key_value_heads=2, block_type="llama"),
    "fox_pro": lambda: FoxConfig(**SHAPE, num_key_value_heads=2),
    "rattention": lambda: RattentionConfig(**SHAPE, num_key_value_heads=2, window_size=32),
    "rat_plus": lambda: RatPlusConfig(**SHAPE, num_key_value_heads=2),  # the joint objective (D=1 and D=64)
    "rat_plus_d64": lambda: RatPlusConfig(**SHAPE, num_key_value_heads=2, training_dilations=[64]),
    "se_hybrid": lambda: SEHybridConfig(**SHAPE, num_key_value_heads=2),
    # two chunk sizes: each SE layer draws one per training forward (one capture per drawn size)
    "se_hybrid_se": lambda: SEHybridConfig(**SHAPE, num_key_value_heads=2, attention_mode="se", se_chunk_sizes=[32, 64],
                                           se_select_every=16, se_block_size=8, se_top_k=4),
    "llama": lambda: LlamaConfig(**SHAPE, num_key_value_heads=2),
}
LENGTHS = (128, 128, 101, 128)  # a second signature (odd), then the first one's graphs again


def _pair(name):
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(CONFIGS[name]()).cuda().train()
    graphed = copy.deepcopy(eager)
    hf_hybrid.graph_training_layers(graphed)
    return eager, graphed


def _accumulated_step(model, ids):
    """Two micro-batches' backward into .grad: (losses, gradients)."""
    losses = []
    for micro in ids.chunk(2):
        loss = model(input_ids=micro, labels=micro, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
    return losses, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what} {i}: a gradient on one side only"
        if x is not None:
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {i}: {m}")


@pytest.mark.parametrize("name", CONFIGS)
def test_graphed_steps_equal_eager_steps(name):
    eager, graphed = _pair(name)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, graphed)]
    generator = torch.Generator("cuda").manual_seed(1)
    for step, length in enumerate(LENGTHS):
        ids = torch.randint(1, SHAPE["vocab_size"], (2, length), device="cuda", generator=generator)
        results = []
        for model in (eager, graphed):
            torch.manual_seed(step)  # the same host draws (SE-Attn's chunk sizes) for both
            results.append(_accumulated_step(model, ids))
        (eager_losses, eager_grads), (graphed_losses, graphed_grads) = results
        _assert_same(eager_losses, graphed_losses, f"T={length} loss")
        _assert_same(eager_grads, graphed_grads, f"T={length} gradient of parameter")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    report = layer_graph_report(graphed)
    calls = SHAPE["num_hidden_layers"] * 2 * len(LENGTHS)
    assert report["failed_captures"] == {}, report
    # RAT+ (two patterns): a pass and a backward each within the forward
    assert report["replays"] == calls * (2 if name == "rat_plus" else 1) and report["eager_calls"] == {}, report
    # one signature per length (and RAT+ pattern); the SE layers' drawn chunk sizes (2) beside the Mamba layers' own
    expected = 4 if name == "rat_plus" else 2
    assert report["signatures"] == expected or (name == "se_hybrid_se" and 3 <= report["signatures"] <= 6), report


@pytest.mark.parametrize("name", ["rat", "llama"])
def test_two_forwards_before_one_backward_run_eagerly_and_exactly(name):
    eager, graphed = _pair(name)
    ids = torch.randint(1, SHAPE["vocab_size"], (2, 64), device="cuda")
    _accumulated_step(graphed, ids)  # captures the shape
    grads = []
    for model in (eager, graphed):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[:1], labels=ids[:1], use_cache=False).loss + model(input_ids=ids[1:], labels=ids[1:], use_cache=False).loss
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    _assert_same(grads[0], grads[1], "gradient of parameter")
    report = layer_graph_report(graphed)
    assert sum(report["eager_calls"].values()) == SHAPE["num_hidden_layers"], report
    with torch.no_grad():  # an evaluation forward in training mode: eager, not counted
        torch.testing.assert_close(graphed(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert layer_graph_report(graphed)["eager_calls"] == report["eager_calls"]


@pytest.mark.parametrize("name", ["rat_swa", "rattention"])
def test_bf16_window_layers_replay_flash_attention(name):
    """The window layers in bf16 run PyTorch's FlashAttention-2 (kernels/window_attention/flash.py);
    captured, its forward and backward replay and give the eager step (FlashAttention's backward adds
    dq with atomics, so the comparison is to a tolerance, not bitwise)."""
    from hf_hybrid.kernels.window_attention import flash_window_applies

    assert flash_window_applies(torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16))
    eager, graphed = _pair(name)
    eager, graphed = eager.to(torch.bfloat16), graphed.to(torch.bfloat16)
    ids = torch.randint(1, SHAPE["vocab_size"], (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    for _ in range(2):  # the first call captures, the second replays
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
        (eager_losses, eager_grads), (graphed_losses, graphed_grads) = (_accumulated_step(m, ids) for m in (eager, graphed))
        for a, b in zip(eager_losses, graphed_losses):
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-2, atol=1e-2)
        for i, (a, b) in enumerate(zip(eager_grads, graphed_grads)):
            if a is not None:
                assert ((b.float() - a.float()).norm() / (a.float().norm() + 1e-6)).item() < 2e-2, f"gradient of parameter {i}"
    report = layer_graph_report(graphed)
    assert report["failed_captures"] == {} and report["eager_calls"] == {}, report
    assert report["replays"] == SHAPE["num_hidden_layers"] * 2 * 2, report
