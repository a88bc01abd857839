"""Model outputs and input checks, for every architecture (base model and ForCausalLM):

* ``output_hidden_states``: embeddings + every layer's output, the last one after the final norm
  (transformers' Llama layout), from the keyword or ``config.output_hidden_states``;
* ``output_attentions``: attention probabilities of softmax layers run with the eager
  implementation, None for layers without them (Bamba / Jamba style);
* ``return_dict=False`` (keyword or config) gives ``ModelOutput.to_tuple()``, also for the task
  heads and RAT+'s joint objective;
* bad input (wrong rank, no tokens) raises a ValueError naming the argument, in forward and generate().
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid import FoxConfig, RatConfig, RatPlusConfig, RattentionConfig, SEHybridConfig
from hf_hybrid.layers.attention import SoftmaxAttention
from hf_hybrid.layers.residual_linear_attention import RattentionGlobalAttention
from hf_hybrid.layers.span_expanded_attention import SpanExpandedAttention

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, pad_token_id=0)

CONFIGS = {
    "rat_swa": lambda: RatConfig(
        **COMMON, num_hidden_layers=3, num_key_value_heads=2, chunk_size=4, sliding_window=3,
        layer_types=["rat", "sliding_attention", "full_attention"],
    ),
    "rat_plus": lambda: RatPlusConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, training_dilations=[1, 8]),
    "fox": lambda: FoxConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, kernel_backend="reference"),
    "rattention": lambda: RattentionConfig(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, window_size=3, layer_types=["local", "global"]
    ),
    "se_hybrid": lambda: SEHybridConfig(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, layer_types=["mamba", "attention"], mamba_d_head=16,
        mamba_d_state=8, mamba_chunk_size=8, attention_mode="full", se_chunk_sizes=[8], se_eval_chunk_size=8,
        se_block_size=2, se_top_k=2, se_select_every=4, sliding_window=6,
    ),
}
# Layers with a plain softmax form (they report probabilities under eager attention).
SOFTMAX_LAYERS = (SoftmaxAttention, RattentionGlobalAttention, SpanExpandedAttention)


def build(name: str, auto=AutoModelForCausalLM, **config_overrides):
    config = CONFIGS[name]()
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return auto.from_config(config, attn_implementation="eager").eval()


def ids_and_mask(batch: int = 2, seq: int = 9):
    ids = torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 is left-padded
    return ids, mask


def layer_outputs(model, ids, mask) -> list[torch.Tensor]:
    """Each decoder layer's output, caught with forward hooks (what hidden_states must hold)."""
    base = model.model if hasattr(model, "lm_head") else model
    caught = []
    handles = [layer.register_forward_hook(lambda m, a, out: caught.append(out)) for layer in base.layers]
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return caught


# ---------------------------------------------------------------- hidden states


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=["base", "causal_lm"])
def test_hidden_states_are_embeddings_then_every_layer_then_the_final_norm(name, auto):
    model = build(name, auto)
    ids, mask = ids_and_mask()
    base = model.model if hasattr(model, "lm_head") else model
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    layers = layer_outputs(model, ids, mask)
    hidden = out.hidden_states
    assert isinstance(hidden, tuple) and len(hidden) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(hidden[0], base.embed_tokens(ids))
    for i in range(1, len(hidden) - 1):
        torch.testing.assert_close(hidden[i], layers[i - 1])
    torch.testing.assert_close(hidden[-1], base.norm(layers[-1]))
    if hasattr(model, "lm_head"):
        torch.testing.assert_close(model.lm_head(hidden[-1]), out.logits)
    else:
        torch.testing.assert_close(hidden[-1], out.last_hidden_state)
    with torch.no_grad():
        assert model(ids, attention_mask=mask).hidden_states is None  # off by default


@pytest.mark.parametrize("name", ["rat_swa", "se_hybrid"])
def test_config_defaults_switch_outputs_on(name):
    model = build(name, output_hidden_states=True)
    model.config.output_attentions = True  # allowed: the model runs eager attention
    ids, mask = ids_and_mask()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        assert len(out.attentions) == model.config.num_hidden_layers
        off = model(ids, attention_mask=mask, output_hidden_states=False, output_attentions=False)
    assert off.hidden_states is None and off.attentions is None


def test_outputs_are_the_same_under_gradient_checkpointing():
    model = build("rat_swa").train()
    ids, mask = ids_and_mask()
    kwargs = dict(attention_mask=mask, labels=ids, output_hidden_states=True, output_attentions=True)
    plain = model(ids, **kwargs)
    model.gradient_checkpointing_enable()
    checkpointed = model(ids, **kwargs)
    checkpointed.loss.backward()  # the recomputation records nothing new into the returned outputs
    for a, b in zip(plain.hidden_states + plain.attentions[1:], checkpointed.hidden_states + checkpointed.attentions[1:]):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- attentions


@pytest.mark.parametrize("name", list(CONFIGS))
def test_attentions_hold_softmax_probabilities_and_none_elsewhere(name):
    model = build(name)
    ids, mask = ids_and_mask()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == model.config.num_hidden_layers
    batch, seq = ids.shape
    for layer, probs in zip(model.model.layers, out.attentions):
        if not isinstance(layer.self_attn, SOFTMAX_LAYERS):
            assert probs is None
            continue
        heads = model.config.num_attention_heads
        assert probs.shape == (batch, heads, seq, seq)
        torch.testing.assert_close(probs.sum(-1), torch.ones(batch, heads, seq))
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        assert probs[..., future].abs().max() == 0  # causal
        assert probs[0, :, 3:, :3].abs().max() == 0  # row 0's padding is never attended to by its tokens
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None:
            too_far = torch.ones(seq, seq, dtype=torch.bool).tril(-window)
            assert probs[1][:, too_far].abs().max() == 0


def test_attentions_of_a_decode_step_cover_the_cached_keys():
    model = build("rattention")
    ids, _ = ids_and_mask(seq=8)
    with torch.no_grad():
        cache = model(ids[:, :7], use_cache=True).past_key_values
        step = model(ids[:, 7:], past_key_values=cache, use_cache=True, output_attentions=True)
    assert step.attentions[0] is None and step.attentions[1].shape == (2, 4, 1, 8)


def test_attentions_need_eager_and_say_so(caplog):
    from transformers.utils import logging

    logging.warning_once.cache_clear()  # the warning is emitted once per process
    config = CONFIGS["rat_swa"]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    assert out.attentions == (None, None, None)
    assert "set_attn_implementation('eager')" in caplog.text
    model.set_attn_implementation("eager")  # read by the layers at the next call
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
    assert out.attentions[0] is None and out.attentions[1] is not None and out.attentions[2] is not None


# ---------------------------------------------------------------- return_dict


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=["base", "causal_lm"])
def test_return_dict_false_gives_the_output_tuple(name, auto):
    model = build(name, auto)
    ids, mask = ids_and_mask()
    with torch.no_grad():
        as_dict = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        as_tuple = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False, return_dict=False)
    assert type(as_tuple) is tuple and len(as_tuple) == len(as_dict.to_tuple()) == 2
    torch.testing.assert_close(as_tuple[0], as_dict[0])  # logits / last_hidden_state
    torch.testing.assert_close(as_tuple[1], as_dict.hidden_states)
    model.config.return_dict = False  # the config's default, for the model and its backbone
    with torch.no_grad():
        from_config = model(ids, attention_mask=mask, use_cache=False)
        explicit = model(ids, attention_mask=mask, use_cache=False, return_dict=True)
    assert type(from_config) is tuple and len(from_config) == 1
    torch.testing.assert_close(from_config[0], explicit[0])


def test_return_dict_false_with_labels_puts_the_loss_first():
    model = build("rat_swa")
    ids, mask = ids_and_mask()
    with torch.no_grad():
        loss, logits = model(ids, attention_mask=mask, labels=ids, use_cache=False, return_dict=False)
        out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
    torch.testing.assert_close(loss, out.loss)
    torch.testing.assert_close(logits, out.logits)


def test_task_head_runs_with_return_dict_false_in_the_config():
    """A task head's backbone is called from inside the head's forward: it returns a ModelOutput
    whatever config.return_dict says, and the head applies it to its own output."""
    from hf_hybrid.models.rat import modeling_rat

    head_class = getattr(modeling_rat, "RatForSequenceClassification", None)
    if head_class is None:
        pytest.skip("no task heads in this tree")
    config = CONFIGS["rat_swa"]()
    config.num_labels, config.return_dict = 3, False
    torch.manual_seed(0)
    model = head_class(config).eval()
    ids, mask = ids_and_mask()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        reference = model(ids, attention_mask=mask, return_dict=True)
    assert type(out) is tuple
    torch.testing.assert_close(out[0], reference.logits)


def test_rat_plus_joint_objective_keeps_pattern_losses_and_outputs():
    model = build("rat_plus").train()
    ids, mask = ids_and_mask()
    out = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True)
    assert out.pattern_losses.shape == (2,) and len(out.hidden_states) == 3
    loss, logits, hidden, pattern_losses = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True, return_dict=False)
    torch.testing.assert_close(loss, out.loss)
    torch.testing.assert_close(pattern_losses, out.pattern_losses)
    model.eval()
    with torch.no_grad():
        single = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True, use_cache=False)
    assert single.pattern_losses is None and len(single.hidden_states) == 3


def test_se_hybrid_per_call_mode_keeps_outputs():
    model = build("se_hybrid")
    ids, mask = ids_and_mask()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, attention_mode="se", output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3
    assert out.attentions == (None, None)  # se mode has no plain softmax form


def test_generate_returns_hidden_states_and_attentions_per_step():
    model = build("rat_swa")
    ids, mask = ids_and_mask(seq=5)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
        output_hidden_states=True, output_attentions=True, pad_token_id=0,
    )
    assert len(out.hidden_states) == 3 and len(out.hidden_states[0]) == 4
    # Decode step 1 (6 keys so far): the sliding layer's cache holds its window (3), the full layer all 6.
    assert out.attentions[1][1].shape == (2, 4, 1, 3) and out.attentions[1][2].shape == (2, 4, 1, 6)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=["base", "causal_lm"])
def test_bad_input_shapes_name_the_argument_and_the_fix(name, auto):
    model = build(name, auto)
    ids, _ = ids_and_mask()
    cases = [
        (dict(input_ids=ids[0]), r"input_ids must be a 2-D \[batch, seq\].*input_ids\[None\]"),
        (dict(input_ids=ids[None]), r"input_ids must be a 2-D \[batch, seq\]"),
        (dict(input_ids=ids[:, :0]), r"input_ids has shape \(2, 0\).*at least one token"),
        (dict(input_ids=ids[:0]), r"input_ids has shape \(0, 9\)"),
        (dict(inputs_embeds=torch.randn(9, 32)), r"inputs_embeds must be a 3-D \[batch, seq, hidden_size=32\].*inputs_embeds\[None\]"),
        (dict(inputs_embeds=torch.randn(2, 9, 16)), r"inputs_embeds must be a 3-D.*got shape \(2, 9, 16\)"),
        (dict(inputs_embeds=torch.randn(2, 0, 32)), r"inputs_embeds has shape \(2, 0, 32\).*at least one token"),
        (dict(), r"exactly one of input_ids or inputs_embeds"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message), torch.no_grad():
            model(**kwargs)


@pytest.mark.parametrize("name", ["rat_swa", "rat_plus", "se_hybrid"])
def test_generate_rejects_empty_and_wrong_rank_prompts_with_our_message(name):
    model = build(name)
    ids, _ = ids_and_mask()
    with pytest.raises(ValueError, match=r"generate\(\): input_ids has shape \(2, 0\).*at least one token"):
        model.generate(ids[:, :0], max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"generate\(\): inputs_embeds has shape \(2, 0, 32\)"):
        model.generate(inputs_embeds=torch.randn(2, 0, 32), max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match=r"input_ids must be a 2-D"):
        model.generate(ids[0], max_new_tokens=2, pad_token_id=0)


def test_generate_from_embeddings_still_works():
    model = build("rat_swa")
    ids, _ = ids_and_mask(seq=4)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    out = model.generate(inputs_embeds=embeds, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 2)
