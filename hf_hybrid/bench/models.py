"""Whole models through the public API: every architecture against transformers' LlamaForCausalLM.

``hf-hybrid bench --suites models`` (``--quick --device cpu``: a smoke run at tiny shapes).
A kernel win counts when it shows here: each cell is one public call on a whole model.

Shape: 8 layers of the 1.3B shape (hidden 2048 = 16 heads x 128, SwiGLU 5632, vocab 32000), bf16,
random weights; every model is built from its config class with these sizes and otherwise the
architecture's defaults. Cells (one Case each, every model a variant):

- ``train T=8K`` / ``train T=32K``: ``model(input_ids, labels=input_ids).loss.backward()`` at B=1
  (then the gradients are dropped), ms and peak GB. Llama runs as is and with Liger's kernels
  (``apply_liger_kernel_to_llama``: RMSNorm, SwiGLU, RoPE, fused linear cross-entropy); the
  baseline of the summary is the fastest of them. Our models use this package's fused LM head +
  loss, RMSNorm and SwiGLU (layers/backbone_fusion.py); the loss, unlike Liger's, does not
  synchronise with the host, and the norm and SwiGLU cost less host time; ``Llama+Liger, our
  kernels`` is Llama with Liger's RoPE and those same loss, norm and SwiGLU kernels, the baseline
  given the same backbone kernels;
  ``<model> unfused`` rows (T=8K) show the fused kernels switched off.
- ``prefill T=32K``: ``model(input_ids, logits_to_keep=1)`` under no_grad (the cache is built).
- ``decode B=32 prompt=2K new=128`` / ``decode B=8 prompt=16K new=64``: ``generate()`` greedy with
  ``min_new_tokens = max_new_tokens`` and otherwise default arguments; Llama with its default
  (dynamic) cache, with Liger, and with ``cache_implementation="static"`` (generate() then compiles
  the decode step: its fastest; Liger adds nothing under Inductor, which fuses the same ops).
  Liger slows eager decode steps down (they are launch-bound); our models keep PyTorch's norm and
  SwiGLU below backbone_fusion.FUSED_MIN_TOKENS tokens.
  A logits processor records a CUDA event after the prefill and after every token, so the cell
  reports decode throughput, B x (new - 1) / (time from the first to the last token), and keeps
  the prefill and whole-call times in its info. The warm-up is a short generate() (a whole one
  for the static cache, compiled per cache length).

Every cell's first call (its warm-up, where kernels compile and autotune) is timed too: the log line
shows it as ``(first call X s)`` and the JSON keeps it as ``info["first_call_ms"]``; the summary's
last column is the first training cell's, each model's first training step in the process (a first
use when ``TRITON_CACHE_DIR`` starts empty; ``tests/gpu/test_first_use_gpu.py`` times first use in
fresh processes).

Every cell catches OOM (reported as OOM) and errors (reported, the suite goes on). The big shapes
run 1 warm-up (compilation, autotuning) and one or two timed calls (a call is a whole training
step or a whole generate(), itself an average over its tokens). A cold run is dominated by
compiling and autotuning every model's Triton kernels (minutes for the first cells), so run it in pieces (``--only train``, ``--only prefill,decode B=8``,
``--only "decode B=32"``, and ``--variants "Llama,FoX"`` for chosen rows: each case's baseline
always runs) where one command is time-limited; bench.json is rewritten after every case. ``--budget <seconds>``
caps a run: each case gets a share of the budget and the variants past it are reported as skipped
(see TimeBudget), so the JSON is always written. ``python -m hf_hybrid.bench.models A.json
[B.json ...]`` turns bench.json files into the per-model Markdown summary (ratios against the
Llama baselines).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..layers.backbone_fusion import backbone_fusion_settings
from .cases import BenchConfig, Case
from .timing import Timing

FULL_SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16)
QUICK_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
MAX_POSITIONS = 32768
LLAMA_OUR_KERNELS = "Llama+Liger, our kernels"  # the training baseline with our models' loss, norm and SwiGLU
UNFUSED_ROWS = ("RAT", "FoX (llama)")  # also timed with the fused backbone kernels off (train T=8K)


class SkipVariant(Exception):
    """A variant that cannot run here (e.g. Liger on the CPU): reported as 'skipped: <reason>'."""


class TimeBudget:
    """Optional wall-clock budget for the suite (``hf-hybrid bench --budget`` seconds, e.g. to fit a
    time-limited GPU job): case i may run until its cumulative share of the budget is spent
    (unused time carries over); variants that would start later are reported as skipped.
    ``keep(names)`` (the harness's --only) shares the budget among the cases that will run."""

    def __init__(self, seconds: float | None, shares: dict[str, float]):
        self.seconds, self.start, self.shares = seconds, None, dict(shares)
        self.keep(list(shares))

    def keep(self, names: list[str]) -> None:
        total = sum(self.shares[n] for n in names) or 1.0
        running = 0.0
        self.ends = {}
        for name in names:
            running += self.shares[name]
            self.ends[name] = running / total

    def guard(self, case_name: str, builder):
        def build():
            if self.seconds is not None:
                now = time.perf_counter()
                self.start = now if self.start is None else self.start
                if now - self.start > self.ends.get(case_name, 1.0) * self.seconds:
                    raise SkipVariant(f"time budget spent (--budget {self.seconds:g} s)")
            return builder()
        return build


@dataclass(frozen=True)
class Arch:
    """One of our architectures: its model_type and config keywords on top of the shared shape."""

    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)
    trains: bool = True  # False: an inference-time variant of a model trained otherwise (RAT+ sparse)


def architectures(quick: bool) -> list[Arch]:
    """The rows of every architecture of hf_hybrid/architectures.py, in its order."""
    from ..architectures import ARCHITECTURES
    from ..sparse import SparseInferenceConfig

    layers = (QUICK_SHAPE if quick else FULL_SHAPE)["num_hidden_layers"]
    alternate = lambda a, b: [a if i % 2 == 0 else b for i in range(layers)]  # noqa: E731
    tiny = {"mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16, "se_chunk_sizes": [32, 64],
            "se_block_size": 8, "se_top_k": 2, "se_select_every": 16} if quick else {}
    rows = {
        "rat": [
            Arch("RAT", "rat", {"chunk_size": 16} if not quick else {"chunk_size": 8}),
            Arch("RAT-SWA", "rat", {"layer_types": alternate("rat", "sliding_attention"),
                                    **({"chunk_size": 8, "sliding_window": 16} if quick else {})}),
        ],
        "rat_plus": [
            Arch("RAT+", "rat_plus", {"training_dilations": [1, 4]} if quick else {}),
            Arch("RAT+ D=16", "rat_plus", {"sparse_config": SparseInferenceConfig(dilation=4 if quick else 16).to_dict(),
                                           **({"training_dilations": [1, 4]} if quick else {})}, trains=False),
        ],
        "fox": [Arch("FoX (llama)", "fox", {"block_type": "llama"}), Arch("FoX (pro)", "fox", {"block_type": "pro"})],
        "rattention": [Arch("RATTENTION", "rattention", {"window_size": 16} if quick else {})],
        "se_hybrid": [Arch("SE hybrid", "se_hybrid", tiny)],
    }
    missing = [arch.model_type for arch in ARCHITECTURES if arch.model_type not in rows]
    if missing:
        raise KeyError(f"the model bench has no row for architecture(s) {missing}: add them to architectures().")
    return [row for arch in ARCHITECTURES for row in rows[arch.model_type]]


def _shape(config: BenchConfig) -> dict:
    return dict(QUICK_SHAPE if config.quick else FULL_SHAPE)


def _on_device(build, config: BenchConfig):
    """Build a model directly on the bench device, cast to the bench dtype."""
    with torch.device(config.device):
        model = build()
    return model.to(config.dtype)


def build_ours(arch: Arch, config: BenchConfig):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_hybrid  # noqa: F401  (registers the architectures)

    model_config = AutoConfig.for_model(arch.model_type, **_shape(config), max_position_embeddings=MAX_POSITIONS,
                                        pad_token_id=0, **arch.overrides)
    return _on_device(lambda: AutoModelForCausalLM.from_config(model_config), config)


# --- Llama, as is and with Liger ----------------------------------------------------------------
_LLAMA_ORIGINALS: dict = {}


def _restore_llama_module() -> None:
    """apply_liger_kernel_to_llama also patches module globals of modeling_llama (RoPE, the norm and
    MLP classes) for every later model; put the originals back before a plain Llama is timed."""
    from transformers.models.llama import modeling_llama

    if not _LLAMA_ORIGINALS:
        for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
            _LLAMA_ORIGINALS[name] = getattr(modeling_llama, name)
        _LLAMA_ORIGINALS["forward"] = modeling_llama.LlamaForCausalLM.forward
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        setattr(modeling_llama, name, _LLAMA_ORIGINALS[name])
    modeling_llama.LlamaForCausalLM.forward = _LLAMA_ORIGINALS["forward"]


def build_llama(config: BenchConfig, liger: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    _restore_llama_module()
    if liger and not config.on_cuda:
        raise SkipVariant("Liger's kernels need CUDA")
    if liger:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as exc:
            raise SkipVariant(f"liger-kernel is not installed ({exc}); pip install 'hf-hybrid[bench]'") from exc
    shape = _shape(config)
    llama_config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=MAX_POSITIONS,
                               rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = _on_device(lambda: LlamaForCausalLM(llama_config), config)
    if liger:
        apply_liger_kernel_to_llama(model=model)
    return model


def with_package_kernels(model):
    """``model`` (a Llama, with or without Liger's patch) with its LM head and loss, its RMSNorms and
    its SwiGLU product computed as our models compute them (layers/loss.py, layers/norm.py,
    layers/mlp.py: this package's kernels on CUDA) instead of Liger's fused linear cross-entropy,
    which synchronises with the host twice per step, and Liger's RMSNorm and SwiGLU: the training
    baseline given the same backbone kernels as the models it is compared with (Liger's RoPE stays)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ..layers.loss import causal_lm_loss_from_hidden
    from ..layers.mlp import SwiGLUMLP
    from ..layers.norm import RMSNorm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "variance_epsilon") and weight is not None and weight.dim() == 1:
            module.eps = module.variance_epsilon
            module.forward = RMSNorm.forward.__get__(module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")):
            module.hidden_act = model.config.hidden_act
            module.forward = SwiGLUMLP.forward.__get__(module)

    def forward(input_ids=None, labels=None, use_cache=False, **kwargs):
        hidden = model.model(input_ids=input_ids, use_cache=use_cache, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=causal_lm_loss_from_hidden(hidden, model.lm_head.weight, labels))

    model.forward = forward
    return model


# --- the timed calls --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step_builder(make_model, seq: int, config: BenchConfig, fused: bool = True):
    def build():
        with backbone_fusion_settings(fused):
            model = make_model().train()
        ids = torch.randint(3, model.config.vocab_size, (1, seq), device=config.device)

        def step():
            with backbone_fusion_settings(fused):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)

        return step, {"tokens": seq}
    return build


def prefill_builder(make_model, seq: int, config: BenchConfig):
    def build():
        model = make_model().eval()
        ids = torch.randint(3, model.config.vocab_size, (1, seq), device=config.device)

        def step():
            with torch.no_grad():
                model(input_ids=ids, logits_to_keep=1).logits.argmax(-1)

        return step, {"tokens": seq}
    return build


class TokenClock:
    """A logits processor that timestamps every generated token (CUDA events, or the host clock off
    CUDA) and returns the scores unchanged: the first stamp closes the prefill."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())
        return scores

    def start(self):
        self.stamps = []
        if self.device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin
        return time.perf_counter()

    def elapsed_ms(self, begin) -> tuple[float, float]:
        """(prefill ms, decode ms): call start to the first token, first token to the last."""
        _sync(self.device)
        if self.device.type == "cuda":
            return begin.elapsed_time(self.stamps[0]), self.stamps[0].elapsed_time(self.stamps[-1])
        return (self.stamps[0] - begin) * 1e3, (self.stamps[-1] - self.stamps[0]) * 1e3


WARMUP_PROMPT, WARMUP_NEW = 256, 8  # the decode warm-up: compiles and autotunes without a whole generate()


def decode_builder(make_model, batch: int, prompt: int, new_tokens: int, config: BenchConfig, **generate_kwargs):
    """generate() of ``new_tokens`` after a random ``prompt``; the timed call returns its decode ms.
    Its warm-up is a short generate() of the same batch, except with a static cache, whose compiled
    step is specialised to the cache length: there the warm-up is the timed call itself."""
    def build():
        from transformers import LogitsProcessorList

        model = make_model().eval()
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=config.device)
        clock = TokenClock(config.device)
        info = {"tokens": batch * (new_tokens - 1), "batch": batch, "prompt": prompt, "new_tokens": new_tokens}
        prefill, whole = [], []

        def generate(prompt_ids, new):
            with torch.no_grad():
                out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, logits_processor=LogitsProcessorList([clock]),
                                     **generate_kwargs)
            if out.shape[1] != prompt_ids.shape[1] + new:
                raise RuntimeError(f"generate() returned {out.shape[1] - prompt_ids.shape[1]} new tokens, expected {new}")

        def call():
            begin = clock.start()
            generate(ids, new_tokens)
            prefill_ms, decode_ms = clock.elapsed_ms(begin)
            prefill.append(prefill_ms)
            whole.append(prefill_ms + decode_ms)
            info["prefill_ms"] = round(statistics.median(prefill), 2)
            info["generate_ms"] = round(statistics.median(whole), 2)
            return decode_ms

        if generate_kwargs.get("cache_implementation") == "static":
            call.warm_up = lambda: generate(ids, new_tokens)
        else:
            call.warm_up = lambda: generate(ids[:, : min(prompt, WARMUP_PROMPT)], min(new_tokens, WARMUP_NEW))
        return call, info
    return build


# --- timing: few repeats at these shapes ----------------------------------------------------------
@dataclass
class ModelCase(Case):
    """A Case timed with ``warmup`` calls and ``repeat`` timed calls (below the harness's usual 10:
    one call here is a whole training step or a whole generate())."""

    warmup: int = 1
    budget_s: float = 8.0  # stop repeating once the timed calls took this long (at least one runs)

    def time_variant(self, fn, config: BenchConfig) -> Timing:
        device = config.device
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        first_ms = None
        for i in range(self.warmup):
            if i == 0:  # the first call: its kernels compile (and autotune) unless this process ran them already
                first_ms = _host_timed_ms(getattr(fn, "warm_up", fn), device)
            else:
                getattr(fn, "warm_up", fn)()
        times = []
        while len(times) < (self.repeat or 1) and sum(times) < self.budget_s * 1e3:
            _sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                measured = fn()
                end.record()
                _sync(device)
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                measured = fn()
                elapsed = (time.perf_counter() - t0) * 1e3
            times.append(float(measured) if isinstance(measured, (int, float)) else elapsed)  # self-timed calls
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return Timing(statistics.median(times), min(times), max(times), len(times), peak, first_ms)


def _host_timed_ms(call, device: torch.device) -> float:
    """Wall time of ``call()`` to the end of its device work, in ms (compiles run on the host)."""
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _variants(config: BenchConfig, make_builder, llama_static=None, unfused: bool = False, inference: bool = True) -> dict:
    variants = {
        "Llama": make_builder(lambda: build_llama(config)),
        "Llama+Liger": make_builder(lambda: build_llama(config, liger=True)),
    }
    if not inference:  # training cells: Llama with this package's loss, norm and SwiGLU, as ours have them
        variants[LLAMA_OUR_KERNELS] = make_builder(lambda: with_package_kernels(build_llama(config, liger=True)))
    for arch in architectures(config.quick):
        if arch.trains or inference:
            variants[arch.name] = make_builder(lambda arch=arch: build_ours(arch, config))
    if llama_static is not None:  # last: its compilation is the longest warm-up
        variants["Llama static"] = llama_static
    if unfused:  # before / after the backbone fusion: the same backbone in every model, two suffice
        for arch in architectures(config.quick):
            if arch.name in UNFUSED_ROWS:
                variants[f"{arch.name} unfused"] = make_builder(lambda arch=arch: build_ours(arch, config), fused=False)
    return variants


def cases(config: BenchConfig) -> list[Case]:
    out = _cases(config)
    schedule = TimeBudget(config.budget_s, {c.name: CASE_SHARES.get(c.name.split(" ")[0], 1.0) for c in out})
    for case in out:
        case.variants = {name: schedule.guard(case.name, builder) for name, builder in case.variants.items()}
        case.schedule = schedule
    return out


CASE_SHARES = {"train": 0.2, "prefill": 0.12, "decode": 0.24}  # of --budget, per case


def _cases(config: BenchConfig) -> list[Case]:
    quick = config.quick
    train_seqs = (64, 128) if quick else (8192, 32768)
    prefill_seq = 128 if quick else 32768
    decodes = ((2, 32, 4), (2, 64, 4)) if quick else ((32, 2048, 128), (8, 16384, 64))
    layers = _shape(config)["num_hidden_layers"]
    out = []
    for i, seq in enumerate(train_seqs):
        out.append(ModelCase(
            "models", f"train T={seq // 1024}K" if seq >= 1024 else f"train T={seq}", {"seq": seq, "batch": 1, "layers": layers},
            _variants(config, lambda make, fused=True, seq=seq: train_step_builder(make, seq, config, fused),
                      unfused=(i == 0 and config.on_cuda), inference=False),
            repeat=1 if quick else (2 if seq <= 8192 else 1),
            notes="model(input_ids, labels=input_ids).loss.backward(), B=1; peak GB includes weights and grads",
        ))
    out.append(ModelCase(
        "models", f"prefill T={prefill_seq // 1024}K" if prefill_seq >= 1024 else f"prefill T={prefill_seq}",
        {"seq": prefill_seq, "batch": 1, "layers": layers},
        _variants(config, lambda make: prefill_builder(make, prefill_seq, config)),
        repeat=1 if quick else 2, notes="no_grad forward with the cache, logits of the last token",
    ))
    for batch, prompt, new in decodes:
        make = lambda m, b=batch, p=prompt, n=new, **kw: decode_builder(m, b, p, n, config, **kw)  # noqa: E731
        static = make(lambda: build_llama(config), cache_implementation="static")
        out.append(ModelCase(
            "models", f"decode B={batch} prompt={prompt} new={new}", {"batch": batch, "prompt": prompt, "new": new, "layers": layers},
            _variants(config, make, llama_static=static), unit="tokens/s", x_key="batch", repeat=1,
            notes="generate() greedy, default arguments; tokens/s = B x (new-1) / (first to last token)",
        ))
    return out


# --- the per-model summary ---------------------------------------------------------------------------
def _cell(results: list[dict], case_prefix: str, variant: str) -> dict | None:
    for r in results:
        if r["group"] == "models" and r["name"].startswith(case_prefix) and r["variant"] == variant:
            return r
    return None


def _show(r: dict | None, unit: str) -> str:
    if r is None:
        return "-"
    if r["value"] is None:
        return r["status"].split(":")[0]
    return f"{r['value']:,.0f}" if unit == "tokens/s" else f"{r['value']:,.1f}"


def summary_markdown(results: list[dict]) -> str:
    """One row per model: ms (lower is better) or tokens/s (higher), and the ratio to the best
    Llama of the same cell (the faster of as-is and Liger; for decode the static cache too)."""
    names = [r["name"] for r in results if r["group"] == "models"]
    columns = list(dict.fromkeys(names))
    variants = list(dict.fromkeys(r["variant"] for r in results if r["group"] == "models"))
    header = ["model"] + [f"{c} ({'tok/s' if 'decode' in c else 'ms'})" for c in columns]
    first_train = next((c for c in columns if c.startswith("train")), None)
    if first_train:  # the first call of the first training cell: the process's first step of that model
        header.append(f"first step, {first_train} (s)")
    rows = []
    for variant in variants:
        row = [variant]
        for column in columns:
            r = _cell(results, column, variant)
            unit = r["unit"] if r else "ms"
            llamas = [_cell(results, column, v) for v in ("Llama", "Llama+Liger", LLAMA_OUR_KERNELS, "Llama static")]
            values = [x["value"] for x in llamas if x and x["value"] is not None]
            best = (max(values) if unit == "tokens/s" else min(values)) if values else None
            text = _show(r, unit)
            if r is not None and r["value"] is not None and best:
                ratio = r["value"] / best if unit == "tokens/s" else best / r["value"]
                text += f" ({ratio:.2f}x)"
            if r is not None and r.get("peak_mem_gb") is not None and "train" in column:
                text += f", {r['peak_mem_gb']:.1f} GB"
            row.append(text)
        if first_train:
            first = ((_cell(results, first_train, variant) or {}).get("info") or {}).get("first_call_ms")
            row.append(f"{first / 1e3:.1f}" if first is not None else "-")
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes = ("(x) = speed relative to the fastest Llama of the column (Llama as is, with Liger, with Liger and "
             "our backbone kernels for training, and for decode "
             "with the static cache); > 1 is faster. Train cells add the peak GPU memory. First step: the wall time "
             "of the model's first training step in the process, compiles and autotuning included (a first use "
             "when the Triton cache was empty).")
    return "\n".join(lines) + "\n\n" + notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_hybrid.bench.models",
                                     description="Per-model Markdown summary of models-suite bench.json files.")
    parser.add_argument("json", nargs="+", type=Path, help="bench.json files written by hf-hybrid bench --suites models")
    parser.add_argument("--out", type=Path, help="write the Markdown here as well as printing it")
    args = parser.parse_args(argv)
    results = [r for path in args.json for r in json.loads(path.read_text())["results"]]
    text = summary_markdown(results)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
