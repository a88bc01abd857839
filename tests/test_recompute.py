"""Activations rebuilt in the backward instead of kept (hf_hybrid/layers/recompute.py): the same
gradients, the registered tensors not kept, in-place changes refused, and no effect where other
saved-tensor hooks or torch.compile manage memory."""
from __future__ import annotations

import importlib

import pytest
import torch

from hf_hybrid.layers import recompute as recompute_module
from hf_hybrid.layers.recompute import RecomputedActivations, recompute_applies


def _step(a, w, recompute: RecomputedActivations | None):
    """h = tanh(a) (cheap to rebuild from a); loss reads two views of h through ops that save them."""
    h = torch.tanh(a)
    if recompute is not None:
        recompute.register(h, lambda: torch.tanh(a), a)
    left, right = h[:, :3], h[:, 3:].t()
    return (left * w).sum() + (right @ right.t()).trace()


def test_rebuilt_views_give_the_same_gradients_and_are_not_kept():
    torch.manual_seed(0)
    a, w = torch.randn(4, 7, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    expected = torch.autograd.grad(_step(a, w, None), (a, w))
    recompute = RecomputedActivations()
    packed = []
    original_pack = recompute._pack
    recompute._pack = lambda t: packed.append(original_pack(t)) or packed[-1]
    with recompute.active():
        loss = _step(a, w, recompute)
    markers = [p for p in packed if not isinstance(p, torch.Tensor) and getattr(p, "packed", None) is None]
    # tanh's save of h before it was registered, and the two views, one of them saved twice (mm):
    # all held as geometry only
    assert len(markers) == 4
    assert recompute.sources[0].tensor is None  # let go when the forward region ended
    got = torch.autograd.grad(loss, (a, w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert recompute.sources[0].rebuilt is None  # freed after its last view was unpacked


def test_a_rebuild_reading_another_rebuilt_tensor_shares_it():
    """g = exp(h) rebuilt from h = tanh(a), itself rebuilt: h is rebuilt once, for g's rebuild and
    for the unpack of sin's save of h, and let go after that unpack."""
    torch.manual_seed(0)
    a = torch.randn(5, 3, requires_grad=True)

    def step(recompute):
        h = torch.tanh(a)
        g = torch.exp(h)  # saves its output g
        if recompute is not None:
            h_source = recompute.register(h, lambda: calls.append("h") or torch.tanh(a), a)
            recompute.register(g, lambda: calls.append("g") or torch.exp(recompute.value(h_source)), a)
        return (g * torch.sin(h)).sum()

    calls = []
    expected = torch.autograd.grad(step(None), a)[0]
    recompute = RecomputedActivations()
    with recompute.active():
        loss = step(recompute)
    got = torch.autograd.grad(loss, a)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert sorted(calls) == ["g", "h"]
    assert all(source.rebuilt is None for source in recompute.sources)


def test_an_input_modified_before_the_backward_is_refused():
    a, w = torch.randn(4, 7, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    source = a * 1.0
    recompute = RecomputedActivations()
    with recompute.active():
        loss = _step(source, w, recompute)
    with torch.no_grad():
        source.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_steps_aside_for_other_hooks_no_grad_and_compile():
    assert recompute_applies()
    with torch.no_grad():
        assert not recompute_applies()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not recompute_applies()
    compiled = torch.compile(lambda x: x + float(recompute_applies()), backend="eager", fullgraph=True)
    assert float(compiled(torch.zeros(()))) == 0.0


@pytest.mark.slow  # ~40 s interpreted; the RAT and RATTENTION rebuild tests cover the mechanism in CI
@pytest.mark.parametrize("proj_bias", [True, False])
def test_se_mixer_rebuilds_its_conv_and_norm_outputs_exactly(monkeypatch, proj_bias):
    """A tiny SE hybrid's Mamba-2 layers on the Triton path (interpreter on CPU), left padding: the
    same loss and gradients with the rebuilding on and off. With an in_proj bias the mixer runs op
    by op and its conv and norm run again in the backward; without, it runs as one op
    (kernels/mamba2_mixer, which rebuilds its conv itself) and the norm runs again."""
    from hf_hybrid.kernels._backend import triton_interpreting

    if not (torch.cuda.is_available() or triton_interpreting()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from transformers import AutoModelForCausalLM

    from hf_hybrid.models.se_hybrid import SEHybridConfig
    from hf_hybrid.models.se_hybrid.modeling_se_hybrid import SEMambaMixer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = SEHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        layer_types=["mamba", "attention"], mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8, mamba_proj_bias=proj_bias,
        se_chunk_sizes=[16], se_block_size=4, se_top_k=2, se_select_every=8, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).train()
    model.model.layers[0].self_attn.kernel_backend = "triton"
    ids = torch.randint(1, 64, (2, 19), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    convs, norms, wholes, norm_ops = [], [], [], []
    original_conv, original_norm = SEMambaMixer._conv, SEMambaMixer._gated_norm
    monkeypatch.setattr(SEMambaMixer, "_conv", lambda self, *a: convs.append(torch.is_grad_enabled()) or original_conv(self, *a))
    monkeypatch.setattr(
        SEMambaMixer, "_gated_norm", lambda self, *a: norms.append(torch.is_grad_enabled()) or original_norm(self, *a))
    modeling = "hf_hybrid.models.se_hybrid.modeling_se_hybrid"
    original_whole, original_rms = importlib.import_module(modeling).mamba2_mixer, importlib.import_module(modeling).gated_rms_norm
    monkeypatch.setattr(f"{modeling}.mamba2_mixer", lambda *a, **k: wholes.append(True) or original_whole(*a, **k))
    monkeypatch.setattr(f"{modeling}.gated_rms_norm", lambda *a, **k: norm_ops.append(torch.is_grad_enabled()) or original_rms(*a, **k))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    rebuilt = loss_and_grads()
    if proj_bias:  # the forward's conv and gated norm, then their rebuilds in the backward (no grad)
        assert convs == [True, False] and norms == [True, False] and not wholes
    else:  # the whole mixer in the forward, the norm's rebuild in the backward
        assert wholes == [True] and norm_ops == [False] and not convs and not norms
    monkeypatch.setattr(recompute_module, "recompute_applies", lambda: False)
    monkeypatch.setattr("hf_hybrid.models.se_hybrid.modeling_se_hybrid.recompute_applies", lambda: False)
    kept = loss_and_grads()
    assert kept.keys() == rebuilt.keys()
    for name, grad in kept.items():
        torch.testing.assert_close(rebuilt[name], grad, rtol=0, atol=0, msg=name)


def test_environment_turns_recompute_off(monkeypatch):
    """HF_HYBRID_RECOMPUTE=0: the A/B switch of the memory benchmarks."""
    from hf_hybrid.layers.recompute import recompute_applies

    assert recompute_applies()
    monkeypatch.setenv("HF_HYBRID_RECOMPUTE", "0")
    assert not recompute_applies()


def test_in_place_change_of_a_passed_through_save_is_refused():
    """autograd checks no saved tensor's version under saved-tensor hooks: the region does it for the
    saves it passes through (a parameter modified before backward() would give wrong gradients)."""
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    recompute = RecomputedActivations()
    with recompute.active():
        y = (x * w).sum()
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
