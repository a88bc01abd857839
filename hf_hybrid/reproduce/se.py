"""Expansion Span, small scale: SW-Attn vs SE-Attn fine-tuning, LoRA vs HyLoRA, on recall beyond the window.

Mirrors the shape of Fig. 2 of "Expansion Span" (se_attn_hylora.md): (a) fine-tuning a Mamba-2 hybrid
at a longer context with SE-Attn beats SW-Attn on recall (RULER); (b) with SE-Attn, HyLoRA beats plain
LoRA. Here, per seed:

1. pre-train a tiny ``se_hybrid`` (Mamba-2 / attention, full attention) on MQAR at length L;
2. from those same weights, fine-tune the four cells {SW-Attn, SE-Attn} x {LoRA (q/k/v/o adapters),
   HyLoRA (adapters + trainable embeddings, norms and conv1d)} at length 4L, where the key-value
   pairs sit at the start and the queries at the end, beyond the attention window / chunk;
3. evaluate recall of the far needles at 4L with full attention (as the paper evaluates, App. A) and
   with the mode used in fine-tuning.

Scale gap: the paper fine-tunes a 2.7B Mamba-2-Hybrid at 8k tokens on natural language and scores
eleven RULER tasks; here a 50k (cpu) / 0.8M (gpu) parameter model learns MQAR from scratch.
"""
from __future__ import annotations

import copy
import math
import random
import time
import warnings
from pathlib import Path

import torch

from ..data.recall import RecallVocab, mqar_example
from ..eval import recall_accuracy
from .report import Reproduction

PAPER = "Expansion Span Fig. 2 (a: SE-Attn vs SW-Attn fine-tuning; b: HyLoRA vs LoRA), recall beyond the window"

PRESETS = {
    # One CPU thread, all four cells x two seeds: about 35 s including imports.
    "cpu": dict(hidden=32, heads=2, d_state=8, pretrain_length=16, pretrain_steps=250, finetune_steps=40,
                batch=16, pretrain_lr=3e-3, finetune_lr=3e-3, num_pairs=1, vocab=8, chunk_sizes=[8, 16],
                block_size=4, top_k=4, rank=8, eval_examples=64),
    # Sized for < 9 minutes on one GPU, scaled from the cpu preset's time.
    "gpu": dict(hidden=128, heads=4, d_state=32, pretrain_length=128, pretrain_steps=1200, finetune_steps=300,
                batch=32, pretrain_lr=2e-3, finetune_lr=2e-3, num_pairs=4, vocab=64, chunk_sizes=[64, 128],
                block_size=16, top_k=4, rank=16, eval_examples=512),
}
MODES = ("swa", "se")
ADAPTERS = ("lora", "hylora")
CELLS = tuple((mode, adapter) for mode in MODES for adapter in ADAPTERS)
MODE_NAMES = {"swa": "SW-Attn", "se": "SE-Attn", "full": "Full-Attn"}
ADAPTER_NAMES = {"lora": "LoRA", "hylora": "HyLoRA"}


def cell_name(mode: str, adapter: str) -> str:
    return f"{mode}+{adapter}"


def mqar_tensors(count: int, length: int, settings: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` MQAR rows of exactly ``length`` tokens: pairs first, noise, then one query per pair."""
    vocab = RecallVocab(num_keys=settings["vocab"], num_values=settings["vocab"], num_noise=settings["vocab"])
    noise = length - (4 * settings["num_pairs"] + 3)
    if noise < 0:
        raise ValueError(f"pretrain_length: {length} tokens cannot hold {settings['num_pairs']} pairs and queries; raise it.")
    rng = random.Random(seed)
    rows = [mqar_example(rng, vocab, settings["num_pairs"], settings["num_pairs"], noise) for _ in range(count)]
    return torch.tensor([r["input_ids"] for r in rows]), torch.tensor([r["labels"] for r in rows])


def build_model(settings: dict, seed: int):
    from ..models.se_hybrid import SEHybridConfig, SEHybridForCausalLM

    vocab = RecallVocab(num_keys=settings["vocab"], num_values=settings["vocab"], num_noise=settings["vocab"])
    hidden, chunks = settings["hidden"], list(settings["chunk_sizes"])
    config = SEHybridConfig(
        vocab_size=vocab.size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        num_attention_heads=settings["heads"], mamba_d_head=hidden // 4, mamba_d_state=settings["d_state"],
        mamba_chunk_size=16, layer_types=["mamba", "attention", "mamba", "attention"], attention_mode="full",
        se_chunk_sizes=chunks, se_block_size=settings["block_size"], se_top_k=settings["top_k"],
        se_select_every=min(chunks) // 2, sliding_window=max(chunks), pad_token_id=vocab.pad,
        max_position_embeddings=4 * settings["pretrain_length"],
    )
    torch.manual_seed(seed)
    return SEHybridForCausalLM(config)


def train(model, ids: torch.Tensor, labels: torch.Tensor, steps: int, batch: int, lr: float, device) -> list[float]:
    """AdamW, 10% warmup then cosine to 0, grad clip 1; only parameters with requires_grad."""
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    losses = []
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        loss = model(input_ids=ids[rows].to(device), labels=labels[rows].to(device), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def adapter_config(adapter: str, rank: int):
    """Plain LoRA on q/k/v/o, or HyLoRA (the same adapters + trainable embeddings, norms, conv1d)."""
    from peft import LoraConfig

    from ..peft import HYLORA_TARGET_MODULES, HyLoraConfig

    if adapter == "hylora":
        return HyLoraConfig(r=rank, lora_alpha=2 * rank)
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(HYLORA_TARGET_MODULES))


def run_seed(settings: dict, seed: int, device) -> dict:
    """Pre-train once, then fine-tune and evaluate the four cells from the same weights."""
    from peft import get_peft_model

    short, long = settings["pretrain_length"], 4 * settings["pretrain_length"]
    batch = settings["batch"]
    model = build_model(settings, seed)
    start = time.time()
    ids, labels = mqar_tensors(settings["pretrain_steps"] * batch, short, settings, seed)
    pre_losses = train(model, ids, labels, settings["pretrain_steps"], batch, settings["pretrain_lr"], device)
    short_eval = mqar_tensors(settings["eval_examples"], short, settings, seed + 1000)
    long_eval = mqar_tensors(settings["eval_examples"], long, settings, seed + 2000)
    with torch.no_grad():
        result = {
            "pretrain_loss_last": sum(pre_losses[-10:]) / len(pre_losses[-10:]),
            "recall_at_L": recall_accuracy(model, *short_eval),
            "recall_at_4L_before": {m: recall_accuracy(model, *long_eval, attention_mode=m) for m in ("full",) + MODES},
            "pretrain_seconds": round(time.time() - start, 1),
            "cells": {},
        }
    print(f"seed {seed} pretrained in {result['pretrain_seconds']}s: recall at L {result['recall_at_L']:.3f}", flush=True)
    pretrained = copy.deepcopy(model.state_dict())
    ft_ids, ft_labels = mqar_tensors(settings["finetune_steps"] * batch, long, settings, seed + 1)
    for mode, adapter in CELLS:
        start = time.time()
        model.load_state_dict(pretrained)
        model.config.attention_mode = mode  # read by every forward: the fine-tuning attention
        torch.manual_seed(seed)  # the same adapter initialisation in every cell
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(ensure_weight_tying|falling back|tied|is_gradient_checkpointing).*")
            peft_model = get_peft_model(copy.deepcopy(model), adapter_config(adapter, settings["rank"]))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        losses = train(peft_model, ft_ids, ft_labels, settings["finetune_steps"], batch, settings["finetune_lr"], device)
        with torch.no_grad():
            result["cells"][cell_name(mode, adapter)] = {
                "recall_full": recall_accuracy(peft_model, *long_eval, attention_mode="full"),
                "recall_own_mode": recall_accuracy(peft_model, *long_eval, attention_mode=mode),
                "finetune_loss_first": sum(losses[:5]) / len(losses[:5]),
                "finetune_loss_last": sum(losses[-5:]) / len(losses[-5:]),
                "trainable_parameters": trainable,
                "seconds": round(time.time() - start, 1),
            }
        cell = result["cells"][cell_name(mode, adapter)]
        print(f"seed {seed} {cell_name(mode, adapter)}: recall {cell['recall_full']:.3f} ({cell['seconds']}s)", flush=True)
        del peft_model
    model.config.attention_mode = "full"
    result["parameters"] = sum(p.numel() for p in model.parameters())
    return result


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarise(per_seed: dict) -> dict:
    """Mean over seeds of each cell's recall (full-attention and own-mode evaluation)."""
    return {
        cell_name(mode, adapter): {
            key: mean(r["cells"][cell_name(mode, adapter)][key] for r in per_seed.values())
            for key in ("recall_full", "recall_own_mode")
        }
        for mode, adapter in CELLS
    }


def outcome_checks(means: dict, per_seed: dict) -> dict[str, bool]:
    full = {cell: v["recall_full"] for cell, v in means.items()}
    before = mean(r["recall_at_4L_before"]["full"] for r in per_seed.values())
    best = max(full.values())
    return {
        "SE-Attn + HyLoRA has the best far-needle recall (full-attention eval, mean over seeds)": full["se+hylora"] == best,
        "SE-Attn beats SW-Attn (HyLoRA, full-attention eval)": full["se+hylora"] > full["swa+hylora"],
        "SE-Attn beats SW-Attn (LoRA, full-attention eval)": full["se+lora"] > full["swa+lora"],
        "HyLoRA beats LoRA (SE-Attn, full-attention eval)": full["se+hylora"] > full["se+lora"],
        "SE-Attn + HyLoRA fine-tuning improves on the pre-trained model at 4L": full["se+hylora"] > before,
        "SE-Attn + HyLoRA beats SW-Attn + HyLoRA on every seed": all(
            r["cells"]["se+hylora"]["recall_full"] > r["cells"]["swa+hylora"]["recall_full"] for r in per_seed.values()),
    }


def markdown(settings: dict, per_seed: dict, means: dict, checks: dict) -> str:
    seeds = list(per_seed)
    short = settings["pretrain_length"]
    header = (f"| fine-tuning | recall@{4 * short}, Full-Attn eval: mean | per seed ({', '.join(map(str, seeds))}) "
              f"| recall@{4 * short}, own-mode eval: mean | trainable params |")
    lines = [header, "|---|---|---|---|---|"]
    before_full = [per_seed[s]["recall_at_4L_before"]["full"] for s in seeds]
    lines.append(f"| none (pre-trained at {short}) | {mean(before_full):.3f} | {', '.join(f'{v:.3f}' for v in before_full)} | - | - |")
    for mode, adapter in CELLS:
        cell = cell_name(mode, adapter)
        values = [per_seed[s]["cells"][cell]["recall_full"] for s in seeds]
        trainable = per_seed[seeds[0]]["cells"][cell]["trainable_parameters"]
        lines.append(f"| {MODE_NAMES[mode]} + {ADAPTER_NAMES[adapter]} | {means[cell]['recall_full']:.3f} | "
                     f"{', '.join(f'{v:.3f}' for v in values)} | {means[cell]['recall_own_mode']:.3f} | {trainable:,} |")
    recall_short = mean(per_seed[s]["recall_at_L"] for s in seeds)
    window = max(settings["chunk_sizes"])
    held = [claim for claim, ok in checks.items() if ok]
    missed = [claim for claim, ok in checks.items() if not ok]
    words = (
        f"\n\nA {per_seed[seeds[0]]['parameters']:,}-parameter se_hybrid (Mamba-2 / attention x 2) pre-trained on MQAR "
        f"({settings['num_pairs']} key-value pair(s)) at length {short} (recall there: {recall_short:.3f}, mean over seeds), "
        f"then fine-tuned for {settings['finetune_steps']} steps at {4 * short} with every needle at least "
        f"{4 * short - 4 * settings['num_pairs'] + 1} tokens before its query, beyond the SW window / largest SE chunk ({window}). Recall is scored on "
        f"{settings['eval_examples']} held-out sequences per seed.\n\n"
        f"Outcome: {'; '.join(held) if held else 'none of the checks held'}."
        + (f" Not shown at this scale: {'; '.join(missed)}." if missed else "")
        + "\n\nScale gap: the paper (Fig. 2) fine-tunes a 2.7B Mamba-2-Hybrid at 8192 tokens and averages eleven RULER "
        "tasks; this is a toy model on one synthetic recall task: a gap between cells smaller than the seed-to-seed "
        "spread in the per-seed column is noise, and a cell ordering that disagrees with the paper at this size is "
        "not evidence against it."
    )
    return "\n".join(lines) + words


def run(settings: dict, out: Path, seeds: tuple[int, ...]) -> Reproduction:
    if not seeds:
        raise ValueError("seeds: give at least one seed (two or more for the deciding comparison), e.g. --seeds 0,1.")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    per_seed = {}
    for seed in seeds:
        per_seed[seed] = run_seed(settings, seed, device)
        print(f"seed {seed}: " + ", ".join(f"{c} {v['recall_full']:.3f}" for c, v in per_seed[seed]["cells"].items()), flush=True)
    means = summarise(per_seed)
    checks = outcome_checks(means, per_seed)
    raw = {"per_seed": {str(s): r for s, r in per_seed.items()}, "mean": means, "seeds": list(seeds)}

    def plot(figure):
        ax = figure.add_subplot(1, 1, 1)
        labels = ["pre-trained"] + [f"{MODE_NAMES[m]}\n{ADAPTER_NAMES[a]}" for m, a in CELLS]
        for offset, seed in enumerate(seeds):
            r = per_seed[seed]
            values = [r["recall_at_4L_before"]["full"]] + [r["cells"][cell_name(m, a)]["recall_full"] for m, a in CELLS]
            ax.scatter([i + 0.08 * (offset - (len(seeds) - 1) / 2) for i in range(len(values))], values,
                       color="gray", s=14, zorder=3, label="per seed" if offset == 0 else None)
        bar_means = [mean(per_seed[s]["recall_at_4L_before"]["full"] for s in seeds)] + [
            means[cell_name(m, a)]["recall_full"] for m, a in CELLS]
        ax.bar(range(len(bar_means)), bar_means, color=["#bbbbbb", "#9ecae1", "#3182bd", "#fdae6b", "#e6550d"])
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(f"recall of far needles at {4 * settings['pretrain_length']} (Full-Attn eval)")
        ax.set_title("SE-Attn vs SW-Attn fine-tuning, LoRA vs HyLoRA (cf. Expansion Span Fig. 2)")
        ax.legend(loc="upper left")

    return Reproduction(name="se", paper=PAPER, table=markdown(settings, per_seed, means, checks), raw=raw,
                        plot=plot, outcome=checks)
