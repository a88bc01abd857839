"""RATTENTION local-global models: the properties a RATTENTION model must show, on tiny CPU models."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.kernels.residual_linear_attention import feature_map_fn, residual_linear_attention
from hf_hybrid.layers.context import SequenceContext
from hf_hybrid.layers.residual_linear_attention import RattentionGlobalAttention, RattentionLocalAttention
from hf_hybrid.models.rattention import (
    RattentionCache,
    RattentionConfig,
    RattentionGlobalLayerCache,
    RattentionLocalLayerCache,
)
from model_checks import (
    assert_chunked_prefill_matches,
    assert_config_error,
    assert_gradient_checkpointing_matches,
    assert_left_padding_matches,
    assert_prefill_decode_matches,
    assert_save_load_roundtrip,
)

VOCAB = 61
# The Triton kernel runs compiled on CUDA, in the CPU interpreter (TRITON_INTERPRET=1, set by conftest) elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")




def tiny_config(**overrides) -> RattentionConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, window_size=3, pad_token_id=0,
    )
    settings.update(overrides)
    return RattentionConfig(**settings)


def tiny_model(**overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(**overrides)).eval()
    randomize_norms(model)
    return model


@torch.no_grad()
def randomize_norms(module):
    """Norm scales start at 1; random ones make a swapped or missing norm visible."""
    for name, param in module.named_parameters():
        if "norm" in name and param.dim() == 2:
            param.uniform_(0.5, 1.5)


# ---------------------------------------------------------------- the local layer against the paper


def naive_local_layer(layer: RattentionLocalAttention, x: torch.Tensor) -> torch.Tensor:
    """Sec. 3 one query at a time: explicit window softmax, explicit sum over the residual tokens."""
    batch, seq, _ = x.shape
    heads, kv_heads, dim, w = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.window_size
    group = heads // kv_heads
    q = layer.q_proj(x).view(batch, seq, heads, dim)
    k = layer.k_proj(x).view(batch, seq, kv_heads, dim)
    v = layer.v_proj(x).view(batch, seq, kv_heads, dim)

    def rms(vec, weight, eps):
        return vec * torch.rsqrt(vec.pow(2).mean() + eps) * weight

    def rope(vec, position):
        inv_freq = 1.0 / (layer.rotary.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angle = position * torch.cat([inv_freq, inv_freq])
        first, second = vec.chunk(2)
        return vec * angle.cos() + torch.cat([-second, first]) * angle.sin()

    out = torch.zeros(batch, seq, heads, dim)
    for b in range(batch):
        for t in range(seq):
            for h in range(heads):
                g = h // group
                total = torch.zeros(dim)
                if layer.use_swa:
                    qs = rope(rms(q[b, t, h], layer.q_norm.weight[h], layer.q_norm.eps), t)
                    window = range(max(0, t - w), t + 1)
                    keys = [rope(rms(k[b, j, g], layer.k_norm.weight[g], layer.k_norm.eps), j) for j in window]
                    scores = torch.stack([qs @ key for key in keys]) * dim**-0.5
                    o_swa = torch.softmax(scores, 0) @ v[b, list(window), g]
                    total = total + rms(o_swa, layer.swa_norm.weight[h], 1e-8)
                if layer.use_rla:
                    phi_q = feature_map_fn(q[b, t, h], layer.feature_map)
                    o_rla = torch.zeros(dim)
                    for j in range(0, t - w):  # j <= t - w - 1
                        o_rla = o_rla + (phi_q @ feature_map_fn(k[b, j, g], layer.feature_map)) * v[b, j, g]
                    total = total + rms(o_rla, layer.rla_norm.weight[h], 1e-8)
                out[b, t, h] = total
    return layer.o_proj(out.reshape(batch, seq, heads * dim))


@pytest.mark.parametrize(
    "w,kv_heads,feature_map,use_rla",
    [(3, 2, "softmax", True), (0, 1, "softmax", True), (-1, 2, "relu", True), (5, 4, "identity", True), (2, 2, "softmax", False)],
)
def test_local_layer_equals_naive_equations(w, kv_heads, feature_map, use_rla):
    torch.manual_seed(1)
    layer = RattentionLocalAttention(32, 4, kv_heads, 8, w, feature_map=feature_map, use_rla=use_rla, backend="reference")
    randomize_norms(layer)
    x = torch.randn(2, 11, 32)
    context = SequenceContext.build(2, 11, 0, None, None, x.device)
    with torch.no_grad():
        ours = layer(x, context)
        naive = naive_local_layer(layer, x)
    assert (ours - naive).abs().max() < 1e-4


def test_window_covering_the_sequence_is_swa_plus_an_exact_zero_rla_term():
    """w >= T: the RLA reads an empty state, o_rla == 0 exactly, and the local layer's output is
    bit-identical to the same weights' SWA-only layer."""
    torch.manual_seed(2)
    seq, w = 13, 12
    layer = RattentionLocalAttention(32, 2, 1, 16, w, backend="auto")  # head_dim 16: the Triton kernel runs too
    swa_only = RattentionLocalAttention(32, 2, 1, 16, w, use_rla=False, backend="auto")
    randomize_norms(layer)
    swa_only.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(2, seq, 32)
    context = SequenceContext.build(2, seq, 0, None, None, x.device)
    with torch.no_grad():
        q, k, v = layer.project(x)
        backends = ("chunked", "reference") + (("triton",) if DEVICE == "cuda" or triton_interpreting() else ())
        for backend in backends:
            device = DEVICE if backend == "triton" else "cpu"
            o_rla, state = residual_linear_attention(q.to(device), k.to(device), v.to(device), w, backend=backend)
            assert torch.count_nonzero(o_rla) == 0 and torch.count_nonzero(state) == 0, backend
        assert torch.equal(layer(x, context), swa_only(x, context))


@needs_triton
def test_triton_backend_model_matches_chunked_forward_and_backward():
    """The whole model with the Triton RLA kernel (CPU interpreter or CUDA) and flex SWA == the PyTorch path."""
    ids = torch.randint(1, VOCAB, (2, 21), device=DEVICE)
    results = []
    for backend in ("chunked", "triton"):
        model = tiny_model(num_hidden_layers=2, layer_types=["local", "global"], num_attention_heads=2,
                           num_key_value_heads=1, window_size=4, kernel_backend=backend).to(DEVICE)
        with torch.no_grad():
            logits = model(ids).logits
        model.train()
        if DEVICE == "cpu":  # flex_attention has no CPU backward: the gradient check runs the SWA through SDPA
            for layer in model.model.layers:
                if isinstance(layer.self_attn, RattentionLocalAttention):
                    layer.self_attn._swa_backend = lambda: "sdpa"
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits, loss.detach(), grads))
    (l1, loss1, g1), (l2, loss2, g2) = results
    assert (l1 - l2).abs().max() < 1e-4 and torch.allclose(loss1, loss2, atol=1e-5)
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-5, rtol=1e-4), name


# ---------------------------------------------------------------- cache exactness


@pytest.mark.parametrize(
    "name,overrides,seq",
    [
        ("w3_gqa", {}, 19),
        ("w0_self_only_window", {"window_size": 0}, 13),
        ("w_minus1_pure_linear", {"window_size": -1, "feature_map": "relu"}, 14),
        ("window_longer_than_prompt", {"window_size": 30}, 15),
        ("swa_only_baseline", {"use_residual_linear_attention": False}, 12),
        ("mha_identity", {"num_key_value_heads": 4, "feature_map": "identity"}, 12),
    ],
)
def test_prefill_plus_decode_equals_full_forward(name, overrides, seq):
    model = tiny_model(**overrides)
    ids = torch.randint(1, VOCAB, (2, seq))
    for prefill in (1, 3, 4, 5, seq - 3):  # before, at and after the window boundary (w + 1 = 4)
        assert_prefill_decode_matches(model, ids, prefill)


def test_decode_with_full_window_writes_the_ring_in_place():
    """Once the window is full a decode step overwrites the leaving token's slot (no new buffers,
    no host-side slot value), and the logits still equal the full forward's."""
    model = tiny_model(num_hidden_layers=2, layer_types=["local", "global"])
    ids = torch.randint(1, VOCAB, (2, 14))
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :6], use_cache=True).past_key_values
        local = cache.layers[0]
        assert local.is_full() and int(local.ring_slot()) == 6 % 4
        buffers = [t.data_ptr() for t in (local.keys, local.values, local.raw_keys)]
        for t in range(6, 14):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
            assert [t_.data_ptr() for t_ in (local.keys, local.values, local.raw_keys)] == buffers
    keys, values, raw, _ = local.window()  # oldest first: the raw keys of tokens 10..13
    assert int(local.ring_slot()) == 14 % 4 and local.get_seq_length() == 14
    k_raw = model.model.layers[0].self_attn.k_proj(model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)))
    torch.testing.assert_close(raw, k_raw[:, 10:].view_as(raw), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_ring_decode_matches_full_forward_and_replays_in_a_cuda_graph():
    """On CUDA (Triton decode kernel, in-place state): ring decoding == the full forward, and one
    local-layer decode step captured in a CUDA graph advances the ring like the eager step."""
    model = tiny_model(hidden_size=64, num_hidden_layers=2, layer_types=["local", "global"], window_size=7).cuda()
    ids = torch.randint(1, VOCAB, (2, 40), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :20], use_cache=True).past_key_values
        for t in range(20, 40):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full[:, t], rtol=1e-4, atol=1e-4)

        layer = model.model.layers[0].self_attn
        x = torch.randn(2, 1, layer.q_proj.in_features, device="cuda")
        context = SequenceContext.build(2, 1, 20, None, None, torch.device("cuda"))
        eager_cache, warm_cache, graph_cache = (model(ids[:, :20], use_cache=True).past_key_values.layers[0] for _ in range(3))
        eager = [layer(x, context, eager_cache) for _ in range(3)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS / Triton state for this stream)
            layer(x, context, warm_cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step; nothing runs until replay
            out = layer(x, context, graph_cache)
        for expected in eager:
            graph.replay()
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_equals_full_forward():
    model = tiny_model(num_hidden_layers=4)
    ids = torch.randint(1, VOCAB, (2, 30))
    assert_chunked_prefill_matches(model, ids, [2, 7, 1, 5, 1, 1])


def test_local_cache_bytes_are_constant_in_sequence_length():
    """Local layers hold w + 1 window tokens + the RLA state at T = 1K and at T = 8K alike;
    the global layer grows with T."""
    model = tiny_model(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, layer_types=["local", "global"], window_size=63)
    ids = torch.randint(1, VOCAB, (1, 8192))
    sizes = {}
    with torch.no_grad():
        out = model(ids[:, :1024], use_cache=True)
        cache = out.past_key_values
        sizes[1024] = cache.nbytes_per_layer()
        for start in range(1024, 8192, 1024):  # the remaining 7K tokens as a chunked prefill
            cache = model(ids[:, start : start + 1024], past_key_values=cache, use_cache=True).past_key_values
        sizes[8192] = cache.nbytes_per_layer()
    local = cache.layers[0]
    assert isinstance(cache, RattentionCache) and isinstance(local, RattentionLocalLayerCache)
    assert local.get_seq_length() == 8192 and local.values.shape == (1, 64, 1, 8)
    window = 3 * 64 * 1 * 8 * 4  # SWA keys, values and raw keys of the last w + 1 tokens, fp32
    state = 1 * 16 * 8 * 4  # [kv_heads, 2 * head_dim, head_dim] float32
    assert sizes[1024][0] == sizes[8192][0] == window + state
    assert sizes[8192][1] == 8 * sizes[1024][1] == 2 * 8192 * 8 * 4


# ---------------------------------------------------------------- generation


def test_left_padded_batch_generation_equals_per_row():
    model = tiny_model()
    prompts = [[5, 9, 3, 7, 2, 8, 4, 6, 1, 3, 9], [4, 4, 7], [8, 2, 6, 5, 5, 1, 7]]
    assert_left_padding_matches(model, prompts, pad_token_id=0, max_new_tokens=7)


def test_left_padded_batch_with_pure_linear_local_layers():
    model = tiny_model(window_size=-1)
    assert_left_padding_matches(model, [[5, 9, 3, 7, 2, 8], [4, 4]], pad_token_id=0, max_new_tokens=5)


def test_generate_uses_rattention_cache_and_matches_uncached_greedy():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert isinstance(cached.past_key_values, RattentionCache)
    assert torch.equal(cached.sequences, uncached)


def test_beam_search_reorders_the_cache():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, early_stopping=True)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


# ---------------------------------------------------------------- HF integration


def test_auto_config_for_model_builds_a_working_tiny_model():
    config = AutoConfig.for_model("rattention", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, intermediate_size=128)
    assert isinstance(config, RattentionConfig) and config.window_size == 512
    assert config.layer_types == ["local", "local", "local", "global"] and config.num_key_value_heads == 4
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "RattentionForCausalLM"
    ids = torch.randint(0, VOCAB, (1, 20))
    loss = model(ids, labels=ids).loss
    loss.backward()
    local = model.model.layers[0].self_attn
    assert torch.isfinite(loss) and local.rla_norm.weight.grad is not None and local.swa_norm.weight.grad is not None


def test_save_and_reload_in_another_process_is_bit_exact(tmp_path):
    model = tiny_model()
    assert_save_load_roundtrip(model, tmp_path, torch.randint(1, VOCAB, (2, 13)), "RattentionForCausalLM")


def test_gradient_checkpointing_gives_same_gradients():
    model = tiny_model(num_hidden_layers=2, layer_types=["local", "global"])
    assert_gradient_checkpointing_matches(model, torch.randint(1, VOCAB, (2, 11)))


def test_global_layer_is_causal_attention_without_rope():
    """Shifting every position changes nothing in a global layer (no positional embedding)."""
    torch.manual_seed(3)
    layer = RattentionGlobalAttention(32, 4, 2, 8)
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        a = layer(x, SequenceContext.build(1, 9, 0, None, None, x.device))
        b = layer(x, SequenceContext.build(1, 9, 0, None, torch.arange(100, 109)[None], x.device))
        c = layer(x[:, :5], SequenceContext.build(1, 5, 0, None, None, x.device))
    assert torch.equal(a, b) and torch.allclose(a[:, :5], c, atol=1e-6)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("window_size", {"window_size": -2}),
        ("window_size", {"window_size": -1, "use_residual_linear_attention": False}),
        ("feature_map", {"feature_map": "elu"}),
        ("layer_types", {"layer_types": ["local", "full_attention"]}),
        ("layer_types", {"layer_types": ["local"]}),
        ("num_key_value_heads", {"num_key_value_heads": 3}),
        ("kernel_backend", {"kernel_backend": "cuda"}),
        ("head_dim", {"head_dim": 7}),
    ],
)
def test_invalid_configs_name_the_field(field, kwargs):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    base.update(kwargs)
    assert_config_error(RattentionConfig, field, **base)


def test_crop_is_refused_with_a_reason():
    model = tiny_model()
    with torch.no_grad():
        cache = model(torch.randint(1, VOCAB, (1, 6)), use_cache=True).past_key_values
    # Crops need the past recorded (generate() does it for assisted decoding: tests/test_assisted_decoding.py).
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.layers[0].crop(3)
