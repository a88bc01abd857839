"""benchmarks.ceilings: each stand-in replaces only its mixer (the real operators are never
called), keeps the projections in the backward, and is undone after its block."""
from __future__ import annotations

import pytest
import torch

from benchmarks import ceilings
from hf_hybrid.bench.cases import BenchConfig
from hf_hybrid.bench.models import architectures, build_ours
from hf_hybrid.layers import forgetting_attention as fox_layer
from hf_hybrid.layers import rat_attention as rat_layer
from hf_hybrid.layers import residual_linear_attention as rattention_layer
from hf_hybrid.models.se_hybrid import modeling_se_hybrid as se_hybrid_model

CONFIG = BenchConfig(device=torch.device("cpu"), dtype=torch.float32, quick=True)


def _model(arch_name: str):
    torch.manual_seed(0)
    return build_ours(next(a for a in architectures(True) if a.name == arch_name), CONFIG).float()


def _forbid(monkeypatch, owner, name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran under a stand-in that replaces it")
    monkeypatch.setattr(owner, name, fail)


@pytest.mark.parametrize("arch_name,stand,forbidden,projection", [
    ("RAT", "free mixer", [(rat_layer, "block_end_attention"), (rat_layer, "chunk_end_attention")], "q_proj"),
    ("RATTENTION", "free local mixers", [(rattention_layer, "residual_linear_attention"),
                                         (rattention_layer, "sliding_window_attention")], "k_proj"),
    ("RATTENTION", "free RLA", [(rattention_layer, "residual_linear_attention")], "v_proj"),
    ("RATTENTION", "RLA at its memory floor", [(rattention_layer, "residual_linear_attention")], "v_proj"),
    ("FoX (llama)", "cuDNN attention", [(fox_layer, "forgetting_attention")], "f_proj"),
    ("SE hybrid", "free Mamba mixers", [(se_hybrid_model, "ssd_scan"), (se_hybrid_model, "causal_conv1d"),
                                        (se_hybrid_model, "gated_rms_norm")], "in_proj"),
    ("RAT-SWA", "free mixer", [(rat_layer, "block_end_attention"), (rat_layer, "chunk_end_attention")], "q_proj"),
])
def test_training_stand_ins_skip_the_mixer_and_keep_the_projections(monkeypatch, arch_name, stand, forbidden, projection):
    model = _model(arch_name).train()
    for owner, name in forbidden:
        _forbid(monkeypatch, owner, name)
    ids = torch.randint(3, model.config.vocab_size, (1, 24))
    with ceilings.stand_in(stand):  # installed over the failing functions, which come back after it
        model(input_ids=ids, labels=ids).loss.backward()
    layers = [m for m in model.modules() if hasattr(m, projection) and getattr(m, projection) is not None]
    grads = [getattr(m, projection).weight.grad for m in layers]
    assert grads and all(g is not None for g in grads)


def test_stand_ins_are_undone_after_the_block():
    originals = {(id(owner), attr): getattr(owner, attr) for entries in ceilings.STAND_INS.values() for owner, attr, _ in entries}
    for name in ceilings.STAND_INS:
        with ceilings.stand_in(name):
            owner, attr, replacement = ceilings.STAND_INS[name][0]
            assert getattr(owner, attr) is replacement
    assert all(getattr(owner, attr) is originals[(id(owner), attr)]
               for entries in ceilings.STAND_INS.values() for owner, attr, _ in entries)


@pytest.mark.parametrize("arch_name,stand", [("RAT", "free decode mixer"), ("RATTENTION", "free local decode")])
def test_decode_stand_ins_replace_only_the_decode_steps(monkeypatch, arch_name, stand):
    model = _model(arch_name).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        want_prefill = model(ids).logits
        with ceilings.stand_in(stand):
            assert torch.equal(model(ids).logits, want_prefill)  # the prompt's forward is the model's own
            if arch_name == "RAT":
                _forbid(monkeypatch, rat_layer, "rat_decode_inputs_reference")
            else:
                _forbid(monkeypatch, rattention_layer, "residual_linear_attention_decode")
                _forbid(monkeypatch, rattention_layer, "ring_decode")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 23)


def test_the_memory_floor_stand_in_has_the_rla_shapes_and_gradients():
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    k, v = (torch.randn(2, 5, 2, 8, requires_grad=True) for _ in range(2))
    o, state = ceilings._rla_at_memory_floor(q, k, v, 3, "softmax")
    assert state is None and o.shape == q.shape
    expanded = lambda x: x.repeat_interleave(2, dim=2)  # noqa: E731  (query head h reads head h // 2)
    torch.testing.assert_close(o, q + expanded(k) * expanded(v))
    grad = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), grad)
    torch.testing.assert_close(dq, q * grad)
    torch.testing.assert_close(dk, (grad * expanded(v)).view(2, 5, 2, 2, 8).sum(3))
    torch.testing.assert_close(dv, (grad * expanded(k)).view(2, 5, 2, 2, 8).sum(3))
