"""RAT / RAT-SWA / attention baselines: the properties each family must show."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid
from hf_hybrid import RatCache, RatConfig
from hf_hybrid.layers.context import SequenceContext
from hf_hybrid.layers.rat_attention import RatAttention
from model_checks import (
    assert_chunked_prefill_matches,
    assert_config_error,
    assert_gradient_checkpointing_matches,
    assert_left_padding_matches,
    assert_prefill_decode_matches,
    assert_save_load_roundtrip,
)

VOCAB = 61


def tiny_config(**overrides) -> RatConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        chunk_size=4, sliding_window=6, pad_token_id=0,
    )
    settings.update(overrides)
    return RatConfig(**settings)


def tiny_model(**overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(**overrides)).eval()


# ---------------------------------------------------------------- the layer against Eq. (3)


def naive_rat_layer(layer: RatAttention, x: torch.Tensor) -> torch.Tensor:
    """RAT written straight from Eq. (3), one token at a time (no scan, no masks, no merges)."""
    batch, seq, _ = x.shape
    heads, dim, L, groups = layer.num_heads, layer.head_dim, layer.chunk_size, layer.num_qk_groups
    q_groups = layer.q_proj(x).view(batch, seq, groups, dim)
    k_groups = layer.k_proj(x).view(batch, seq, groups, dim)
    v = layer.v_proj(x).view(batch, seq, heads, dim)
    g = torch.sigmoid(layer.g_proj(x) + layer.gate_bias).view(batch, seq, heads, dim)
    z = torch.sigmoid(layer.z_proj(x)).view(batch, seq, heads, dim)

    def rope(vec, position):  # rotate-half RoPE of one [dim] vector at an integer position
        if layer.rotary is None:
            return vec
        inv_freq = 1.0 / (layer.rotary.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angle = position * torch.cat([inv_freq, inv_freq])
        first, second = vec.chunk(2)
        return vec * angle.cos() + torch.cat([-second, first]) * angle.sin()

    out = torch.zeros(batch, seq, heads, dim)
    for b in range(batch):
        for h in range(heads):
            group = h % groups
            k_tilde = torch.zeros(seq, dim)
            v_tilde = torch.zeros(seq, dim)
            for t in range(seq):  # intra-chunk RNN, restarting at every chunk
                prev_k = k_tilde[t - 1] if t % L else torch.zeros(dim)
                prev_v = v_tilde[t - 1] if t % L else torch.zeros(dim)
                k_tilde[t] = g[b, t, h] * prev_k + (1 - g[b, t, h]) * k_groups[b, t, group]
                v_tilde[t] = g[b, t, h] * prev_v + (1 - g[b, t, h]) * v[b, t, h]
            for t in range(seq):  # inter-chunk attention: earlier chunk ends + own key
                c = t // L
                query = rope(q_groups[b, t, group], c)
                keys = [rope(k_tilde[(i + 1) * L - 1], i) for i in range(c)] + [rope(k_tilde[t], c)]
                values = [v_tilde[(i + 1) * L - 1] for i in range(c)] + [v_tilde[t]]
                scores = torch.stack([query @ key for key in keys]) * dim**-0.5
                out[b, t, h] = torch.softmax(scores, dim=0) @ torch.stack(values)
    return layer.o_proj((z * out).reshape(batch, seq, heads * dim))


@pytest.mark.parametrize("chunk_size,seq,groups,use_rope", [(4, 11, 2, True), (4, 12, 1, True), (1, 7, 2, True), (16, 9, 2, True), (3, 10, 4, False)])
def test_rat_layer_equals_naive_equation_3(chunk_size, seq, groups, use_rope):
    torch.manual_seed(1)
    layer = RatAttention(32, 4, 8, chunk_size, groups, 10000.0 if use_rope else None, backend="reference")
    layer.reset_extra_parameters()
    x = torch.randn(2, seq, 32)
    context = SequenceContext.build(2, seq, 0, None, None, x.device)
    with torch.no_grad():
        ours = layer(x, context)
        naive = naive_rat_layer(layer, x)
    assert (ours - naive).abs().max() < 1e-5


def test_gate_bias_init_follows_official_code():
    layer = RatAttention(32, 4, 8, chunk_size=16)
    layer.reset_extra_parameters()
    u = layer.gate_bias.exp()
    assert u.min() >= 1.0 - 1e-5 and u.max() <= 15.0 + 1e-4 and u.std() > 0.5


# ---------------------------------------------------------------- cache exactness


@pytest.mark.parametrize(
    "name,overrides,seq",
    [
        ("rat_multiple_of_L", {}, 24),
        ("rat_not_multiple_of_L", {}, 23),
        ("rat_swa", {"num_hidden_layers": 4, "layer_types": RatConfig.hybrid_layer_types(4, "rat")}, 21),
        ("attention_swa", {"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}, 17),
        ("L1_attention_like", {"chunk_size": 1}, 13),
        ("LT_rnn_like", {"chunk_size": 64}, 19),
        ("nope_one_qk_group", {"use_rope": False, "num_qk_groups": 1}, 15),
    ],
)
def test_prefill_plus_decode_equals_full_forward(name, overrides, seq):
    model = tiny_model(**overrides)
    ids = torch.randint(1, VOCAB, (2, seq))
    for prefill in (1, 5, 8, seq - 3):  # mid-chunk and chunk-aligned prefixes
        assert_prefill_decode_matches(model, ids, prefill)


def test_chunked_prefill_equals_full_forward():
    model = tiny_model(num_hidden_layers=4, layer_types=RatConfig.hybrid_layer_types(4, "rat"))
    ids = torch.randint(1, VOCAB, (2, 29))
    assert_chunked_prefill_matches(model, ids, [6, 3, 1, 7, 1])


def test_cache_holds_one_entry_per_completed_chunk_at_4k():
    model = tiny_model(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16, chunk_size=16)
    ids = torch.randint(1, VOCAB, (1, 4096))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layer_cache = cache.layers[0]
    assert isinstance(cache, RatCache)
    assert layer_cache.num_entries == 256 and layer_cache.keys.shape == (1, 256, 2, 8)
    per_entry = 2 * 2 * 8 * 4  # keys + values, 2 heads x 8 dims, fp32
    assert cache.nbytes_per_layer()[0] == 256 * per_entry + 2 * 2 * 8 * 4


# ---------------------------------------------------------------- generation


def test_left_padded_batch_generation_equals_per_row():
    model = tiny_model(num_hidden_layers=4, layer_types=RatConfig.hybrid_layer_types(4, "rat"))
    prompts = [[5, 9, 3, 7, 2, 8, 4, 6, 1, 3, 9], [4, 4, 7], [8, 2, 6, 5, 5, 1, 7]]
    assert_left_padding_matches(model, prompts, pad_token_id=0, max_new_tokens=7)


def test_generate_uses_rat_cache_and_matches_uncached_greedy():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
    assert isinstance(cached.past_key_values, RatCache)
    assert torch.equal(cached.sequences, uncached)


def test_beam_search_reorders_the_cache():
    model = tiny_model(num_hidden_layers=2, layer_types=["rat", "sliding_attention"])
    ids = torch.randint(1, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, early_stopping=True)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_sampling_runs_with_cache():
    model = tiny_model()
    torch.manual_seed(3)
    out = model.generate(torch.randint(1, VOCAB, (2, 5)), max_new_tokens=5, do_sample=True, top_k=10)
    assert out.shape == (2, 10)


# ---------------------------------------------------------------- HF integration


def test_auto_config_for_model_builds_a_working_tiny_model():
    config = AutoConfig.for_model("rat", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128)
    assert isinstance(config, RatConfig) and config.chunk_size == 16 and config.num_qk_groups == 2
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "RatForCausalLM"
    ids = torch.randint(0, VOCAB, (1, 20))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[0].self_attn.gate_bias.grad is not None


def test_save_and_reload_in_another_process_is_bit_exact(tmp_path):
    model = tiny_model(num_hidden_layers=3, layer_types=["rat", "sliding_attention", "full_attention"])
    assert_save_load_roundtrip(model, tmp_path, torch.randint(1, VOCAB, (2, 13)), "RatForCausalLM")


def test_gradient_checkpointing_gives_same_gradients():
    model = tiny_model(num_hidden_layers=2, layer_types=["rat", "sliding_attention"])
    assert_gradient_checkpointing_matches(model, torch.randint(1, VOCAB, (2, 11)))


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("chunk_size", {"chunk_size": 0}),
        ("layer_types", {"layer_types": ["rat", "mamba"]}),
        ("layer_types", {"layer_types": ["rat"]}),
        ("num_attention_heads", {"hidden_size": 30, "num_attention_heads": 4}),
        ("num_qk_groups", {"num_qk_groups": 3}),
        ("num_key_value_heads", {"num_key_value_heads": 3}),
        ("sliding_window", {"sliding_window": 0}),
    ],
)
def test_invalid_configs_name_the_field(field, kwargs):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    base.update(kwargs)
    assert_config_error(RatConfig, field, **base)


def test_bad_inputs_get_clear_errors():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="RatCache"):
        from transformers import DynamicCache

        model(ids, past_key_values=DynamicCache(), use_cache=True)
    with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
        model()


# ---------------------------------------------------------------- GPU: Triton path inside the model


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_cuda_model_triton_path_matches_reference_and_decodes(dtype, tolerance):
    model = tiny_model(
        hidden_size=128, num_attention_heads=4, intermediate_size=256, num_hidden_layers=2,
        layer_types=["rat", "sliding_attention"], chunk_size=16, sliding_window=40,
    ).cuda().to(dtype)
    rat_layers = [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, RatAttention)]
    ids = torch.randint(1, VOCAB, (2, 203), device="cuda")
    labels = ids.clone()

    def loss_and_grads():
        model.zero_grad()
        out = model(ids, labels=labels)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    fast_logits, fast_grads = loss_and_grads()
    for layer in rat_layers:
        layer.backend = "reference"
    ref_logits, ref_grads = loss_and_grads()
    for layer in rat_layers:
        layer.backend = "auto"
    assert _relative_error(fast_logits, ref_logits) < tolerance
    for name in ref_grads:
        assert _relative_error(fast_grads[name], ref_grads[name]) < 5 * tolerance, name
    model.eval()
    full, cached = __import__("model_checks").full_vs_cached_logits(model, ids[:, :60], [1] * 23)
    assert _relative_error(cached, full) < tolerance
    generated = model.generate(ids[:, :50], max_new_tokens=20, do_sample=False)
    assert generated.shape == (2, 70)


@pytest.mark.skipif(not torch.cuda.is_available() and not hf_hybrid.kernels._backend.triton_interpreting(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seq", [21, pytest.param(32, marks=pytest.mark.slow)])  # 32: ~25 s interpreted
def test_fused_gates_layer_equals_op_by_op_layer(seq):
    """fused_gates=True (one kernel for gate, both recurrences and RoPE of k~) computes the same
    layer output and the same gradients of the input and of every weight, gate bias included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    plain = RatAttention(32, 4, 16, 8, num_qk_groups=2, backend="triton").to(device)
    plain.reset_extra_parameters()
    fused = RatAttention(32, 4, 16, 8, num_qk_groups=2, backend="triton", fused_gates=True).to(device)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, seq, 32, device=device)
    context = SequenceContext.build(2, seq, 0, None, None, torch.device(device))
    results = []
    for layer in (plain, fused):
        leaf = x.clone().requires_grad_()
        out = layer(leaf, context)
        grads = torch.autograd.grad(out, [leaf] + list(layer.parameters()), torch.ones_like(out))
        results.append((out, grads))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(plain.named_parameters(), grads_a[1:], grads_b[1:]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(grads_b[0], grads_a[0], rtol=1e-4, atol=1e-5)


def test_decode_steps_keep_the_cache_buffers_in_place():
    """Unpadded decoding writes each token's k~ / v~ into its own chunk's slot of fixed buffers
    (reserved ahead) and updates the recurrent state in place: the step reads no host value and
    allocates nothing, and the logits still equal the full forward's."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 19))
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :6], use_cache=True).past_key_values
        layer_cache = cache.layers[0]
        layer_cache.reserve(19, chunk_size=4)
        pointers = [t.data_ptr() for t in (layer_cache._key_buffer, layer_cache._value_buffer, layer_cache.state_key)]
        for t in range(6, 19):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            torch.testing.assert_close(step.logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        assert [t.data_ptr() for t in (layer_cache._key_buffer, layer_cache._value_buffer, layer_cache.state_key)] == pointers
    assert layer_cache.num_entries == 19 // 4  # completed chunks only


def test_fused_decode_buffers_are_cut_to_the_reserved_slots():
    """The one-kernel step plans its splits over the buffers it is handed: after reserve(), the
    same cut (the reserved slots, not the doubled buffer behind them) at every step, so a captured
    step replays one plan; without a reservation, the slots up to the token's own chunk."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layer_cache = cache.layers[0]
    keys, *_ = layer_cache.fused_decode_buffers(4)
    assert keys.shape[1] == 9 // 4 + 1  # token 9 opens chunk 2: slots 0 .. 2
    layer_cache.reserve(16, chunk_size=4)
    assert layer_cache._key_buffer.shape[1] > 16 // 4 + 1  # grown by doubling: 3 -> 6 slots for 5
    cuts = {layer_cache.fused_decode_buffers(4)[0].shape[1] for _ in range(6)}
    assert cuts == {16 // 4 + 1}
    assert layer_cache.fused_decode_buffers(4)[0].data_ptr() == layer_cache._key_buffer.data_ptr()


@pytest.mark.parametrize("overrides", [{}, pytest.param({"use_rope": False, "num_qk_groups": 1}, marks=pytest.mark.slow)])
def test_one_kernel_decode_step_decodes_like_the_full_forward(monkeypatch, overrides):
    """kernel_backend='triton' (Triton's interpreter on CPU): every decode step runs the one-kernel
    path (kernels/chunk_attention/rat_decode_triton.py), and its logits equal the full forward's."""
    from hf_hybrid.kernels.chunk_attention import rat_decode_triton

    calls = []
    original = rat_decode_triton.rat_decode_step_triton
    monkeypatch.setattr(rat_decode_triton, "rat_decode_step_triton", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    model = tiny_model(hidden_size=64, num_attention_heads=4, kernel_backend="triton", **overrides)
    ids = torch.randint(1, VOCAB, (2, 13))
    assert_prefill_decode_matches(model, ids, 6)
    assert len(calls) == 7 * 2  # 7 decode steps x 2 RAT layers


# mid-chunk, at a chunk end (slow: ~20 s each interpreted), past several chunks
@pytest.mark.parametrize("prefill", [pytest.param(5, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow), 13])
def test_prefill_into_an_empty_cache_runs_the_fused_kernels(monkeypatch, prefill):
    """kernel_backend='triton': a prefill into an empty cache takes the fused keys/values and
    block-end kernels of the cache-less forward; the op-by-op recurrence runs only over the last
    (open) chunk, for the state decoding continues from, and prefill + decode equal the full forward."""
    from hf_hybrid.layers import rat_attention

    block_end, recurrence_lengths = [], []
    real_block_end, real_recurrences = rat_attention.block_end_attention, rat_attention.RatAttention._recurrences
    monkeypatch.setattr(rat_attention, "block_end_attention", lambda *a, **kw: block_end.append(1) or real_block_end(*a, **kw))
    monkeypatch.setattr(rat_attention.RatAttention, "_recurrences",
                        lambda self, k, *a: recurrence_lengths.append(k.shape[1]) or real_recurrences(self, k, *a))
    model = tiny_model(hidden_size=64, num_attention_heads=4, kernel_backend="triton")
    ids = torch.randint(1, VOCAB, (2, 17))
    with torch.no_grad():
        model(ids[:, :prefill], use_cache=True)
    assert len(block_end) == 2 and recurrence_lengths == [(prefill - 1) % 4 + 1] * 2  # two RAT layers
    assert_prefill_decode_matches(model, ids, prefill)


@pytest.mark.gpu
def test_gpu_decode_step_replays_in_a_cuda_graph():
    """A RAT layer's decode step captured once in a CUDA graph advances the recurrent state and
    the chunk-end buffers like the eager step (Triton decode kernel, fixed buffers)."""
    model = tiny_model(hidden_size=64, layer_types=["rat", "rat"]).cuda()
    ids = torch.randint(1, VOCAB, (2, 21), device="cuda")
    layer = model.model.layers[0].self_attn
    x = torch.randn(2, 1, 64, device="cuda")
    context = SequenceContext.build(2, 1, 21, None, None, torch.device("cuda"))
    with torch.no_grad():
        caches = []
        for _ in range(3):
            layer_cache = model(ids, use_cache=True).past_key_values.layers[0]
            layer_cache.reserve(64, chunk_size=4)
            caches.append(layer_cache)
        eager_cache, warm_cache, graph_cache = caches
        eager = [layer(x, context, eager_cache) for _ in range(3)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x, context, warm_cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, context, graph_cache)
        for expected in eager:
            graph.replay()
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
