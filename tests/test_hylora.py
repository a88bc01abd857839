"""HyLoRA through peft: exactly the intended parameters are trainable (counted from the config),
a Trainer run changes only those, adapters save / reload / merge to identical logits."""
from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    BambaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from hf_hybrid.peft import HYLORA_MODULES_TO_SAVE, HyLoraConfig, norm_names

R = 4



def tiny_bamba():
    torch.manual_seed(0)
    config = BambaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2, mamba_d_conv=4,
    )
    return BambaForCausalLM(config)


def tiny_llama(tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def expected_bamba_trainable(config, r=R) -> int:
    """HyLoRA on Bamba, counted from the config (not from the model)."""
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    lora = r * ((hidden + q_out) + 2 * (hidden + kv_out) + (q_out + hidden))  # q, k, v, o: r * (in + out)
    d_inner = config.mamba_expand * hidden
    conv_dim = d_inner + 2 * config.mamba_n_groups * config.mamba_d_state
    conv = conv_dim * config.mamba_d_conv + conv_dim  # depthwise weight + bias
    n_attn = len(config.attn_layer_indices)
    n_mamba = config.num_hidden_layers - n_attn
    embed = config.vocab_size * hidden
    norms = config.num_hidden_layers * 2 * hidden + hidden + n_mamba * d_inner  # layer norms, final, gated mixer norm
    return n_attn * lora + n_mamba * conv + embed + norms


def expected_llama_trainable(config, r=R) -> int:
    """LoRA+ (Llama has no conv1d); a tied lm_head shares the embedding's trainable copy."""
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    lora = r * ((hidden + q_out) + 2 * (hidden + kv_out) + (q_out + hidden))
    embed = config.vocab_size * hidden
    norms = config.num_hidden_layers * 2 * hidden + hidden
    return config.num_hidden_layers * lora + embed + norms


def trainable_count(model) -> int:
    seen, total = set(), 0
    for param in model.parameters():  # parameters() deduplicates tied tensors
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def trainable_kinds(model) -> set[str]:
    kinds = set()
    for name, param in model.named_parameters():
        if param.requires_grad:
            if ".lora_" in name:
                kinds.add(name.split(".lora_")[0].rsplit(".", 1)[-1])
            else:
                assert ".modules_to_save." in name, name
                kinds.add(name.split(".modules_to_save.")[0].rsplit(".", 1)[-1])
    return kinds


def test_defaults_are_the_papers():
    config = HyLoraConfig()
    assert (config.r, config.lora_alpha) == (32, 64)
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert {"embed_tokens", "conv1d", "norm", "input_layernorm"} <= set(config.modules_to_save)
    with pytest.raises(ValueError, match="r must be >= 1"):
        HyLoraConfig(r=0)


def test_bamba_exact_trainable_parameters():
    model = tiny_bamba()
    peft_model = get_peft_model(model, HyLoraConfig(r=R, lora_alpha=2 * R))
    assert trainable_count(peft_model) == expected_bamba_trainable(model.config)
    assert trainable_kinds(peft_model) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "conv1d", "norm",
        "input_layernorm", "pre_ff_layernorm", "final_layernorm",
    }
    # The SSM's own projections and recurrent parameters stay frozen (only conv1d is trained).
    for name, param in peft_model.named_parameters():
        if any(key in name for key in ("in_proj", "out_proj", "A_log", "dt_bias", "mamba.D", "feed_forward", "lm_head")):
            assert not param.requires_grad, name


@pytest.mark.parametrize("tied", [False, True])
def test_llama_gets_lora_plus(tied):
    model = tiny_llama(tied)
    peft_model = get_peft_model(model, HyLoraConfig(r=R, lora_alpha=2 * R))
    assert trainable_count(peft_model) == expected_llama_trainable(model.config)
    assert trainable_kinds(peft_model) - {"lm_head"} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "input_layernorm", "post_attention_layernorm", "norm",
    }
    if tied:  # the output projection reads the trained embedding copy
        emb = peft_model.get_input_embeddings()
        head = peft_model.get_output_embeddings()
        assert emb.weight.data_ptr() == head.weight.data_ptr()


def _dataset(vocab, n=16, seq=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=gen)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def train_a_few_steps(peft_model, tmp_path, steps=4):
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
        weight_decay=0.0, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=peft_model, args=args, train_dataset=_dataset(peft_model.config.vocab_size))
    trainer.train()
    return trainer


def run_trainer_roundtrip(base, tmp_path):
    """Train with HyLoRA, check what moved, then save / reload / merge and compare logits."""
    base.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(base, HyLoraConfig(r=R, lora_alpha=2 * R))
    before = {name: param.detach().clone() for name, param in peft_model.named_parameters()}
    train_a_few_steps(peft_model, tmp_path)
    for name, param in peft_model.named_parameters():
        if param.requires_grad:
            assert not torch.equal(param, before[name]), f"trainable {name} did not change"
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"

    ids = torch.randint(0, base.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    peft_model.eval()
    with torch.no_grad():
        trained = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained, rtol=0, atol=0)
    merged = reloaded.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, trained, rtol=1e-5, atol=1e-5)
    return trained


def test_bamba_trainer_save_reload_merge(tmp_path):
    run_trainer_roundtrip(tiny_bamba(), tmp_path)


def test_llama_tied_trainer_save_reload_merge(tmp_path):
    run_trainer_roundtrip(tiny_llama(tied=True), tmp_path)


# ---------------------------------------------------------------------------------------------- se_hybrid


def tiny_se_hybrid():
    import hf_hybrid  # noqa: F401
    from hf_hybrid.models.se_hybrid import SEHybridConfig, SEHybridForCausalLM

    torch.manual_seed(0)
    config = SEHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, attention_mode="se",
        se_chunk_sizes=[4, 8], se_block_size=2, se_top_k=2, se_select_every=4,
    )
    return SEHybridForCausalLM(config)


def expected_se_hybrid_trainable(config, r=R) -> int:
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    lora = r * ((hidden + q_out) + 2 * (hidden + kv_out) + (q_out + hidden))
    d_inner = config.mamba_expand * hidden
    conv_dim = d_inner + 2 * config.mamba_n_groups * config.mamba_d_state
    conv = conv_dim * config.mamba_d_conv + conv_dim
    n_attn = config.layer_types.count("attention")
    n_mamba = config.num_hidden_layers - n_attn
    norms = config.num_hidden_layers * 2 * hidden + hidden + n_mamba * d_inner
    return n_attn * lora + n_mamba * conv + config.vocab_size * hidden + norms


def test_se_hybrid_exact_trainable_parameters():
    model = tiny_se_hybrid()
    peft_model = get_peft_model(model, HyLoraConfig(r=R, lora_alpha=2 * R))
    assert trainable_count(peft_model) == expected_se_hybrid_trainable(model.config)
    assert trainable_kinds(peft_model) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "conv1d", "norm", "input_layernorm", "post_attention_layernorm",
    }


def test_se_hybrid_trainer_save_reload_merge(tmp_path):
    """The paper's recipe on se_hybrid: HyLoRA with SE-Attn in training (chunk size drawn per layer),
    adapters reload and merge exactly (evaluated in eval mode at the fixed chunk size)."""
    run_trainer_roundtrip(tiny_se_hybrid(), tmp_path)


@pytest.mark.slow  # the whole example end to end (2+ minutes on CPU); the HyLoRA Trainer round trip above stays in CI
def test_finetune_se_hylora_example(tmp_path):
    """examples/finetune_se_hylora.py at its tiny default: pre-train at L, HyLoRA + SE-Attn at 4L,
    evaluate with full attention; the example asserts its own outputs (see its check())."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_se_hylora.py"
    spec = importlib.util.spec_from_file_location("finetune_se_hylora", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--output-dir", str(tmp_path)])
    assert summary["finetune_length"] == 4 * summary["pretrain_length"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def _warnings_of(action) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def _tiny_se_hybrid():
    from transformers import AutoConfig

    import hf_hybrid  # noqa: F401  (registers the architectures)

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "se_hybrid", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16))


def test_hylora_defaults_warn_nothing(tmp_path):
    """Our defaults on our default (untied) models: no note from peft that nothing is tied, nor any
    other, when the adapter is made and when it is reloaded; the saved config says nothing was tied."""
    import hf_hybrid  # noqa: F401  (resolves HyLoRA's weight tying against the model)

    assert _warnings_of(HyLoraConfig) == []
    model = _tiny_se_hybrid()
    assert not model.config.tie_word_embeddings
    made = []
    caught = _warnings_of(lambda: made.append(get_peft_model(model, HyLoraConfig(r=R, lora_alpha=2 * R))))
    # transformers' FutureWarning for an attribute peft reads is neither ours nor peft's to fix here.
    assert [w for w in caught if not w.startswith("FutureWarning")] == []
    assert made[0].peft_config["default"].ensure_weight_tying is False
    made[0].save_pretrained(tmp_path)
    caught = _warnings_of(lambda: PeftModel.from_pretrained(_tiny_se_hybrid(), tmp_path))
    assert [w for w in caught if not w.startswith("FutureWarning")] == []


def test_hylora_keeps_tying_a_tied_model():
    import hf_hybrid  # noqa: F401

    peft_model = get_peft_model(tiny_llama(tied=True), HyLoraConfig(r=R, lora_alpha=2 * R))
    assert peft_model.peft_config["default"].ensure_weight_tying is True


def test_other_configs_keep_peft_notes():
    """Only HyLoRA's own default is quieted: a LoraConfig asking to tie an untied model still hears it."""
    import hf_hybrid  # noqa: F401

    model = _tiny_se_hybrid()
    config = LoraConfig(r=R, target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    caught = _warnings_of(lambda: get_peft_model(model, config))
    assert any("no tied modules were found" in w for w in caught), caught


def test_the_weight_tying_patch_names_the_peft_it_was_checked_against():
    from hf_hybrid._compat import peft_weight_tying

    assert peft_weight_tying.peft_checked("0.21.2") and peft_weight_tying.peft_checked("0.22.0")
    assert not peft_weight_tying.peft_checked("0.17.0")
    assert not peft_weight_tying.peft_checked("1.0.0")


# ------------------------------------------------------------------------------- every norm, by name


def _tiny_models():
    """tests/features/tiny_models.py: a tiny instance of each hf-hybrid model type."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "features"))
    import tiny_models

    return tiny_models


def _fully_trained(peft_model) -> set[str]:
    """Last name components of the modules peft wrapped to train in full (modules_to_save)."""
    return {name.split(".modules_to_save.")[0].rsplit(".", 1)[-1]
            for name, param in peft_model.named_parameters() if param.requires_grad and ".modules_to_save." in name}


def _tiny_transformers_hybrids():
    from transformers import JambaConfig, JambaForCausalLM, Zamba2Config, Zamba2ForCausalLM

    torch.manual_seed(0)
    yield "bamba", tiny_bamba()
    yield "llama", tiny_llama(tied=False)
    yield "jamba", JambaForCausalLM(JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=8, mamba_dt_rank=4, use_mamba_kernels=False))
    yield "zamba2", Zamba2ForCausalLM(Zamba2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"]))


def test_the_default_names_cover_every_norm_of_hf_hybrid_and_transformers_hybrids():
    """peft >= 0.22 matches modules_to_save by whole name components, so the default list must name
    each norm itself (whatever peft is installed here)."""
    tiny = _tiny_models()
    models = [(model_type, tiny.tiny_model(model_type)) for model_type in tiny.MODEL_TYPES]
    for name, model in models + list(_tiny_transformers_hybrids()):
        norms = norm_names(model)
        assert norms and norms <= set(HYLORA_MODULES_TO_SAVE), (name, norms - set(HYLORA_MODULES_TO_SAVE))


@pytest.mark.parametrize("model_type", ["rattention", "fox_pro", "se_hybrid"])
def test_every_norm_is_trained_and_nothing_else_beyond_lora(model_type):
    """Through peft as installed: each module whose name contains "norm" is wrapped and trainable."""
    model = _tiny_models().tiny_model(model_type)
    norms = norm_names(model)
    peft_model = get_peft_model(model, HyLoraConfig(r=R, lora_alpha=2 * R))
    wrapped = _fully_trained(peft_model)
    assert norms <= wrapped and wrapped - norms <= {"embed_tokens", "conv1d"}, (norms, wrapped)


def test_for_model_reads_the_norm_names_from_the_model():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_prenorm, self.proj = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.out_norm = torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8)
            self.blocks = torch.nn.ModuleList([Block()])
            self.blocks[0].q_proj = torch.nn.Linear(8, 8)

        def forward(self, ids):
            return self.out_norm(self.blocks[0].proj(self.blocks[0].attn_prenorm(self.embed_tokens(ids))))

    config = HyLoraConfig.for_model(Toy(), r=2, lora_alpha=4, task_type=None)
    assert config.modules_to_save == ["embed_tokens", "conv1d", "attn_prenorm", "out_norm"] and config.r == 2
    peft_model = get_peft_model(Toy(), config)
    wrapped = _fully_trained(peft_model)
    assert wrapped == {"embed_tokens", "attn_prenorm", "out_norm"}
    with pytest.raises(ValueError, match="modules_to_save is what it derives"):
        HyLoraConfig.for_model(Toy(), modules_to_save=["x"])
