"""SE-Attn hybrid: the model properties it must show (cache exactness in every mode, se decoding
from block summaries, causality, conversion exactness at full) plus the shared model checks."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BambaConfig, BambaForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_hybrid  # noqa: F401  (registers se_hybrid)
from hf_hybrid.conversion.se_hybrid import convert_to_se_hybrid
from hf_hybrid.models.se_hybrid import SEAttentionLayerCache, SEHybridCache, SEHybridConfig
from model_checks import (
    assert_chunked_prefill_matches,
    assert_config_error,
    assert_gradient_checkpointing_matches,
    assert_left_padding_matches,
    assert_prefill_decode_matches,
    assert_save_load_roundtrip,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*falling back.*")

VOCAB = 61
MODES = ("full", "se", "swa", "se_nomem", "se_random")
# Tiny SE settings: chunks of 8, blocks of 2, top-2, groups of 4 -> retrieval from the 2nd chunk on.
SE = dict(se_chunk_sizes=[4, 8], se_eval_chunk_size=8, se_block_size=2, se_top_k=2, se_select_every=4, sliding_window=6)


def tiny_config(**overrides) -> SEHybridConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, pad_token_id=0, **SE,
    )
    settings.update(overrides)
    return SEHybridConfig(**settings)


def tiny_model(**overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(**overrides)).eval()


def random_ids(batch=2, seq=37, seed=1):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ config


def test_tiny_defaults_build_through_auto_config():
    config = AutoConfig.for_model(
        "se_hybrid", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128
    )
    assert config.layer_types == ["mamba", "attention", "mamba", "mamba"]
    assert (config.attention_mode, config.se_chunk_sizes, config.se_block_size, config.se_top_k) == ("full", [2048, 4096], 32, 8)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "SEHybridForCausalLM"
    assert model(random_ids(1, 9)).logits.shape == (1, 9, VOCAB)


def test_layer_type_aliases_are_accepted_and_stored_as_ours():
    config = tiny_config(layer_types=["linear_attention", "full_attention", "mamba", "attention"])
    assert config.layer_types == ["mamba", "attention", "mamba", "attention"]
    assert SEHybridConfig.from_dict(config.to_dict()).layer_types == config.layer_types


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("attention_mode", dict(attention_mode="dense")),
        ("se_select_every", dict(se_chunk_sizes=[6], se_select_every=4)),
        ("se_chunk_sizes", dict(se_chunk_sizes=[])),
        ("se_block_size", dict(se_block_size=0)),
        ("se_top_k", dict(se_top_k=-1)),
        ("layer_types", dict(layer_types=["mamba", "rat", "mamba", "mamba"])),
        ("layer_types", dict(layer_types=["mamba"] * 4)),
        ("mamba_d_head", dict(mamba_d_head=24)),
        ("partial_rotary_factor", dict(partial_rotary_factor=1.5)),
        ("num_key_value_heads", dict(num_key_value_heads=3)),
    ],
)
def test_config_errors_name_the_field(field, overrides):
    assert_config_error(SEHybridConfig, field, **(tiny_config().to_dict() | overrides))


def test_uses_transformers_mamba2_mixer():
    from transformers.models.bamba.modeling_bamba import BambaMixer

    model = tiny_model()
    mixers = [layer.self_attn for layer in model.model.layers]
    assert isinstance(mixers[0], BambaMixer) and hasattr(mixers[0], "conv1d")
    assert type(mixers[1]).__name__ == "SpanExpandedAttention"


# ------------------------------------------------------------------------------------ cache


@pytest.mark.parametrize("mode", MODES)
def test_prefill_then_decode_matches_full_forward(mode):
    model = tiny_model()
    ids = random_ids()
    assert_prefill_decode_matches(model, ids, prefill_length=21, attention_mode=mode)
    assert_chunked_prefill_matches(model, ids, [5, 3, 1, 7, 1], attention_mode=mode)


def test_se_decodes_from_block_summaries():
    """Token-by-token from the first token: every se retrieval comes from summaries the cache built
    incrementally, and the result is se's own full forward (not full attention's, not se_nomem's)."""
    model = tiny_model()
    ids = random_ids(seq=33)
    assert_prefill_decode_matches(model, ids, prefill_length=1, attention_mode="se")
    with torch.no_grad():
        se = model(ids, attention_mode="se").logits
        nomem = model(ids, attention_mode="se_nomem").logits
        full = model(ids, attention_mode="full").logits
    assert (se - nomem)[:, 8:].abs().max() > 1e-3 and (se - full)[:, 8:].abs().max() > 1e-3
    torch.testing.assert_close(se[:, :8], nomem[:, :8])  # the first chunk has nothing to retrieve
    cache = SEHybridCache(model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, attention_mode="se")
    layer = cache.layers[1]
    assert isinstance(layer, SEAttentionLayerCache)
    state = layer.row_state(0)
    assert state.length == 33 and state.summaries.shape == (16, 4, 8) and state.open_queries.shape[0] == 1


def test_retrieval_state_is_kept_in_every_mode():
    """A full-mode prefill leaves the same SE state as an se-mode prefill (layer 1, the first attention
    layer, sees mode-independent inputs), so a cache filled with full can continue with se."""
    model = tiny_model()
    ids = random_ids(seq=30)
    states = {}
    for mode in ("full", "se"):
        cache = SEHybridCache(model.config)
        with torch.no_grad():
            model(ids[:, :21], past_key_values=cache, use_cache=True, attention_mode=mode)
            model(ids[:, 21:23], past_key_values=cache, use_cache=True, attention_mode=mode)
        states[mode] = cache.layers[1].row_state(1)
        with torch.no_grad():
            out = model(ids[:, 23:], past_key_values=cache, use_cache=True, attention_mode="se").logits
        assert torch.isfinite(out).all()
    for name in ("summaries", "open_queries", "chunk_sum", "group_sum"):
        torch.testing.assert_close(getattr(states["full"], name), getattr(states["se"], name), rtol=1e-6, atol=1e-6)
    assert states["se"].length == 30 and states["se"].summaries.shape[0] == 15


def test_chunk_size_is_fixed_per_cache():
    model = tiny_model()
    cache = SEHybridCache(model.config)
    with torch.no_grad():
        model(random_ids(1, 9), past_key_values=cache, use_cache=True, attention_mode="se")
        with pytest.raises(ValueError, match="se_chunk_size"):
            model(random_ids(1, 1), past_key_values=cache, use_cache=True, attention_mode="se", se_chunk_size=4)


def test_generate_in_each_mode():
    model = tiny_model()
    prompt = random_ids(1, 12)
    for mode in MODES:
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, attention_mode=mode)
        with torch.no_grad():
            logits = model(out[:, :-1], attention_mode=mode).logits
        assert out[0, 12:].tolist() == logits[0, 11:].argmax(-1).tolist(), mode


# ------------------------------------------------------------------------------------ causality


@pytest.mark.parametrize("mode", MODES)
def test_no_position_sees_a_future_token(mode):
    model = tiny_model()
    ids = random_ids(1, 40)
    with torch.no_grad():
        base = model(ids, attention_mode=mode).logits
        for cut in (0, 5, 8, 17, 31):
            changed = ids.clone()
            changed[:, cut + 1:] = torch.randint(1, VOCAB, changed[:, cut + 1:].shape, generator=torch.Generator().manual_seed(cut))
            out = model(changed, attention_mode=mode).logits
            torch.testing.assert_close(out[:, : cut + 1], base[:, : cut + 1], rtol=0, atol=1e-6)


def test_training_draws_chunk_sizes_from_the_list():
    model = tiny_model().train()
    layer = model.model.layers[1].self_attn
    drawn = {layer._chunk_size(None, "se", cached=False) for _ in range(40)}
    assert drawn == {4, 8}
    assert layer._chunk_size(None, "full", cached=False) == 8  # full attention draws nothing
    model.eval()
    assert {layer._chunk_size(None, "se", cached=False) for _ in range(5)} == {8}
    ids = random_ids(2, 24)
    loss = model.train()(ids, labels=ids, attention_mode="se").loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ shared checks


def test_save_load_roundtrip(tmp_path):
    model = tiny_model(attention_mode="se")
    assert_save_load_roundtrip(model, tmp_path, random_ids(1, 19), expected_class="SEHybridForCausalLM")
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert "Span-Expanded Attention" in card and "mamba x" not in card


@pytest.mark.parametrize("mode", ["full", "se"])
def test_left_padding_matches(mode):
    model = tiny_model()
    prompts = [random_ids(1, 19, seed=3)[0].tolist(), random_ids(1, 10, seed=4)[0].tolist()]
    assert_left_padding_matches(model, prompts, pad_token_id=0, attention_mode=mode)


def test_gradient_checkpointing_matches():
    model = tiny_model(attention_mode="se", se_chunk_sizes=[8])
    assert_gradient_checkpointing_matches(model, random_ids(2, 20))


# ------------------------------------------------------------------------------------ conversion


def tiny_bamba():
    torch.manual_seed(0)
    config = BambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2,
    )
    model = BambaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial SSM parameters, so the comparison exercises them
        for layer in model.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.dt_bias.uniform_(-1, 1)
                layer.mamba.D.uniform_(0, 2)
                layer.mamba.norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("source", ["bamba", "llama", "llama_tied"])
def test_conversion_reproduces_source_logits_in_full_mode(source):
    if source == "bamba":
        original = tiny_bamba()
    else:
        torch.manual_seed(0)
        original = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, tie_word_embeddings=source == "llama_tied",
        )).eval()
    converted = convert_to_se_hybrid(original, **SE)
    assert converted.config.attention_mode == "full"
    ids = random_ids(2, 29)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
        generated = converted.generate(ids[:, :9], max_new_tokens=5, do_sample=False)
        reference = original.generate(ids[:, :9], max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, reference)
    if source == "bamba":
        assert converted.config.partial_rotary_factor == 0.5
        assert converted.config.layer_types == ["mamba", "attention", "mamba"]


def test_conversion_rejects_unsupported_models():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="cannot be converted"):
        convert_to_se_hybrid(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB)))


def test_config_attention_mode_is_read_at_call_time():
    model = tiny_model()
    ids = random_ids(1, 20)
    with torch.no_grad():
        se = model(ids, attention_mode="se").logits
        model.config.attention_mode = "se"
        torch.testing.assert_close(model(ids).logits, se)
        with pytest.raises(ValueError, match="attention_mode"):
            model(ids, attention_mode="sparse")
