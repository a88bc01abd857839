"""What a RATTENTION training forward keeps for its backward (peak memory at 32K).

The local layer rebuilds the QK-normed, rotated q~ and k~ (kept by the SWA op) in the backward from
the raw q and k (kept by the norm and the RLA op), and o_proj's input (the sum of the branch norms,
kept by o_proj) from the two branch outputs (kept by the norms' backward); the global layer rebuilds
its QK-normed q and k (kept by the attention) from the raw ones (kept by the norm).
hf_hybrid/layers/residual_linear_attention.py, layers/recompute.py. The saved bytes per token drop by
exactly those tensors (benchmarks/saved_tensors.py counts them) and every gradient is bit-equal
to the path that keeps them. Tiny shapes in Triton's interpreter on CPU; there the SWA runs through
SDPA with its band mask (flex_attention has no CPU backward), which saves q~ and k~ as flex does.
"""
from __future__ import annotations

import pytest
import torch

import hf_hybrid.layers.residual_linear_attention as rattention_module
from benchmark_modules import load
from hf_hybrid.kernels._backend import triton_interpreting

saved_tensor_report = load("saved_tensors").saved_tensor_report  # counts what a forward saves

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 2, 1, 16, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOCAL, GLOBAL = 0, 1  # layer indices


def _model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from hf_hybrid.models.rattention import RattentionConfig

    config = RattentionConfig(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2, layer_types=["local", "global"],
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, window_size=WINDOW, kernel_backend="triton",
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=DEVICE, dtype=dtype).train()
    with torch.no_grad():  # norm scales start at 1: random ones make a wrong weight in a rebuild visible
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 2:
                param.uniform_(0.5, 1.5)
    # The window through SDPA's band mask, which saves q~ and k~ as flex_attention does (flex has no CPU
    # backward, and on CUDA needs a wider head than these).
    model.model.layers[LOCAL].self_attn._swa_backend = lambda: "sdpa"
    return model


# On CUDA, SDPA's float32 kernels for a masked (band or causal) attention save contiguous copies of
# q~ / k~, not the tensors the layers register, so nothing is rebuilt there (nor wrongly kept: the
# registration is unused). The models' own CUDA window path is flex_attention; the bench's bf16
# training step measures the drop (`hf-hybrid bench --suites models --only "train T=32K"`).
_NOT_ON_CUDA = pytest.mark.skipif(DEVICE == "cuda", reason="SDPA's fp32 CUDA kernels save copies of q~ / k~: no rebuild to test")


def _ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(1, 32, (batch, seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)


def _keep_everything(monkeypatch) -> None:
    """The path before the rebuilding: every activation kept."""
    monkeypatch.setattr(rattention_module, "recompute_applies", lambda: False)


def _mixer_bytes_per_token(model, ids) -> dict[int, float]:
    report = saved_tensor_report(model, ids)
    totals = {LOCAL: 0.0, GLOBAL: 0.0}
    for s in report.storages:
        if s.module.startswith("model.layers.*.self_attn"):
            totals[s.layer] += s.nbytes / ids.numel()
    return totals


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=_NOT_ON_CUDA), torch.bfloat16])
def test_mixers_keep_less_by_the_rebuilt_tensors(monkeypatch, dtype):
    model, ids = _model(dtype), _ids()
    esize, q_width, kv_width = dtype.itemsize, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    rebuilt = {
        LOCAL: (2 * q_width + kv_width) * esize,  # q~, k~ and o_proj's input
        GLOBAL: (q_width + kv_width) * esize,  # the normed q and k
    }
    after = _mixer_bytes_per_token(model, ids)
    _keep_everything(monkeypatch)
    before = _mixer_bytes_per_token(model, ids)
    for layer in (LOCAL, GLOBAL):
        assert before[layer] - after[layer] == rebuilt[layer], (layer, before, after, rebuilt)
    # Kept by the local layer: the projections' input x, raw q, k and v, the SWA output and its
    # float32 log-sum-exp per head, the RLA output; at these tiny shapes also the float32 RoPE tables
    # (cos and sin, one row per token) and SDPA's T x T band mask (at most float32; flex keeps none).
    seq = ids.shape[1]
    bound = (HIDDEN + 3 * q_width + 2 * kv_width) * esize + 4 * HEADS + 2 * 4 * HEAD_DIM + 4 * seq * seq / ids.numel()
    assert after[LOCAL] <= bound, (after, bound)


@pytest.mark.parametrize("dtype, use_cache", [
    pytest.param(torch.float32, False, marks=[_NOT_ON_CUDA, pytest.mark.slow]), (torch.bfloat16, False),
    pytest.param(torch.float32, True, marks=_NOT_ON_CUDA),
])
def test_gradients_are_bit_equal_with_and_without_the_rebuilding(monkeypatch, dtype, use_cache):
    """use_cache=False: a training step (what a training forward does unless asked for a cache);
    True: a cache is filled, where the local cache copies what it keeps and the global one holds k itself."""
    model, ids = _model(dtype), _ids()
    calls = []
    original = rattention_module.norm_rotary
    monkeypatch.setattr(rattention_module, "norm_rotary",
                        lambda *a: calls.append(torch.is_grad_enabled()) or original(*a))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, rebuilt = loss_and_grads()
    # The backward rebuilt q~, k~ and the global layer's normed q and k, one call each; with a cache the
    # global attention reads (and keeps) the cache's copy of k instead, so k has nothing to rebuild.
    assert calls == [False] * (4 if use_cache is False else 3)
    _keep_everything(monkeypatch)
    loss_kept, kept = loss_and_grads()
    assert torch.equal(loss, loss_kept)
    assert kept.keys() == rebuilt.keys() and len(kept) == len(list(model.parameters()))
    for name, grad in kept.items():
        assert torch.equal(rebuilt[name], grad), name


@pytest.mark.parametrize(
    "layer, module, use_cache",
    [(LOCAL, "q_norm", False), (LOCAL, "swa_norm", False), (LOCAL, "o_proj", False), (GLOBAL, "k_norm", False),
     (GLOBAL, "k_norm", None)],
)
def test_an_input_of_a_rebuild_modified_before_the_backward_is_refused(layer, module, use_cache):
    """A weight that a rebuild reads, or that is saved beside a rebuilt tensor (o_proj's: autograd checks
    no version under saved-tensor hooks), changed in place between the forward and the backward."""
    model, ids = _model(torch.float32), _ids(batch=1)
    weight = getattr(model.model.layers[layer].self_attn, module).weight
    loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
    with torch.no_grad():
        weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified (in place|by an inplace operation)"):
        loss.backward()


def test_the_rebuild_steps_aside_under_HF_HYBRID_RECOMPUTE_0(monkeypatch):
    model, ids = _model(torch.bfloat16), _ids()
    after = _mixer_bytes_per_token(model, ids)
    monkeypatch.setenv("HF_HYBRID_RECOMPUTE", "0")
    before = _mixer_bytes_per_token(model, ids)
    assert all(before[layer] > after[layer] for layer in (LOCAL, GLOBAL)), (before, after)
