"""`hf-hybrid demo`: train tiny models on generated recall data, save, reload, generate, compare.

Every contestant goes through the same steps, so the table compares architectures fairly:
1. build from a config (AutoConfig.for_model) and train on multi-query associative recall,
2. save_pretrained, reload with AutoModelForCausalLM.from_pretrained, check identical logits,
3. measure recall accuracy (teacher forced), greedy generation of answers, decode tokens/s,
   and the real bytes of the decoding cache after a 4K-token prefill.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)

from .data.recall import RecallVocab, make_mqar_dataset
from .eval.memory import cache_nbytes_at_context
from .eval.recall import recall_accuracy


@dataclass
class Contestant:
    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    steps: int
    batch_size: int
    num_pairs: int
    noise_length: int
    eval_examples: int


SIZES = {
    "smoke": DemoSize(hidden_size=32, num_layers=2, steps=8, batch_size=8, num_pairs=4, noise_length=4, eval_examples=16),
    "tiny": DemoSize(hidden_size=64, num_layers=2, steps=300, batch_size=32, num_pairs=8, noise_length=16, eval_examples=256),
    "small": DemoSize(hidden_size=256, num_layers=4, steps=2000, batch_size=64, num_pairs=16, noise_length=64, eval_examples=1024),
}


def default_contestants() -> list[Contestant]:
    return [
        Contestant("Attention", "rat", {"layer_types": "full_attention"}),
        Contestant("RAT(L=4)", "rat", {"chunk_size": 4}),
        Contestant("RAT-SWA(L=4)", "rat", {"chunk_size": 4, "layer_types": "rat+sliding_attention", "sliding_window": 16}),
    ]


def build_config(contestant: Contestant, size: DemoSize, vocab_size: int):
    overrides = dict(contestant.overrides)
    layer_types = overrides.pop("layer_types", None)
    if layer_types is not None:  # "a+b" alternates a and b, a single name fills every layer
        kinds = layer_types.split("+")
        overrides["layer_types"] = [kinds[i % len(kinds)] for i in range(size.num_layers)]
    return AutoConfig.for_model(
        contestant.model_type,
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.hidden_size * 2,
        num_hidden_layers=size.num_layers,
        num_attention_heads=4,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )


def train(model, input_ids, labels, size: DemoSize, device, label: str, seed: int = 0) -> float:
    """AdamW with linear warm-up and cosine decay; returns the mean loss of the last 10% of steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, size.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / size.steps, 1.0)))
    )
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in tqdm(range(size.steps), desc=f"train {label}", leave=False):
        rows = torch.randint(0, input_ids.shape[0], (size.batch_size,), generator=generator)
        loss = model(input_ids[rows].to(device), labels=labels[rows].to(device), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


@torch.no_grad()
def generated_recall(model, input_ids, labels, device, examples: int = 16) -> float:
    """Greedy generate() answers the first query of each example from its prompt: fraction right."""
    answer_positions = (labels[0] != -100).nonzero().flatten()
    first = int(answer_positions[0])
    prompts = input_ids[:examples, :first].to(device)
    generated = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=1, do_sample=False, pad_token_id=0)
    return float((generated[:, -1].cpu() == labels[:examples, first]).float().mean())


@torch.no_grad()
def decode_tokens_per_second(model, device, batch_size: int = 8, prompt_length: int = 64, new_tokens: int = 32) -> float:
    prompts = torch.randint(3, model.config.vocab_size, (batch_size, prompt_length), device=device)
    kwargs = dict(attention_mask=torch.ones_like(prompts), do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(prompts, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    return batch_size * new_tokens / (time.perf_counter() - start)


def run(contestants: list[Contestant], size: DemoSize, device: str, output_dir: Path, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    vocab = RecallVocab()
    make = lambda n, s: make_mqar_dataset(n, size.num_pairs, size.num_pairs, size.noise_length, vocab, seed=s).with_format("torch")
    # dataset[:] with the torch format gives whole columns as tensors
    train_set, eval_set = make(max(512, size.steps * size.batch_size // 4), seed)[:], make(size.eval_examples, seed + 1)[:]
    results = []
    for contestant in tqdm(contestants, desc="contestants"):
        torch.manual_seed(seed)
        config = build_config(contestant, size, vocab.size)
        model = AutoModelForCausalLM.from_config(config).to(device)
        start = time.perf_counter()
        loss = train(model, train_set["input_ids"], train_set["labels"], size, device, contestant.name, seed)
        train_seconds = time.perf_counter() - start

        folder = output_dir / contestant.name.replace("(", "_").replace(")", "").replace("=", "")
        model.save_pretrained(folder)
        reloaded = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()
        probe = eval_set["input_ids"][:2].to(device)
        with torch.no_grad():
            if not torch.equal(model(probe).logits, reloaded(probe).logits):
                raise RuntimeError(f"{contestant.name}: reloaded model does not reproduce the trained one")

        results.append(
            {
                "model": contestant.name,
                "model_type": config.model_type,
                "class": type(reloaded).__name__,
                "parameters": sum(p.numel() for p in reloaded.parameters()),
                "train_loss": loss,
                "train_seconds": train_seconds,
                "recall_accuracy": recall_accuracy(reloaded, eval_set["input_ids"], eval_set["labels"]),
                "generated_recall": generated_recall(reloaded, eval_set["input_ids"], eval_set["labels"], device),
                "decode_tokens_per_s": decode_tokens_per_second(reloaded, device),
                "kv_cache_bytes_4k": cache_nbytes_at_context(reloaded, 4096),
                "saved_to": str(folder),
            }
        )
    return results


def format_table(results: list[dict]) -> str:
    columns = [
        ("model", "model", "{}"),
        ("params", "parameters", "{:,}"),
        ("loss", "train_loss", "{:.3f}"),
        ("recall acc", "recall_accuracy", "{:.1%}"),
        ("gen recall", "generated_recall", "{:.1%}"),
        ("decode tok/s", "decode_tokens_per_s", "{:,.0f}"),
        ("KV cache @4K", "kv_cache_bytes_4k", "{}"),
    ]

    def human(n: int) -> str:
        return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

    rows = [[human(r[key]) if key == "kv_cache_bytes_4k" else fmt.format(r[key]) for _, key, fmt in columns] for r in results]
    headers = [title for title, _, _ in columns]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *map(line, rows)])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="hf-hybrid demo", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model and training size (smoke = seconds)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--output-dir", type=Path, default=Path("demo_output"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda was given but no CUDA device is available; use --device cpu")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = run(default_contestants(), SIZES[args.size], args.device, args.output_dir, args.seed)
    print()
    print(format_table(results))
    (args.output_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nCheckpoints and results.json in {args.output_dir}/")
    return results
