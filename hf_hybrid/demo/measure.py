"""The steps `hf-hybrid demo` runs on every contestant: train, check the reload, measure one row.

Every measurement takes the row's forward keywords (``sparse_config=...`` for RAT+,
``attention_mode=...`` for SE hybrids), so the inference variants of one trained model are
measured exactly like separately trained models.
"""
from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm

from .setup import DecodeSetting, DemoData, DemoSize, decode_setting
from ..eval.memory import cache_nbytes_at_context
from ..eval.positions import per_token_loss
from ..eval.recall import recall_accuracy


def train(model, data: DemoData, size: DemoSize, device, label: str, seed: int = 0) -> float:
    """AdamW, linear warm-up then cosine decay, batches alternating between recall and language.

    Returns the mean loss of the last 10% of steps (both tasks alike). For RAT+'s joint objective
    (a sum over training dilations) it is the dense pattern's loss, comparable with the others.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.learning_rate, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, size.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / size.steps, 1.0)))
    )
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for step in tqdm(range(size.steps), desc=f"train {label}", leave=False):
        if step % 2 == 0:
            ids, labels = data.recall_train["input_ids"], data.recall_train["labels"]
        else:
            ids = labels = data.language_train
        rows = torch.randint(0, ids.shape[0], (size.batch_size,), generator=generator)
        out = model(ids[rows].to(device), labels=labels[rows].to(device), use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        pattern_losses = getattr(out, "pattern_losses", None)
        losses.append((out.loss if pattern_losses is None else pattern_losses[0]).item())
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


@torch.no_grad()
def check_reload(trained, reloaded, probe: torch.Tensor, name: str, **forward_kwargs) -> None:
    """The reloaded checkpoint must reproduce the trained model's logits exactly (same weights, same code)."""
    if not torch.equal(trained(probe, **forward_kwargs).logits, reloaded(probe, **forward_kwargs).logits):
        raise RuntimeError(f"{name}: the model reloaded with AutoModelForCausalLM gives different logits than the trained one")


@torch.no_grad()
def generated_recall(model, recall: dict, device, examples: int = 64, **forward_kwargs) -> float:
    """Greedy generate() answers the first query of each example from its prompt: fraction right."""
    labels = recall["labels"][:examples]
    first = int((labels[0] != -100).nonzero()[0])  # every example has the same layout
    prompts = recall["input_ids"][:examples, :first].to(device)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=1, do_sample=False, pad_token_id=0,
                         **forward_kwargs)
    return float((out[:, -1].cpu() == labels[:, first]).float().mean())


def language_loss(model, documents: torch.Tensor, **forward_kwargs) -> float:
    """Mean next-token loss (nats) over held-out synthetic-language documents."""
    result = per_token_loss(model, documents, batch_size=16, **forward_kwargs)
    return float((result.loss.nan_to_num() * result.count).sum() / result.count.sum())


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class _TokenClock:
    """Logits processor stamping the host clock after each generated token (the device is
    synchronised first, so a stamp marks the end of that token's forward)."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


@torch.no_grad()
def decode_tokens_per_second(model, device, setting: DecodeSetting | None = None, **forward_kwargs) -> float:
    """Greedy cached decoding speed: batch * (new_tokens - 1) / time from the first generated token
    to the last, after a ``setting.context``-token prompt (the prefill is not counted)."""
    from transformers import LogitsProcessorList

    setting = setting or DecodeSetting(batch=8, context=64, new_tokens=32)
    prompts = torch.randint(3, model.config.vocab_size, (setting.batch, setting.context), device=device)
    kwargs = dict(attention_mask=torch.ones_like(prompts), do_sample=False, pad_token_id=0, eos_token_id=None, **forward_kwargs)
    model.generate(prompts[:, :8], max_new_tokens=2, min_new_tokens=2, **kwargs | {"attention_mask": kwargs["attention_mask"][:, :8]})  # warm-up
    clock = _TokenClock(device)
    new = setting.new_tokens
    model.generate(prompts, max_new_tokens=new, min_new_tokens=new, logits_processor=LogitsProcessorList([clock]), **kwargs)
    return setting.batch * (new - 1) / (clock.stamps[-1] - clock.stamps[0])


def decode_speed_row(model, **forward_kwargs) -> dict:
    """The decode column, on the GPU (the model is moved there and back); nothing without one."""
    setting = decode_setting()
    if setting is None:
        return {}
    home = next(model.parameters()).device
    model.to("cuda")
    try:
        tokens_per_s = decode_tokens_per_second(model, "cuda", setting, **forward_kwargs)
    finally:
        model.to(home)
    return {"decode_tokens_per_s": tokens_per_s, "decode_device": "cuda", "decode_batch": setting.batch,
            "decode_context": setting.context, "decode_new_tokens": setting.new_tokens}


def measure_row(trained, reloaded, data: DemoData, device, name: str, forward_kwargs: dict) -> dict:
    """One table row, measured on the reloaded model (tqdm bar over the steps)."""
    probe = data.recall_eval["input_ids"][:2].to(device)
    steps = {
        "reload check": lambda: check_reload(trained, reloaded, probe, name, **forward_kwargs),
        "recall_accuracy": lambda: recall_accuracy(reloaded, data.recall_eval["input_ids"], data.recall_eval["labels"], **forward_kwargs),
        "generated_recall": lambda: generated_recall(reloaded, data.recall_eval, device, **forward_kwargs),
        "language_eval_loss": lambda: language_loss(reloaded, data.language_eval, **forward_kwargs),
        "decode": lambda: decode_speed_row(reloaded, **forward_kwargs),
        "kv_cache_bytes_4k": lambda: cache_nbytes_at_context(reloaded, 4096, **forward_kwargs),
    }
    row = {}
    bar = tqdm(steps.items(), desc=f"measure {name}", leave=False, total=len(steps))
    for key, step in bar:
        bar.set_postfix_str(key)
        value = step()
        if isinstance(value, dict):  # a step filling several columns
            row.update(value)
        elif value is not None:
            row[key] = value
    row["reload_identical"] = True  # check_reload raised otherwise
    return row
