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
from hf_hybrid.architectures import ARCHITECTURES, TINY_SHAPE

VOCAB = TINY_SHAPE["vocab_size"]
PAD = TINY_SHAPE["pad_token_id"]

# The dilated pattern RAT+ is meant to be served with (stored as the config's default, so every
# entry point, pipeline() included, uses it without a per-call keyword).
RAT_PLUS_SPARSE = {"dilation": 4, "local_window": 2, "num_sink_tokens": 1}

# Variants of an architecture's tiny fixture (hf_hybrid/architectures.py), tested beside or instead
# of it: name -> (model_type, settings on top of the fixture's, or a function of the layer count).
_VARIANTS = {
    "rat": ("rat", {}),
    "rat_swa": ("rat", lambda n: dict(layer_types=hf_hybrid.RatConfig.hybrid_layer_types(n, "rat"))),
    "rat_plus": ("rat_plus", {}),
    "rat_plus_sparse": ("rat_plus", dict(sparse_config=RAT_PLUS_SPARSE)),
    "fox_llama": ("fox", dict(block_type="llama")),
    "fox_pro": ("fox", dict(block_type="pro")),
}
_NAMES = {arch.model_type: arch for arch in ARCHITECTURES}


def _variants_of(model_type: str) -> list[str]:
    return [name for name, (of, _) in _VARIANTS.items() if of == model_type] or [model_type]


# Every registered architecture, through its variants where it has some; every one mixes its layer kinds.
MODEL_TYPES = tuple(name for arch in ARCHITECTURES for name in _variants_of(arch.model_type))


def tiny_config(name: str, num_hidden_layers: int = 2, **overrides):
    model_type, settings = _VARIANTS.get(name, (name, {}))
    arch = _NAMES[model_type]
    settings = settings(num_hidden_layers) if callable(settings) else settings
    config_class = arch.load(arch.config_class_name)
    return config_class(**(arch.tiny_config_kwargs(num_hidden_layers) | settings | overrides))


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
