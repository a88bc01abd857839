"""FoX training with padded batches (regression: a left-padded forward without a cache raised
UnboundLocalError): the padded batch's loss and gradients equal those of each row run alone."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.layers.forgetting_attention import padded_row_boundaries
from hf_hybrid.models.fox import FoxConfig

VOCAB = 37
PAD = 0
ROWS = [[5, 9, 3, 12, 7, 30, 2], [14, 6, 21], [8, 1, 33, 4, 19]]


def tiny_fox(block_type: str, backend: str):
    # head_dim 16: the smallest the Triton kernel takes. GQA (4 query heads, 2 kv heads) on purpose.
    config = FoxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, block_type=block_type, pad_token_id=PAD, kernel_backend=backend,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().train()
    with torch.no_grad():  # distinct forget gates per head and token (bias 0 makes them all alike)
        for layer in model.model.layers:
            layer.self_attn.f_proj.bias.uniform_(-1.0, 3.0)
    return model


def padded_batch(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        cols = slice(longest - len(row), longest) if side == "left" else slice(0, len(row))
        ids[i, cols], mask[i, cols] = torch.tensor(row), 1
    # A label counts where it and the token before it are real: a left-padded row's first token has
    # only padding before it (alone it has nothing), so it is no target, as in the row alone.
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return ids, mask, labels


def summed_loss_and_grads(model, ids, mask, labels):
    """Sum over rows of the per-token cross-entropy (so rows run alone add up to the batch) and its gradients."""
    model.zero_grad()
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    shift_logits, shift_labels = logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)
    loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")),
]


def _padding_cases():
    """Every (block, backend, side); FoX pro on Triton is a slow check (~25-30 s per side interpreted;
    the llama block's Triton cases and pro's reference cases run in CI)."""
    for block_type in ("llama", "pro"):
        for entry in BACKENDS:
            backend, marks = (entry.values[0], list(entry.marks)) if hasattr(entry, "values") else (entry, [])
            for side in ("left", "right"):
                slow = block_type == "pro" and backend == "triton"
                yield pytest.param(block_type, backend, side, marks=marks + ([pytest.mark.slow] if slow else []),
                                   id=f"{block_type}-{backend}-{side}")


@pytest.mark.parametrize("block_type, backend, side", list(_padding_cases()))
def test_padded_training_step_equals_rows_alone(block_type, backend, side):
    model = tiny_fox(block_type, backend)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model.to(device)
    ids, mask, labels = (t.to(device) for t in padded_batch(ROWS, side))

    # The failing call: labels, left padding, no cache, in training mode.
    out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    assert torch.isfinite(out.loss)
    out.loss.backward()

    batch_loss, batch_grads = summed_loss_and_grads(model, ids, mask, labels)
    alone_loss, alone_grads = torch.zeros((), device=device), {}
    for row in ROWS:
        row_ids = torch.tensor([row], device=device)
        loss, grads = summed_loss_and_grads(model, row_ids, torch.ones_like(row_ids), row_ids)
        alone_loss += loss
        for name, grad in grads.items():
            alone_grads[name] = alone_grads.get(name, 0) + grad

    torch.testing.assert_close(batch_loss, alone_loss, rtol=1e-5, atol=1e-5)
    assert batch_grads.keys() == alone_grads.keys()
    for name in alone_grads:
        torch.testing.assert_close(batch_grads[name], alone_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_type", ["llama", "pro"])
def test_padded_prefill_then_decode_equals_rows_alone(block_type, backend):
    """A padded prefill through the cache (the segment path with a cache) still decodes each row as alone."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    model = tiny_fox(block_type, backend).eval().to(device)
    ids, mask, _ = (t.to(device) for t in padded_batch(ROWS, "left"))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        next_ids = torch.tensor([[3], [4], [5]], device=device)
        step = model(next_ids, attention_mask=torch.cat([mask, torch.ones_like(next_ids)], 1),
                     past_key_values=out.past_key_values, use_cache=True)
        for i, row in enumerate(ROWS):
            alone = model(torch.tensor([row + [3 + i]], device=device)).logits[0]
            torch.testing.assert_close(out.logits[i, -len(row):], alone[:-1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step.logits[i, -1], alone[-1], rtol=1e-5, atol=1e-5)


def test_padded_row_boundaries():
    valid = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    # row 0: pads 0-1, tokens 2-3; row 1: tokens 4-6, pad 7; row 2: 8-11; row 3: all padding 12-15.
    assert padded_row_boundaries(valid).tolist() == [0, 2, 4, 7, 8, 12, 16]
    holes = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    assert padded_row_boundaries(holes) is None


def test_padding_inside_a_row_takes_the_exact_masked_path():
    """A mask with a hole cannot be packed; the masked path still gives each row its own result.
    (LLaMA block: KV-shift would, by design, take the zeroed pad as the token before the hole.)"""
    model = tiny_fox("llama", "reference").eval()
    ids = torch.tensor([[5, 9, 3, 12], [8, 1, 33, 4]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        alone = model(torch.tensor([[5, 3, 12]])).logits[0]
    torch.testing.assert_close(logits[0, [0, 2, 3]], alone, rtol=1e-5, atol=1e-5)
