"""FoX (LLaMA and Pro blocks): the properties a FoX model must show, on tiny CPU models."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.layers.attention import SoftmaxAttention
from hf_hybrid.layers.context import SequenceContext
from hf_hybrid.layers.forgetting_attention import ForgettingAttention, forget_bias_init
from hf_hybrid.models.fox import FoxCache, FoxConfig
from model_checks import (
    assert_chunked_prefill_matches,
    assert_config_error,
    assert_gradient_checkpointing_matches,
    assert_left_padding_matches,
    assert_prefill_decode_matches,
    assert_save_load_roundtrip,
)

VOCAB = 61
BLOCKS = ["llama", "pro"]


def tiny_config(**overrides) -> FoxConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, kernel_backend="reference",
    )
    settings.update(overrides)
    return FoxConfig(**settings)


def tiny_model(**overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides)).eval()
    with torch.no_grad():  # non-trivial gates: bias 0 would make every f = 0.5-ish and alike
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.f_proj is not None:
                attn.f_proj.bias.uniform_(-1.0, 3.0)
    return model


# ---------------------------------------------------------------- the layer against Appendix A


def naive_fox_layer(layer: ForgettingAttention, x: torch.Tensor) -> torch.Tensor:
    """Eq. 15-23 one token at a time: explicit products of forget gates, no cumsum, no kernels."""
    batch, seq, _ = x.shape
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    group = heads // kv_heads
    q = layer.q_proj(x).view(batch, seq, heads, dim)
    k_tilde = layer.k_proj(x).view(batch, seq, kv_heads, dim)
    v_tilde = layer.v_proj(x).view(batch, seq, kv_heads, dim)
    f = torch.sigmoid(layer.f_proj(x))  # [batch, seq, heads]

    def rms(vec, weight, eps):
        return vec * torch.rsqrt(vec.pow(2).mean() + eps) * weight

    out = torch.zeros(batch, seq, heads, dim)
    for b in range(batch):
        keys = torch.zeros(seq, kv_heads, dim)
        values = torch.zeros(seq, kv_heads, dim)
        for t in range(seq):
            for g in range(kv_heads):
                k_t, v_t = k_tilde[b, t, g], v_tilde[b, t, g]
                if layer.k_shift is not None:
                    prev_k = k_tilde[b, t - 1, g] if t else torch.zeros(dim)
                    prev_v = v_tilde[b, t - 1, g] if t else torch.zeros(dim)
                    a_k = torch.sigmoid(layer.k_shift.proj.weight[g] @ x[b, t])
                    a_v = torch.sigmoid(layer.v_shift.proj.weight[g] @ x[b, t])
                    k_t = a_k * prev_k + (1 - a_k) * k_t
                    v_t = a_v * prev_v + (1 - a_v) * v_t
                if layer.k_norm is not None:
                    k_t = rms(k_t, layer.k_norm.weight[g], layer.k_norm.eps)
                keys[t, g], values[t, g] = k_t, v_t
        for h in range(heads):
            for i in range(seq):
                q_i = q[b, i, h]
                if layer.q_norm is not None:
                    q_i = rms(q_i, layer.q_norm.weight[h], layer.q_norm.eps)
                weights = torch.stack([
                    torch.prod(f[b, j + 1 : i + 1, h]) * torch.exp(q_i @ keys[j, h // group] / math.sqrt(dim))
                    for j in range(i + 1)
                ])
                o_i = (weights[:, None] * values[: i + 1, h // group]).sum(0) / weights.sum()
                if layer.o_norm is not None:
                    o_i = rms(o_i, layer.o_norm.weight[h], layer.o_norm.eps)
                out[b, i, h] = o_i
    out = out.reshape(batch, seq, heads * dim)
    if layer.g_proj is not None:
        out = out * torch.sigmoid(layer.g_proj(x))
    return layer.o_proj(out)


@pytest.mark.parametrize("pro", [False, True])
def test_layer_equals_appendix_a_written_out(pro):
    torch.manual_seed(1)
    layer = ForgettingAttention(
        32, 4, 2, 8, qk_norm=pro, kv_shift=pro, output_gate=pro, output_norm=pro, backend="reference"
    )
    with torch.no_grad():
        layer.f_proj.bias.uniform_(-1.0, 3.0)
        for norm in (layer.q_norm, layer.k_norm, layer.o_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 32)
    context = SequenceContext.build(2, 9, 0, None, None, x.device)
    with torch.no_grad():
        assert (layer(x, context) - naive_fox_layer(layer, x)).abs().max() < 1e-5


def test_f_one_without_shift_or_gates_is_plain_causal_softmax_attention():
    torch.manual_seed(2)
    fox = ForgettingAttention(32, 4, 2, 8, forget_gate="none", backend="reference")
    plain = SoftmaxAttention(32, 4, 2, 8, rope_theta=None)
    plain.load_state_dict({k: v for k, v in fox.state_dict().items() if k.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj")})
    x = torch.randn(2, 11, 32)
    context = SequenceContext.build(2, 11, 0, None, None, x.device)
    with torch.no_grad():
        assert (fox(x, context) - plain(x, context)).abs().max() < 1e-5


def test_forget_gate_init_follows_appendix_d():
    # The paper's example: H = 4, (T_min, T_max) = (2, 128) -> T = (2, 8, 32, 128).
    bias = forget_bias_init(4, 2.0, 128.0)
    timescales = 1.0 / -F.logsigmoid(bias.double())
    assert torch.allclose(timescales, torch.tensor([2.0, 8.0, 32.0, 128.0], dtype=torch.float64), rtol=1e-5)
    model = AutoModelForCausalLM.from_config(tiny_config())
    assert torch.count_nonzero(model.model.layers[0].self_attn.f_proj.bias) == 0  # data-dependent: bias 0
    fixed = AutoModelForCausalLM.from_config(tiny_config(forget_gate="fixed", forget_gate_t_max=128.0))
    bias = fixed.model.layers[1].self_attn.forget_bias
    assert not bias.requires_grad and torch.allclose(bias, forget_bias_init(4, 2.0, 128.0))
    free = AutoModelForCausalLM.from_config(tiny_config(forget_gate="data_independent"))
    assert free.model.layers[0].self_attn.forget_bias.requires_grad


# ---------------------------------------------------------------- kernels inside the model


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_type", BLOCKS)
def test_triton_backend_matches_reference_forward_and_gradients(block_type):
    # head_dim 16, T <= 40: the Triton kernel runs in the interpreter on CPU.
    ids = torch.randint(1, VOCAB, (2, 23))
    results = []
    for backend in ("reference", "triton"):
        model = tiny_model(block_type=block_type, kernel_backend=backend, hidden_size=32, num_attention_heads=2, num_key_value_heads=1).train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_r, grads_r), (loss_t, grads_t) = results
    assert torch.allclose(loss_r, loss_t, atol=1e-5)
    assert grads_r.keys() == grads_t.keys() and any("f_proj" in n for n in grads_r)
    for name in grads_r:
        assert torch.allclose(grads_r[name], grads_t[name], atol=1e-5, rtol=1e-4), name


# ---------------------------------------------------------------- cache exactness


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("llama", {"block_type": "llama"}),
        ("pro", {"block_type": "pro"}),
        ("pro_rope_mha", {"block_type": "pro", "use_rope": True, "num_key_value_heads": 4}),
        ("llama_data_independent", {"block_type": "llama", "forget_gate": "data_independent"}),
    ],
)
def test_prefill_plus_decode_equals_full_forward(name, overrides):
    model = tiny_model(**overrides)
    ids = torch.randint(1, VOCAB, (2, 15))
    for prefill in (1, 11):
        assert_prefill_decode_matches(model, ids, prefill)


@pytest.mark.parametrize("block_type", BLOCKS)
def test_chunked_prefill_equals_full_forward(block_type):
    model = tiny_model(block_type=block_type)
    assert_chunked_prefill_matches(model, torch.randint(1, VOCAB, (2, 25)), [6, 3, 1, 7, 1])


def test_cache_holds_kv_cumulative_forget_and_shift_state():
    model = tiny_model(block_type="pro")
    with torch.no_grad():
        cache = model(torch.randint(1, VOCAB, (2, 9)), use_cache=True).past_key_values
    layer = cache.layers[0]
    assert isinstance(cache, FoxCache)
    assert layer.keys.shape == (2, 9, 2, 8) and layer.cum_log_forget.shape == (2, 9, 4)
    assert layer.shift_key.shape == (2, 2, 8) and bool((layer.cum_log_forget.diff(dim=1) <= 0).all())


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("block_type", BLOCKS)
def test_left_padded_batch_generation_equals_per_row(block_type):
    model = tiny_model(block_type=block_type)
    prompts = [[5, 9, 3, 7, 2, 8, 4, 6, 1, 3, 9], [4, 4, 7], [8, 2, 6, 5, 5, 1, 7]]
    assert_left_padding_matches(model, prompts, pad_token_id=0, max_new_tokens=6)


def test_generate_uses_fox_cache_and_matches_uncached_greedy():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=7, do_sample=False, return_dict_in_generate=True)
        uncached = model.generate(ids, max_new_tokens=7, do_sample=False, use_cache=False)
    assert isinstance(cached.past_key_values, FoxCache)
    assert torch.equal(cached.sequences, uncached)


def test_beam_search_reorders_the_cache():
    model = tiny_model(block_type="pro")
    ids = torch.randint(1, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False, early_stopping=True)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


# ---------------------------------------------------------------- HF integration


def test_auto_config_for_model_builds_a_working_tiny_model():
    config = AutoConfig.for_model("fox", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128)
    assert isinstance(config, FoxConfig) and config.block_type == "pro" and config.kv_shift and not config.use_rope
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "FoxForCausalLM"
    ids = torch.randint(0, VOCAB, (1, 20))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].self_attn.f_proj.bias.grad is not None
    llama = FoxConfig(block_type="llama", kv_shift=True)
    assert llama.kv_shift and not llama.qk_norm and not llama.output_gate


@pytest.mark.parametrize("block_type", BLOCKS)
def test_save_and_reload_in_another_process_is_bit_exact(tmp_path, block_type):
    model = tiny_model(block_type=block_type)
    assert_save_load_roundtrip(model, tmp_path, torch.randint(1, VOCAB, (2, 13)), "FoxForCausalLM")


def test_gradient_checkpointing_gives_same_gradients():
    assert_gradient_checkpointing_matches(tiny_model(block_type="pro"), torch.randint(1, VOCAB, (2, 11)))


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("block_type", {"block_type": "gpt"}),
        ("forget_gate", {"forget_gate": "sometimes"}),
        ("forget_gate_t_min", {"forget_gate_t_min": 0.0}),
        ("num_attention_heads", {"hidden_size": 30, "num_attention_heads": 4}),
        ("num_key_value_heads", {"num_key_value_heads": 3}),
        ("kernel_backend", {"kernel_backend": "cuda"}),
    ],
)
def test_invalid_configs_name_the_field(field, kwargs):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    base.update(kwargs)
    assert_config_error(FoxConfig, field, **base)
