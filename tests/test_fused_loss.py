"""The fused LM head + loss of every model (hf_hybrid/layers/loss.py over
kernels/linear_cross_entropy) against transformers' ForCausalLMLoss on the full logits; it needs
Triton only (its interpreter on CPU at tiny shapes), not Liger."""
from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_hybrid.layers import backbone_fusion
from hf_hybrid.layers.loss import causal_lm_loss_from_hidden, shifted_labels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fusion():
    """Turn the fused path on (also for CPU tensors: Triton's interpreter) and restore afterwards."""
    previous = backbone_fusion._enabled, backbone_fusion._allow_cpu
    backbone_fusion.set_backbone_fusion(True, allow_cpu=True)
    yield backbone_fusion
    backbone_fusion._enabled, backbone_fusion._allow_cpu = previous


def test_fused_loss_is_off_on_cpu_by_default_and_when_switched_off(fusion):
    assert fusion.fused_loss_applies(torch.zeros(2))
    fusion._allow_cpu = False
    assert not fusion.fused_loss_applies(torch.zeros(2))
    fusion._allow_cpu, fusion._enabled = True, False
    assert not fusion.fused_loss_applies(torch.zeros(2))


@pytest.mark.parametrize("num_items", [None, 11])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_loss_matches_for_causal_lm_loss(fusion, num_items, dtype, tol):
    torch.manual_seed(0)
    batch, seq, hidden, vocab = 2, 7, 32, 50
    h = torch.randn(batch, seq, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEVICE) / hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    labels[0, 2] = labels[1, :3] = -100  # padding / prompt tokens are not scored

    loss = causal_lm_loss_from_hidden(h, w, labels, num_items_in_batch=num_items)
    loss.backward()
    fused = loss.detach(), h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    plain = ForCausalLMLoss((h @ w.T), labels, vocab, num_items_in_batch=num_items)
    plain.backward()
    torch.testing.assert_close(fused[0].float(), plain.detach().float(), atol=tol, rtol=tol)
    torch.testing.assert_close(fused[1].float(), h.grad.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(fused[2].float(), w.grad.float(), atol=tol, rtol=tol)


def test_shifted_labels_match_transformers():
    labels = torch.tensor([[5, 6, 7, -100]])
    assert shifted_labels(labels).tolist() == [[6, 7, -100, -100]]


def _tiny_rat():
    from hf_hybrid.models.rat import RatConfig, RatForCausalLM

    torch.manual_seed(0)
    config = RatConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=2, chunk_size=4, max_position_embeddings=64)
    return RatForCausalLM(config).to(DEVICE).train()


def test_model_training_loss_is_fused_and_logits_stay_available(fusion):
    model = _tiny_rat()
    ids = torch.randint(0, 64, (2, 9), device=DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100

    out = model(ids, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(13))
    assert out.logits is None  # training with labels: the [B, T, vocab] logits are never built
    out.loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    kept = model(ids, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(13), skip_logits=False)
    assert kept.logits is not None and kept.logits.shape == (2, 9, 64)
    kept.loss.backward()
    torch.testing.assert_close(out.loss, kept.loss, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)

    model.eval()  # evaluation with labels keeps the logits (e.g. per-token losses)
    with torch.no_grad():
        assert model(ids, labels=labels, use_cache=False).logits is not None


def test_model_without_fusion_is_unchanged_on_cpu():
    model = _tiny_rat().cpu()
    ids = torch.randint(0, 64, (1, 6))
    out = model(ids, labels=ids, use_cache=False)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, ids, 64))


