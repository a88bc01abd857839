"""What a RAT training forward keeps for its backward (peak memory at 32K).

The fused training path rebuilds k_rot, v~, the rotated q, the gate logits and z in the backward
instead of keeping them (hf_hybrid/layers/rat_attention.py, ``_train_fused``): the saved bytes per token drop by
exactly those tensors (benchmarks/saved_tensors.py counts them), and every gradient is
bit-equal to the path that keeps them. Tiny shapes in Triton's interpreter on CPU.
"""
from __future__ import annotations

import pytest
import torch

import hf_hybrid.layers.rat_attention as rat_module
from benchmark_modules import load
from hf_hybrid.kernels._backend import triton_interpreting

saved_tensor_report = load("saved_tensors").saved_tensor_report  # counts what a forward saves

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)

HIDDEN, HEADS, HEAD_DIM, GROUPS, CHUNK = 32, 2, 16, 2, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from hf_hybrid.models.rat import RatConfig

    config = RatConfig(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
        chunk_size=CHUNK, kernel_backend="triton", pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=DEVICE, dtype=dtype).train()


def _ids(batch: int = 2, seq: int = 2 * CHUNK) -> torch.Tensor:
    return torch.randint(1, 32, (batch, seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)


@pytest.fixture(autouse=True)
def _rebuild_gates_at_any_length(monkeypatch):
    """These shapes are tiny: the gate rebuild, on from GATE_REBUILD_MIN_TOKENS tokens, runs here too."""
    monkeypatch.setattr(rat_module, "GATE_REBUILD_MIN_TOKENS", 0)


def _keep_everything(monkeypatch) -> None:
    """The path before the rebuilding: every activation kept."""
    monkeypatch.setattr(rat_module, "recompute_applies", lambda: False)


def _mixer_bytes_per_token(model, ids) -> float:
    report = saved_tensor_report(model, ids)
    mixer = [s for s in report.storages if s.module.startswith("model.layers.*.self_attn")]
    return sum(s.nbytes for s in mixer) / ids.numel()


def test_rat_mixer_keeps_less_by_the_rebuilt_tensors(monkeypatch):
    model, ids = _model(torch.bfloat16), _ids()
    esize, inner, group_width = 2, HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    rebuilt = (4 * inner + group_width) * esize  # k_rot, v~, the rotated q, the gate logits and z
    # Kept: the projections' input x, q and k (per group), v, the ungated attention and o_proj's
    # input (= sigmoid(z) * attention), the float32 log-sum-exp per head and the float32
    # chunk-index RoPE tables (cos and sin, shared by the layers).
    bound = (HIDDEN + 2 * group_width + 3 * inner) * esize + 4 * HEADS + 2 * 4 * HEAD_DIM
    after = _mixer_bytes_per_token(model, ids)
    _keep_everything(monkeypatch)
    before = _mixer_bytes_per_token(model, ids)
    assert after <= bound, (after, bound)
    assert before - after == rebuilt, (before, after, rebuilt)


def test_gates_behind_a_hooked_projection_are_kept(monkeypatch):
    """A projection that is not a plain nn.Linear (a hook here; LoRA, quantisation) cannot be rerun
    as F.linear(x, W): its gate stays saved, the rest is rebuilt as before."""
    model, ids = _model(torch.bfloat16), _ids()
    model.model.layers[0].self_attn.g_proj.register_forward_hook(lambda module, args, out: None)
    esize, inner, group_width = 2, HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    after = _mixer_bytes_per_token(model, ids)
    _keep_everything(monkeypatch)
    before = _mixer_bytes_per_token(model, ids)
    assert before - after == (2 * inner + group_width) * esize, (before, after)


def test_gates_of_short_steps_are_kept(monkeypatch):
    """Below GATE_REBUILD_MIN_TOKENS tokens per forward the gate logits and z stay saved (two GEMMs
    per layer cost more than their memory saves there); k_rot, v~ and the rotated q are still rebuilt."""
    model, ids = _model(torch.bfloat16), _ids()
    esize, inner, group_width = 2, HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    monkeypatch.setattr(rat_module, "GATE_REBUILD_MIN_TOKENS", ids.numel())  # the threshold itself rebuilds
    rebuilt = _mixer_bytes_per_token(model, ids)
    monkeypatch.setattr(rat_module, "GATE_REBUILD_MIN_TOKENS", ids.numel() + 1)
    gates_kept = _mixer_bytes_per_token(model, ids)
    _keep_everything(monkeypatch)
    before = _mixer_bytes_per_token(model, ids)
    assert gates_kept - rebuilt == 2 * inner * esize, (gates_kept, rebuilt)  # the gate logits and z
    assert before - gates_kept == (2 * inner + group_width) * esize, (before, gates_kept)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])  # fp32: slow
def test_rat_gradients_are_bit_equal_with_and_without_the_rebuilding(monkeypatch, dtype):
    model, ids = _model(dtype), _ids()
    calls = []
    original = rat_module.RatAttention._keys_values
    monkeypatch.setattr(rat_module.RatAttention, "_keys_values",
                        lambda self, *a: calls.append(torch.is_grad_enabled()) or original(self, *a))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, rebuilt = loss_and_grads()
    assert calls == [True, False]  # the forward's kernel, then one rebuild of k_rot and v~ together
    _keep_everything(monkeypatch)
    loss_kept, kept = loss_and_grads()
    assert torch.equal(loss, loss_kept)
    assert kept.keys() == rebuilt.keys() and len(kept) == len(list(model.parameters()))
    for name, grad in kept.items():
        assert torch.equal(rebuilt[name], grad), name


def test_nothing_of_a_step_outlives_its_backward_without_the_garbage_collector(monkeypatch):
    """The rebuild closures hold k, v, q and x: once the backward has unpacked every rebuilt view,
    the recompute regions hold no tensor, even if a reference cycle keeps the region objects
    themselves until a gc run (one did: 4.6 GB at T=32K on the GPU)."""
    import gc
    import weakref

    model, ids = _model(torch.bfloat16), _ids()
    instances = []  # weak references: a strong one would keep them alive
    original_init = rat_module.RecomputedActivations.__init__

    def tracked_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        instances.append(weakref.ref(self))

    monkeypatch.setattr(rat_module.RecomputedActivations, "__init__", tracked_init)
    gc.collect()
    gc.disable()
    try:
        loss = model(input_ids=ids, labels=ids).loss
        assert len(instances) == 1 and len(instances[0]().sources) == 5  # gate logits, z, k_rot, v~, q_rot
        loss.backward()
        del loss
        for region in filter(None, (ref() for ref in instances)):
            assert region.kept == []
            for source in region.sources:
                assert source.tensor is None and source.rebuilt is None and source.rebuild is None and source.inputs == ()
    finally:
        gc.enable()


def test_a_parameter_modified_before_the_backward_is_refused():
    model, ids = _model(torch.float32), _ids(batch=1)
    attention = model.model.layers[0].self_attn
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        attention.gate_bias.add_(1.0)  # the rebuild of k_rot / v~ reads it (and the kernel's backward)
    with pytest.raises(RuntimeError, match="modified (in place|by an inplace operation)"):
        loss.backward()
