"""peft without target_modules: `get_peft_model(model, LoraConfig(r=8))` picks our default targets
for every model type (hf_hybrid.peft.PEFT_TARGET_MODULES), trains, and the adapter saves / reloads."""
from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LNTuningConfig, LoHaConfig, LoraConfig, PeftModel, TaskType, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import hf_hybrid  # noqa: F401  (registers the architectures and the peft defaults)
from hf_hybrid.models.registry import architecture_classes
from test_heads import MODEL_TYPES, ROWS, padded, tiny_config

# What each architecture's adapters must wrap, written out (not read from hf_hybrid): the
# attention projections and the mixer's own full-width projections, per layer of the tiny models.
EXPECTED_TARGETS = {
    "rat": {  # layer 0 is RAT, layer 1 sliding-window attention
        "layers.0.self_attn": ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "z_proj"],
        "layers.1.self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    },
    "rat_plus": {f"layers.{i}.self_attn": ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "z_proj"] for i in (0, 1)},
    "fox": {f"layers.{i}.self_attn": ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"] for i in (0, 1)},  # Pro block
    "rattention": {f"layers.{i}.self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"] for i in (0, 1)},
    "se_hybrid": {  # layer 0 is Mamba-2, layer 1 attention
        "layers.0.self_attn": ["in_proj", "out_proj"],
        "layers.1.self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"],
    },
}


def tiny_lm(model_type: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type))


def eval_loss(model, ids, mask, labels) -> float:
    model.eval()  # fixed computation (SE's training draws a chunk size, RAT+ trains two patterns)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


def test_every_architecture_has_defaults():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora_defaults

    assert set(EXPECTED_TARGETS) == set(MODEL_TYPES)
    for model_type in MODEL_TYPES:
        architecture_classes(model_type)  # a registered architecture
        assert model_type in lora_defaults


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_without_target_modules_trains_and_reloads(model_type, tmp_path):
    model = tiny_lm(model_type)
    peft_model = get_peft_model(model, LoraConfig(r=8, task_type=TaskType.CAUSAL_LM))

    wrapped = {name.removeprefix("base_model.model.model.") for name, module in peft_model.named_modules()
               if isinstance(module, LoraLayer)}
    expected = {f"{layer}.{proj}" for layer, projs in EXPECTED_TARGETS[model_type].items() for proj in projs}
    assert wrapped == expected
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)

    ids, mask = padded(ROWS)
    labels = ids.masked_fill(mask == 0, -100)
    before = eval_loss(peft_model, ids, mask, labels)
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()
    after = eval_loss(peft_model, ids, mask, labels)
    assert after != before, "one LoRA step did not change the loss"

    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask).logits
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_lm(model_type), tmp_path).eval()
    assert sorted(reloaded.peft_config["default"].target_modules) == sorted(
        {proj for projs in EXPECTED_TARGETS[model_type].values() for proj in projs})
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, logits, rtol=0, atol=1e-6)


def test_lora_sequence_classifier_trains_the_score_head():
    """task_type SEQ_CLS: peft adds the head ("score") to modules_to_save; adapters go to our defaults."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("fox", num_labels=3))
    peft_model = get_peft_model(model, LoraConfig(r=8, task_type=TaskType.SEQ_CLS))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert any("score" in name for name in trainable) and any("lora_A" in name and "q_proj" in name for name in trainable)
    ids, mask = padded(ROWS)
    out = peft_model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 2]))
    out.loss.backward()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if p.requires_grad and "lora_B" in n)


@pytest.mark.parametrize("method_config, trained, wrapped_suffixes", [
    (LoHaConfig(r=4), "hada_", ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj")),
    (IA3Config(), "ia3_l", ("k_proj", "v_proj", "down_proj")),
    (LNTuningConfig(), "norm", ("input_layernorm", "post_attention_layernorm", "norm")),
], ids=["loha", "ia3", "ln_tuning"])
@pytest.mark.filterwarnings("ignore:Unsupported layer type:UserWarning")  # LN tuning names only torch's LayerNorm
def test_other_peft_methods_find_defaults(method_config, trained, wrapped_suffixes):
    """peft's other tables (LoHa shares LoRA's targets; IA3 and LN tuning have their own) know our model types."""
    model = tiny_lm("se_hybrid")
    peft_model = get_peft_model(model, method_config)
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(trained in name for name in trainable), trainable
    assert set(peft_model.peft_config["default"].target_modules) == set(wrapped_suffixes)
    ids, mask = padded(ROWS)
    with torch.no_grad():
        assert torch.isfinite(peft_model(input_ids=ids, attention_mask=mask).logits).all()
