"""What `hf-hybrid demo` trains: sizes, contestants (with their inference variants) and the data.

Kept apart from the loop in :mod:`hf_hybrid.demo` (its __init__) so that the list of models and the task geometry
can be read (and changed) in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from ..architectures import ARCHITECTURES
from ..data.language import LANGUAGE_PRESETS, SyntheticLanguage, make_language_dataset
from ..data.recall import IGNORE_INDEX, RecallVocab, make_mqar_dataset
from ..layers.forgetting_attention import forget_bias_init
from ..sparse import SparseInferenceConfig


@dataclass(frozen=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    steps: int  # optimiser steps; even steps see recall batches, odd steps language batches
    batch_size: int
    num_pairs: int  # MQAR key-value pairs (every pair is queried)
    recall_keys: int  # distinct key (and value) tokens
    noise_length: int  # tokens between the pairs and the queries: longer than `window` on purpose
    document_length: int  # synthetic-language documents
    window: int  # RAT-SWA sliding window and RATTENTION local window
    eval_examples: int
    eval_documents: int
    learning_rate: float = 3e-3


SIZES = {
    # seconds: checks that every step runs, the numbers mean nothing
    "smoke": DemoSize(hidden_size=32, num_layers=2, steps=4, batch_size=4, num_pairs=4, recall_keys=16, noise_length=12,
                      document_length=32, window=4, eval_examples=8, eval_documents=4),
    # the default: about 3 minutes on 2 CPU cores
    "tiny": DemoSize(hidden_size=64, num_layers=2, steps=400, batch_size=32, num_pairs=4, recall_keys=16, noise_length=16,
                     document_length=64, window=8, eval_examples=256, eval_documents=32),
    # for a GPU (--device cuda): wider, deeper, longer, harder recall
    "small": DemoSize(hidden_size=256, num_layers=4, steps=4000, batch_size=64, num_pairs=16, recall_keys=64, noise_length=64,
                      document_length=256, window=32, eval_examples=1024, eval_documents=128, learning_rate=1e-3),
}


@dataclass(frozen=True)
class DecodeSetting:
    """Where the decode column is measured: generate() of ``new_tokens`` after a ``context``-token
    prompt for ``batch`` rows; throughput counts the tokens after the first (prefill excluded)."""

    batch: int
    context: int
    new_tokens: int


# The decode column is measured on the GPU only (used whenever one is present, whatever --device
# trains on), at a context long enough for the cache to matter: Llama's grows to 4K tokens per row
# and generate() reads all of it every step, the efficient caches stay a fraction of it. On a CPU the
# prompt would have to stay short (prefilling the quadratic reference paths of 11 rows takes minutes),
# so the figure would show per-step Python overhead, not the cache, and it swings with the machine's
# load from one run to the next: the demo leaves the column out there.
DECODE_GPU = DecodeSetting(batch=64, context=4000, new_tokens=64)


def decode_setting() -> DecodeSetting | None:
    """The decode column's setting on the GPU, or None on a machine without one (no column)."""
    return DECODE_GPU if torch.cuda.is_available() else None


@dataclass(frozen=True)
class Variant:
    """One table row: a trained model evaluated with these forward / generate keywords."""

    name: str
    forward_kwargs: dict = field(default_factory=dict)

    def describe(self) -> dict:
        """JSON-friendly form of the keywords (SparseInferenceConfig -> its dict)."""
        return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in self.forward_kwargs.items()}


@dataclass(frozen=True)
class Contestant:
    """One trained model. ``key`` selects it with --only; ``variants`` are its rows (default: one, no keywords)."""

    key: str
    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)
    variants: tuple[Variant, ...] = ()
    prepare: Callable | None = None  # applied to the freshly built model, before training


    @property
    def rows(self) -> tuple[Variant, ...]:
        return self.variants or (Variant(self.name),)


@torch.no_grad()
def open_forget_gates(model) -> None:
    """FoX's data-dependent forget gate starts with bias 0, i.e. f = 0.5: a token 20 positions back
    weighs 2^-20, and a few hundred steps do not open the gates far enough to reach the stored
    pairs (recall stays at chance). The demo starts the biases at the paper's T_min..T_max
    timescale schedule (2..256 tokens across heads, Appendix D's init of the fixed gates) instead."""
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.f_proj.bias.copy_(forget_bias_init(attn.num_heads, attn.t_min, attn.t_max))


def _architecture_contestants(size: DemoSize) -> dict[str, list[Contestant]]:
    """model_type -> its contestants (the first one's key is the architecture's ``demo_key``)."""
    w = size.window
    se_chunk = size.document_length // 2  # two SE chunks (several memory blocks) per language document
    dilations = (1, 2, 4)
    return {
        "rat": [
            Contestant("rat", "RAT(L=4)", "rat", {"chunk_size": 4}),
            Contestant("rat_swa", f"RAT-SWA(L=4,W={w})", "rat",
                       {"chunk_size": 4, "layer_types": "rat+sliding_attention", "sliding_window": w}),
        ],
        # One dense-trained RAT+ (joint objective D=1 and D=4), evaluated at several dilations per call.
        # D=2 is not in the training objective: its row shows a pattern between the trained ones.
        "rat_plus": [
            Contestant("rat_plus", "RAT+", "rat_plus", {"training_dilations": [1, 4]},
                       tuple(Variant(f"RAT+ D={d}", {"sparse_config": SparseInferenceConfig(dilation=d)}) for d in dilations)),
        ],
        "fox": [
            Contestant("fox", "FoX (llama)", "fox", {"block_type": "llama"}, prepare=open_forget_gates),
            Contestant("fox_pro", "FoX (pro)", "fox", {"block_type": "pro"}, prepare=open_forget_gates),
        ],
        "rattention": [
            Contestant("rattention", f"RATTENTION(W={w})", "rattention", {"window_size": w, "layer_types": "local+global"}),
        ],
        # Trained with full attention (how the paper's Mamba-2 hybrids are pre-trained; SE-Attn is its
        # long-context fine-tuning recipe) and evaluated both ways: `se` (chunks + top-k memory blocks)
        # and `full`. Trained with `se` from scratch, both rows come out lower at this budget.
        "se_hybrid": [
            Contestant("se_hybrid", "SE-hybrid", "se_hybrid",
                       {"layer_types": "mamba+attention", "attention_mode": "full", "se_chunk_sizes": [se_chunk // 2, se_chunk],
                        "se_block_size": 4, "se_top_k": 2, "se_select_every": se_chunk // 4,
                        "mamba_d_head": size.hidden_size // 4, "mamba_d_state": 16, "mamba_chunk_size": 16},
                       (Variant("SE-hybrid (se)", {"attention_mode": "se"}), Variant("SE-hybrid (full)", {"attention_mode": "full"}))),
        ],
    }


def default_contestants(size: DemoSize) -> list[Contestant]:
    """transformers' Llama (the dense-attention baseline), then every architecture of
    hf_hybrid/architectures.py in its order."""
    by_type = _architecture_contestants(size)
    missing = [arch.model_type for arch in ARCHITECTURES if arch.model_type not in by_type]
    if missing:
        raise KeyError(f"the demo has no contestant for architecture(s) {missing}: add them to _architecture_contestants.")
    return [Contestant("llama", "Llama", "llama")] + [c for arch in ARCHITECTURES for c in by_type[arch.model_type]]


def select(contestants: list[Contestant], only: str | None) -> list[Contestant]:
    """The contestants named in a comma-separated --only list (keys, e.g. "llama,rat_plus")."""
    if not only:
        return contestants
    wanted = [key.strip() for key in only.split(",") if key.strip()]
    known = {c.key for c in contestants}
    unknown = [key for key in wanted if key not in known]
    if unknown:
        raise ValueError(f"--only: unknown contestant(s) {unknown}; choose from {sorted(known)}.")
    return [c for c in contestants if c.key in wanted]


def build_config(contestant: Contestant, size: DemoSize, vocab_size: int):
    overrides = dict(contestant.overrides)
    layer_types = overrides.pop("layer_types", None)
    if layer_types is not None:  # "a+b" alternates a and b layer by layer
        kinds = layer_types.split("+")
        overrides["layer_types"] = [kinds[i % len(kinds)] for i in range(size.num_layers)]
    return AutoConfig.for_model(
        contestant.model_type,
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.hidden_size * 2,
        num_hidden_layers=size.num_layers,
        num_attention_heads=4,
        max_position_embeddings=4096,  # the KV-cache column prefills 4K tokens
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )


@dataclass
class DemoData:
    """Both tasks in one vocabulary: language ids first, recall ids shifted past them.

    Disjoint ids let one model learn both tasks without the recall keys aliasing language words;
    the special ids (pad 0, bos 1, sep 2 = the language's eos) are shared.
    """

    language: SyntheticLanguage
    vocab_size: int
    recall_train: dict  # input_ids, labels: [N, T] tensors
    recall_eval: dict
    language_train: torch.Tensor  # [N, T] documents (labels = inputs)
    language_eval: torch.Tensor


def make_data(size: DemoSize, seed: int = 0) -> DemoData:
    language = LANGUAGE_PRESETS["small"]
    recall_vocab = RecallVocab(num_keys=size.recall_keys, num_values=size.recall_keys, num_noise=16)
    offset = language.vocab_size - recall_vocab.first_key

    def recall(n: int, s: int) -> dict:
        rows = make_mqar_dataset(n, size.num_pairs, size.num_pairs, size.noise_length, recall_vocab, seed=s).with_format("torch")[:]
        shift = lambda t: torch.where(t >= recall_vocab.first_key, t + offset, t)
        return {"input_ids": shift(rows["input_ids"]), "labels": torch.where(rows["labels"] == IGNORE_INDEX, rows["labels"], shift(rows["labels"]))}

    def documents(n: int, s: int) -> torch.Tensor:
        return torch.tensor(make_language_dataset(n, size.document_length, language, seed=s)["input_ids"])

    # About one pass over fresh examples per task, capped so that generating stays within seconds.
    pool = min(max(64, size.steps * size.batch_size // 2), 16384)
    parts = {
        "recall_train": lambda: recall(pool, seed),
        "recall_eval": lambda: recall(size.eval_examples, seed + 1),
        "language_train": lambda: documents(pool, seed),
        "language_eval": lambda: documents(size.eval_documents, seed + 1),
    }
    made = {name: make() for name, make in tqdm(parts.items(), desc="generate data", leave=False)}
    return DemoData(language=language, vocab_size=recall_vocab.size + offset, **made)
