"""Tiny CPU configs of every model type hf-hybrid ships, for tests that run the same check on all.

``MODEL_TYPES`` names each variant; ``tiny_config(name, num_hidden_layers=2, **overrides)`` builds
its config and ``tiny_model(name, num_hidden_layers=2, **overrides)`` a seeded, eval-mode model
whose extra parameters (gate biases, norm scales) are drawn away from their init so a wrong wiring
shows up in the logits.
Sizes keep one forward of ~20 tokens in the millisecond range on a busy CPU.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid import FoxConfig, RatConfig, RatPlusConfig, RattentionConfig, SEHybridConfig

VOCAB = 61
PAD = 0
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, pad_token_id=PAD)

# The dilated pattern RAT+ is meant to be served with (stored as the config's default, so every
# entry point, pipeline() included, uses it without a per-call keyword).
RAT_PLUS_SPARSE = {"dilation": 4, "local_window": 2, "num_sink_tokens": 1}


def _alternate(first: str, second: str, num_layers: int) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(num_layers)]


# name -> (config class, settings for a model of n layers); every one mixes its layer kinds.
_SETTINGS = {
    "rat": lambda n: (RatConfig, dict(chunk_size=4, sliding_window=6)),
    "rat_swa": lambda n: (RatConfig, dict(chunk_size=4, sliding_window=6, layer_types=RatConfig.hybrid_layer_types(n, "rat"))),
    "rat_plus": lambda n: (RatPlusConfig, dict(num_key_value_heads=2, training_dilations=[1, 8])),
    "rat_plus_sparse": lambda n: (
        RatPlusConfig, dict(num_key_value_heads=2, training_dilations=[1, 8], sparse_config=RAT_PLUS_SPARSE)
    ),
    "fox_llama": lambda n: (FoxConfig, dict(num_key_value_heads=2, block_type="llama")),
    "fox_pro": lambda n: (FoxConfig, dict(num_key_value_heads=2, block_type="pro")),
    "rattention": lambda n: (
        RattentionConfig, dict(num_key_value_heads=2, window_size=3, layer_types=_alternate("local", "global", n))
    ),
    # SE mode with one training chunk size: training draws nothing at random, so two training
    # forwards (with and without checkpointing) see the same chunking.
    "se_hybrid": lambda n: (
        SEHybridConfig,
        dict(
            num_key_value_heads=2, layer_types=_alternate("mamba", "attention", n), mamba_d_head=16, mamba_d_state=8,
            mamba_chunk_size=8, attention_mode="se", se_chunk_sizes=[8], se_eval_chunk_size=8, se_block_size=2, se_top_k=2,
            se_select_every=4, sliding_window=6,
        ),
    ),
}

MODEL_TYPES = tuple(_SETTINGS)


def tiny_config(name: str, num_hidden_layers: int = 2, **overrides):
    config_class, settings = _SETTINGS[name](num_hidden_layers)
    return config_class(**(COMMON | {"num_hidden_layers": num_hidden_layers} | settings | overrides))


@torch.no_grad()
def _draw_extra_parameters(model) -> None:
    """Forget-gate biases spread over a range and norm scales != 1: defaults would hide swapped
    or missing pieces behind near-identical values."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if name.endswith("f_proj.bias"):
            param.copy_(torch.rand(param.shape, generator=generator) * 4.0 - 1.0)
        elif "norm" in name and name.endswith("weight"):
            param.copy_(0.5 + torch.rand(param.shape, generator=generator))


def tiny_model(name: str, num_hidden_layers: int = 2, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name, num_hidden_layers, **overrides)).eval()
    _draw_extra_parameters(model)
    return model


def random_ids(batch: int = 1, seq: int = 13, seed: int = 1) -> torch.Tensor:
    """Prompt ids from 3 on: never the pad, bos or eos id, so no prompt token reads as padding
    and a left-padded row's real tokens are exactly its prompt."""
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def three_prompts() -> list[list[int]]:
    """Prompts of different lengths (the longest crosses RAT's chunks of 4 and SE's chunk of 8)."""
    return [random_ids(1, length, seed=seed)[0].tolist() for length, seed in ((13, 3), (5, 4), (9, 5))]


def left_pad(prompts: list[list[int]], pad_token_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    return ids, mask


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built offline: ids 0-3 are <pad>, <s>, </s>,
    <unk> (the configs' pad/bos/eos ids), then the words w4 ... w60. Text is words separated by
    spaces, and decoding joins tokens with spaces again, so text and ids convert both ways exactly.
    Left padding, as decoder-only generation needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocabulary)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side="left",
    )


def words(ids) -> str:
    """The text word_tokenizer() encodes to ``ids``."""
    return " ".join(f"w{int(i)}" for i in ids)
