"""RAT+: the layer against its equations, cache exactness for every sparse pattern, cache memory,
generate() with per-call patterns, the joint objective, HF integration and config errors."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401
from hf_hybrid.layers.context import SequenceContext
from hf_hybrid.layers.rat_plus_attention import RatPlusAttention
from hf_hybrid.models.rat_plus import RatPlusCache, RatPlusConfig
from hf_hybrid.sparse import SparseInferenceConfig as Sparse
from model_checks import (
    assert_chunked_prefill_matches,
    assert_config_error,
    assert_gradient_checkpointing_matches,
    assert_left_padding_matches,
    assert_prefill_decode_matches,
    assert_save_load_roundtrip,
)

VOCAB = 61

# Every kind of pattern the model supports, sized for sequences of ~20-40 tokens.
PATTERNS = {
    "dense": Sparse(),
    "dilated": Sparse(dilation=4),
    "dilated_window_sinks": Sparse(dilation=8, local_window=3, num_sink_tokens=2),
    "dilated_no_sinks": Sparse(dilation=4, num_sink_tokens=0),
    "quest_topk": Sparse(top_k=2, block_size=4, block_scoring="quest"),
    "moba_topk_window": Sparse(top_k=3, block_size=4, block_scoring="moba", local_window=2, num_sink_tokens=1),
    "dilation_or_topk": Sparse(dilation=8, top_k=2, block_size=4),
    "layer_hybrid": Sparse(dilation=4, layer_overrides={0: "dense"}),
    "head_hybrid": Sparse(dilation=8, head_overrides={0: "dense", 1: "dense"}),
    "head_hybrid_mixed": Sparse(dilation=4, head_overrides={1: {"top_k": 2, "block_size": 4}, 3: "dense"}),
}


def tiny_config(**overrides) -> RatPlusConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, training_dilations=[1, 8],
    )
    settings.update(overrides)
    return RatPlusConfig(**settings)


def tiny_model(**overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(**overrides)).eval()


# ---------------------------------------------------------------- the layer against its equations


def naive_rat_plus_layer(layer: RatPlusAttention, x: torch.Tensor, sparse: Sparse) -> torch.Tensor:
    """RAT+ from its equations one token at a time: recurrence loop, RoPE per vector, key sets from the
    pattern definitions (top-k blocks scored and sorted per query), one softmax per query."""
    batch, seq, _ = x.shape
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    rep = heads // kv_heads
    q = layer.q_proj(x).view(batch, seq, heads, dim)
    k = layer.k_proj(x).view(batch, seq, kv_heads, dim)
    v = layer.v_proj(x).view(batch, seq, kv_heads, dim)
    g = torch.sigmoid(layer.g_proj(x)).view(batch, seq, kv_heads, dim) if layer.use_recurrence else torch.zeros_like(k)
    z = torch.sigmoid(layer.z_proj(x)).view(batch, seq, heads, dim)

    def rope(vec, position):
        if layer.rotary is None:
            return vec
        inv_freq = 1.0 / (layer.rotary.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angle = position * torch.cat([inv_freq, inv_freq])
        first, second = vec.chunk(2)
        return vec * angle.cos() + torch.cat([-second, first]) * angle.sin()

    out = torch.zeros(batch, seq, heads, dim)
    for b in range(batch):
        k_rot = torch.zeros(seq, kv_heads, dim)
        v_tilde = torch.zeros(seq, kv_heads, dim)
        for c in range(kv_heads):
            k_state = torch.zeros(dim)
            v_state = torch.zeros(dim)
            for t in range(seq):  # full-sequence recurrence, never restarted
                k_state = g[b, t, c] * k_state + (1 - g[b, t, c]) * k[b, t, c]
                v_state = g[b, t, c] * v_state + (1 - g[b, t, c]) * v[b, t, c]
                k_rot[t, c], v_tilde[t, c] = rope(k_state, t), v_state
        for h in range(heads):
            p = sparse.pattern_for(layer.layer_idx, h)
            c = h // rep
            for i in range(seq):
                query = rope(q[b, i, h], i)
                if p.kind == "topk":
                    scored = []
                    for blk in range(i // p.block_size):
                        keys = k_rot[blk * p.block_size : (blk + 1) * p.block_size, c]
                        if p.block_scoring == "quest":
                            s = sum(max(query[d] * keys[:, d].min(), query[d] * keys[:, d].max()) for d in range(dim))
                        else:
                            s = query @ keys.mean(0)
                        scored.append((-float(s), blk))
                    chosen = {blk for _, blk in sorted(scored)[: p.top_k - 1]} | {i // p.block_size}
                    extra_dilation = p.dilation > 1
                visible = []
                for j in range(i + 1):
                    base = (j + 1) % p.dilation == 0 or i - j <= p.local_window or j < p.num_sink_tokens
                    if p.kind == "topk":
                        base = j // p.block_size in chosen or j < p.num_sink_tokens or i - j <= p.local_window or (
                            extra_dilation and (j + 1) % p.dilation == 0
                        )
                    if p.kind == "dense" or base:
                        visible.append(j)
                scores = torch.stack([query @ k_rot[j, c] for j in visible]) * dim**-0.5
                out[b, i, h] = torch.softmax(scores, 0) @ v_tilde[visible, c]
    return layer.o_proj((z * out).reshape(batch, seq, heads * dim))


@pytest.mark.parametrize("name", ["dense", "dilated_window_sinks", "quest_topk", "moba_topk_window", "dilation_or_topk", "head_hybrid_mixed"])
@pytest.mark.parametrize("use_rope,use_recurrence", [(True, True), (False, True), (True, False)])
def test_layer_equals_naive_equations(name, use_rope, use_recurrence):
    torch.manual_seed(1)
    layer = RatPlusAttention(32, 4, 2, 8, layer_idx=1, rope_theta=10000.0 if use_rope else None,
                             use_recurrence=use_recurrence, backend="reference")
    x = torch.randn(2, 19, 32)
    context = SequenceContext.build(2, 19, 0, None, None, x.device)
    with torch.no_grad():
        ours = layer(x, context, sparse_config=PATTERNS[name])
        naive = naive_rat_plus_layer(layer, x, PATTERNS[name])
    assert (ours - naive).abs().max() < 1e-5


def test_sdpa_path_equals_reference_path():
    torch.manual_seed(2)
    x = torch.randn(2, 23, 32)
    context = SequenceContext.build(2, 23, 0, None, None, x.device)
    for name in ("dense", "dilated_window_sinks", "quest_topk", "head_hybrid"):
        layer = RatPlusAttention(32, 4, 2, 8, layer_idx=0, backend="reference")
        fast = RatPlusAttention(32, 4, 2, 8, layer_idx=0, backend="auto")
        fast.load_state_dict(layer.state_dict())
        with torch.no_grad():
            diff = (layer(x, context, sparse_config=PATTERNS[name]) - fast(x, context, sparse_config=PATTERNS[name])).abs().max()
        assert diff < 1e-5, name


def test_patterns_change_the_output():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 40))
    with torch.no_grad():
        dense = model(ids).logits
        for name in ("dilated", "quest_topk", "head_hybrid"):
            assert (model(ids, sparse_config=PATTERNS[name]).logits - dense).abs().max() > 1e-3, name


# ---------------------------------------------------------------- cache exactness for every pattern


@pytest.mark.parametrize("name", list(PATTERNS))
def test_prefill_plus_decode_equals_full_forward(name):
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 30))
    for prefill in (1, 7, 16):  # before, inside and at block boundaries
        assert_prefill_decode_matches(model, ids, prefill, sparse_config=PATTERNS[name])


@pytest.mark.skipif(not torch.cuda.is_available() and not __import__("os").environ.get("TRITON_INTERPRET"),
                    reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["dilated_window_sinks", "head_hybrid_mixed"])
def test_prefill_into_an_empty_cache_runs_the_block_end_kernel(name, monkeypatch):
    """A prefill into an empty cache attends over its own keys with the block-end kernels, like the
    uncached forward: no mask over the cache's layout (at a long prompt, a dense T x T mask)."""
    import hf_hybrid.layers.rat_plus_attention as layer_module

    model = tiny_model(kernel_backend="triton", hidden_size=64)  # head_dim 16: the kernels' smallest
    masks = []
    real_mask = layer_module.dilated_mask
    monkeypatch.setattr(layer_module, "dilated_mask", lambda *a, **k: masks.append(a[0].shape) or real_mask(*a, **k))
    ids = torch.randint(1, VOCAB, (2, 37))
    with torch.no_grad():
        cached = model(ids[:, :30], use_cache=True, sparse_config=PATTERNS[name])
        assert not masks, masks
        uncached = model(ids[:, :30], use_cache=False, sparse_config=PATTERNS[name]).logits
        torch.testing.assert_close(cached.logits, uncached, atol=1e-5, rtol=0)
        step = model(ids[:, 30:31], past_key_values=cached.past_key_values, use_cache=True, sparse_config=PATTERNS[name])
        full = model(ids[:, :31], use_cache=False, sparse_config=PATTERNS[name]).logits[:, -1:]
        torch.testing.assert_close(step.logits, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["dilated_window_sinks", "moba_topk_window", "head_hybrid_mixed"])
def test_chunked_prefill_equals_full_forward(name):
    model = tiny_model(num_hidden_layers=3)
    ids = torch.randint(1, VOCAB, (2, 37))
    assert_chunked_prefill_matches(model, ids, [6, 3, 1, 9, 1, 4], sparse_config=PATTERNS[name])


def test_mha_nope_and_no_recurrence_variants_decode_exactly():
    for overrides in ({"num_key_value_heads": 4}, {"use_rope": False}, {"use_recurrence": False}):
        model = tiny_model(**overrides)
        ids = torch.randint(1, VOCAB, (2, 21))
        assert_prefill_decode_matches(model, ids, 9, sparse_config=Sparse(dilation=4, local_window=1))


@pytest.mark.parametrize("name", ["dense", "dilated_window_sinks", "quest_topk", "head_hybrid"])
def test_left_padded_batch_generation_equals_per_row(name):
    model = tiny_model()
    prompts = [[5, 9, 3, 7, 2, 8, 4, 6, 1, 3, 9, 4, 4], [4, 4, 7], [8, 2, 6, 5, 5, 1, 7]]
    assert_left_padding_matches(model, prompts, pad_token_id=0, max_new_tokens=9, sparse_config=PATTERNS[name])


# ---------------------------------------------------------------- cache memory follows the pattern


def _fill_cache(model, ids, pattern, chunk):
    cache = None
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            cache = model(ids[:, start : start + chunk], past_key_values=cache, use_cache=True, sparse_config=pattern).past_key_values
    return cache


def test_dilated_cache_bytes_at_4k_follow_T_over_D_plus_W_plus_sinks():
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                       intermediate_size=16, max_position_embeddings=4096)
    T, D, W = 4096, 16, 256
    cache = _fill_cache(model, torch.randint(1, VOCAB, (1, T)), Sparse(dilation=D, local_window=W), chunk=512)
    assert isinstance(cache, RatPlusCache)
    entry_bytes = 2 * 2 * 16 * 4  # keys + values, 2 kv heads x head_dim 16, fp32
    expected = (T // D + W + 4) * entry_bytes
    assert cache.num_entries_per_layer() == [T // D + W + 4]
    nbytes = cache.nbytes_per_layer()[0]
    assert abs(nbytes - expected) <= 0.10 * expected, (nbytes, expected)
    dense_cache = _fill_cache(model, torch.randint(1, VOCAB, (1, 1024)), Sparse(), chunk=512)
    assert dense_cache.num_entries_per_layer() == [1024]


@pytest.mark.parametrize("window, sinks", [(0, 0), (3, 2), (40, 1)])
def test_dilated_store_without_returned_keys_keeps_the_same_state(window, sinks):
    """A prefill that attends over its own keys asks the store for no keys (need_keys=False): the
    store then copies only the window's tail of the segment, and holds what it holds otherwise."""
    from hf_hybrid.models.rat_plus.cache_rat_plus import DilatedStore
    from hf_hybrid.sparse import AttentionPattern

    pattern = AttentionPattern(dilation=4, local_window=window, num_sink_tokens=sinks)
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 27, 2, 8, generator=gen), torch.randn(2, 27, 2, 8, generator=gen)
    positions = torch.arange(27).expand(2, 27)
    stores = [DilatedStore(pattern), DilatedStore(pattern)]
    assert stores[0].update(keys, values, positions, need_keys=False) is None
    assert stores[1].update(keys, values, positions) is not None
    step = (torch.randn(2, 1, 2, 8, generator=gen), torch.randn(2, 1, 2, 8, generator=gen), torch.full((2, 1), 27))
    after = [store.update(*step) for store in stores]  # the next decode step sees the same keys
    for name in DilatedStore.tensor_names:
        assert torch.equal(getattr(stores[0], name), getattr(stores[1], name)), name
    for a, b in zip(after[0][:3], after[1][:3]):
        assert torch.equal(a, b)


def test_topk_cache_keeps_all_keys_plus_block_summaries():
    model = tiny_model(num_hidden_layers=1)
    ids = torch.randint(1, VOCAB, (1, 64))
    head_dim, kv_heads = 8, 2
    for scoring, stats in (("quest", 2), ("moba", 1)):
        cache = _fill_cache(model, ids, Sparse(top_k=2, block_size=8, block_scoring=scoring), chunk=20)
        layer = cache.layers[0]
        store = layer.stores[0]
        assert layer.num_entries == 64 and store.summary.shape == (1, 8, kv_heads, stats, head_dim)
        assert bool(store.complete.all())
        kv_bytes = 2 * 64 * kv_heads * head_dim * 4
        summary_bytes = 8 * kv_heads * stats * head_dim * 4
        assert cache.nbytes_per_layer()[0] >= kv_bytes + summary_bytes


def test_head_hybrid_cache_stores_only_each_groups_kv_heads():
    model = tiny_model(num_hidden_layers=1)
    cache = _fill_cache(model, torch.randint(1, VOCAB, (1, 48)), PATTERNS["head_hybrid"], chunk=48)
    dense_store, dilated_store = cache.layers[0].stores
    assert dense_store.keys.shape[2] == 1 and dilated_store.end_keys.shape[2] == 1  # heads 0,1 -> kv 0; 2,3 -> kv 1
    assert cache.num_entries_per_layer() == [48 + (48 // 8 + 0 + 4)]


def test_switching_pattern_on_a_filled_cache_raises():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 12))
    with torch.no_grad():
        cache = model(ids, use_cache=True, sparse_config=Sparse(dilation=4)).past_key_values
        with pytest.raises(ValueError, match="sparse_config differs"):
            model(ids[:, :1], past_key_values=cache, use_cache=True, sparse_config=Sparse(dilation=8))


# ---------------------------------------------------------------- generate with per-call patterns


@pytest.mark.parametrize("name", ["dilated", "moba_topk_window", "layer_hybrid"])
def test_generate_with_sparse_config_matches_uncached(name):
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 14))
    kwargs = dict(max_new_tokens=10, do_sample=False, sparse_config=PATTERNS[name], attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        cached = model.generate(ids, return_dict_in_generate=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert isinstance(cached.past_key_values, RatPlusCache)
    assert torch.equal(cached.sequences, uncached)


def test_generate_uses_config_default_and_accepts_dicts():
    model = tiny_model(sparse_config={"dilation": 4, "local_window": 2})
    ids = torch.randint(1, VOCAB, (1, 11))
    with torch.no_grad():
        implicit = model.generate(ids, max_new_tokens=6, do_sample=False)
        explicit = model.generate(ids, max_new_tokens=6, do_sample=False, sparse_config=Sparse(dilation=4, local_window=2))
        as_dict = model.generate(ids, max_new_tokens=6, do_sample=False, sparse_config={"dilation": 4, "local_window": 2})
    assert torch.equal(implicit, explicit) and torch.equal(implicit, as_dict)


def test_beam_search_reorders_every_store():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 9))
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, sparse_config=PATTERNS["head_hybrid_mixed"])
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_bf16_sparse_forward_is_close_to_fp32():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 33))
    pattern = Sparse(dilation=4, local_window=2)
    with torch.no_grad():
        ref = model(ids, sparse_config=pattern).logits
        low = model.to(torch.bfloat16)(ids, sparse_config=pattern).logits.float()
    assert (ref - low).abs().max() < 5e-2


# ---------------------------------------------------------------- active recurrence learning


def test_joint_objective_sums_dense_and_sparse_losses():
    model = tiny_model(training_dilations=[1, 8], training_loss_weights=[1.0, 0.5])
    ids = torch.randint(1, VOCAB, (2, 24))
    model.train()
    out = model(ids, labels=ids)
    assert out.pattern_losses.shape == (2,)
    model.eval()
    with torch.no_grad():
        dense = model(ids, labels=ids, sparse_config=Sparse(num_sink_tokens=0)).loss
        sparse = model(ids, labels=ids, sparse_config=Sparse(dilation=8, num_sink_tokens=0)).loss
    torch.testing.assert_close(out.pattern_losses, torch.stack([dense, sparse]))
    torch.testing.assert_close(out.loss.detach(), dense + 0.5 * sparse)
    out.loss.backward()
    assert model.model.layers[0].self_attn.g_proj.weight.grad.abs().sum() > 0


def test_training_dilations_from_the_forward_call():
    model = tiny_model().train()
    ids = torch.randint(1, VOCAB, (2, 20))
    assert model(ids, labels=ids, training_dilations=[1]).pattern_losses.shape == (1,)
    assert model(ids, labels=ids, training_dilations=[1, 4, {"dilation": 8, "local_window": 2}]).pattern_losses.shape == (3,)
    single = model(ids, labels=ids, sparse_config=Sparse(dilation=4))  # an explicit pattern trains that pattern
    assert single.pattern_losses is None
    model.eval()
    assert model(ids, labels=ids).pattern_losses is None  # evaluation uses the inference pattern
    assert model(ids, labels=ids, training_dilations=[1, 8]).pattern_losses.shape == (2,)


def test_gradient_checkpointing_gives_same_gradients():
    assert_gradient_checkpointing_matches(tiny_model(), torch.randint(1, VOCAB, (2, 17)))


# ---------------------------------------------------------------- HF integration and errors


def test_auto_config_for_model_builds_a_working_tiny_model():
    config = AutoConfig.for_model("rat_plus", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128)
    assert isinstance(config, RatPlusConfig) and config.training_dilations == [1, 64]
    assert Sparse.from_dict(config.sparse_config) == Sparse()
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "RatPlusForCausalLM"
    ids = torch.randint(0, VOCAB, (1, 70))
    loss = model(ids, labels=ids).loss
    assert math.isfinite(loss.item())


def test_save_and_reload_in_another_process_is_bit_exact(tmp_path):
    model = tiny_model(sparse_config={"dilation": 4, "head_overrides": {"1": "dense"}}, training_dilations=[1, {"dilation": 8, "local_window": 4}])
    assert_save_load_roundtrip(model, tmp_path, torch.randint(1, VOCAB, (2, 19)), "RatPlusForCausalLM")
    reloaded = RatPlusConfig.from_pretrained(tmp_path / "ckpt")
    assert Sparse.from_dict(reloaded.sparse_config) == Sparse(dilation=4, head_overrides={1: "dense"})
    assert reloaded.training_dilations == model.config.training_dilations


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("training_dilations", {"training_dilations": []}),
        ("training_dilations", {"training_dilations": [1, 0]}),
        ("training_dilations", {"training_dilations": 64}),
        ("training_loss_weights", {"training_loss_weights": [1.0]}),
        (r"layer_overrides\[5\]", {"sparse_config": {"dilation": 4, "layer_overrides": {5: "dense"}}}),
        (r"head_overrides\[4\]", {"sparse_config": {"dilation": 4, "head_overrides": {4: "dense"}}}),
        ("top_k", {"sparse_config": {"top_k": 9, "block_size": 32}}),
        ("dilation", {"sparse_config": {"dilation": 0}}),
        ("num_key_value_heads", {"num_key_value_heads": 3}),
        ("kernel_backend", {"kernel_backend": "cuda"}),
    ],
)
def test_invalid_configs_name_the_field(field, kwargs):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
    base.update(kwargs)
    assert_config_error(RatPlusConfig, field, **base)


def test_invalid_patterns_at_call_time_name_the_field():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 8))
    with pytest.raises(ValueError, match=r"layer_overrides\[7\]"):
        model(ids, sparse_config=Sparse(dilation=4, layer_overrides={7: "dense"}))
    with pytest.raises(ValueError, match=r"top_k=65"):
        model(ids, sparse_config=Sparse(top_k=65, block_size=4))
    with pytest.raises(ValueError, match="dilation"):
        model(ids, sparse_config={"dilation": 0})
    with pytest.raises(TypeError, match="RatPlusCache"):
        from transformers import DynamicCache

        model(ids, past_key_values=DynamicCache(), use_cache=True)
