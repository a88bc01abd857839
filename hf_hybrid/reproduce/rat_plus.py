"""Small reproduction of the shape of RAT+ Table 3 (and Table 12's "w/o adapt" row): train dense, infer dilated.

Trains, on the same generated data (``hf_hybrid.adapt.synthetic_language``: an order-2 language with
long-range copies) for the same number of steps and with the same optimiser:

* ``attention``         - attention with output gate, no recurrence, trained dense (D-dagger = 1)
* ``attention_joint``   - the same, trained jointly D-dagger = 1 and 64 (Table 3, third row)
* ``rat_plus``          - RAT+ (L = T, L* = 64), trained jointly D = 1 and 64
* ``rat_plus_no_arl``   - RAT+ trained dense only (Table 12's "no active recurrence learning" row)

then reports held-out loss (nats/token) with dilation D in {1, 2, 4, 8, 16, 32, 64} (no local window,
4 sink tokens, no adaptation). Expected shape: RAT+ degrades gracefully with D while attention
collapses once dilated. Every seed trains all four models on its own data and initialisation.

    hf-hybrid reproduce rat_plus --preset cpu --out DIR   # toy size, CI
    hf-hybrid reproduce rat_plus --preset gpu --out DIR   # the docs/reproductions.md preset
    python -m hf_hybrid.reproduce.rat_plus --preset gpu --time-budget 200 --out DIR  # one seed, results.json + table.md
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..adapt import dilation_patterns, evaluate_patterns, synthetic_language
from ..models.rat_plus.configuration_rat_plus import RatPlusConfig
from ..models.rat_plus.modeling_rat_plus import RatPlusForCausalLM
from .report import Reproduction
from .training import adamw_warmup_cosine, autocast_for

PAPER = "RAT+ Table 3 (and Table 12 'w/o adapt'): a dense-trained RAT+ keeps its loss under dilation D, dense attention collapses"

PRESETS = {
    # toy size for CI: about 30 s on one CPU thread for 2 seeds
    "cpu": dict(hidden=32, layers=2, heads=2, seq_len=128, batch=8, steps=80, lr=3e-3, vocab=16, eval_sequences=8,
                time_budget=None),
    # time_budget: seconds of training per seed for all four models (steps are lowered to fit after timing a few);
    # one seed takes ~200 s on one GPU at ~1,100 steps (docs/reproductions.md), so two seeds fit 9 minutes
    "gpu": dict(hidden=256, layers=4, heads=4, seq_len=1024, batch=16, steps=1200, lr=1e-3, vocab=64, eval_sequences=64,
                time_budget=180),
}
MODELS = {
    "rat_plus": dict(use_recurrence=True, training_dilations=[1, 64]),
    "attention": dict(use_recurrence=False, training_dilations=[1]),
    "attention_joint": dict(use_recurrence=False, training_dilations=[1, 64]),
    "rat_plus_no_arl": dict(use_recurrence=True, training_dilations=[1]),
}
DILATIONS = (1, 2, 4, 8, 16, 32, 64)


def build_model(kind: str, settings: dict, backend: str) -> RatPlusForCausalLM:
    torch.manual_seed(settings["seed"])
    config = RatPlusConfig(
        vocab_size=settings["vocab"] + 3, hidden_size=settings["hidden"], intermediate_size=settings["hidden"] * 11 // 4,
        num_hidden_layers=settings["layers"], num_attention_heads=settings["heads"],
        max_position_embeddings=max(settings["seq_len"], 64), kernel_backend=backend, **MODELS[kind],
    )
    return RatPlusForCausalLM(config)


def train(model, data: torch.Tensor, settings: dict, device: torch.device) -> dict:
    """AdamW (0.9, 0.95), weight decay 0.1, 5% warmup then cosine to 10%, grad clip 1, bf16 autocast on CUDA."""
    model.to(device).train()
    steps = settings["steps"]
    opt, sched = adamw_warmup_cosine(model, settings["lr"], steps)
    start, losses = time.time(), []
    for step in range(steps):
        batch = data[step * settings["batch"] : (step + 1) * settings["batch"]].to(device)
        with autocast_for(device):
            out = model(batch, labels=batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.pattern_losses.float().cpu() if out.pattern_losses is not None else out.loss.detach().float().cpu()[None])
    if device.type == "cuda":
        torch.cuda.synchronize()
    final = torch.stack(losses[-max(1, steps // 10) :]).mean(0).tolist()
    return {"train_seconds": round(time.time() - start, 1), "final_train_losses": [round(x, 4) for x in final]}


def check_fast_paths(device: torch.device) -> str:
    """On CUDA, compare the Triton recurrence and block-end attention (forward and backward) with their
    PyTorch references once; "auto" if they agree, else "scan" (PyTorch scan + SDPA, no Triton)."""
    if device.type != "cuda":
        return "auto"
    from ..kernels.chunk_attention import block_end_attention
    from ..kernels.gated_recurrence import gated_recurrence

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 1000, 4, 64, generator=gen).to(device)
    g = torch.sigmoid(torch.randn(2, 1000, 4, 64, generator=gen) + 2).to(device)
    q, k, v = (torch.randn(2, 300, 4, 64, generator=gen).to(device).requires_grad_() for _ in range(3))
    try:
        diffs = [(gated_recurrence(x, g, backend="auto") - gated_recurrence(x, g, backend="scan")).abs().max().item()]
        grads = []
        for backend in ("auto", "reference"):
            out = block_end_attention(q, k, v, 64, 0, 0, backend=backend)
            grads.append([out] + list(torch.autograd.grad(out.square().sum(), (q, k, v))))
        diffs += [((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item() for a, b in zip(*grads)]
    except Exception as error:  # report and fall back: the reproduction should not depend on it
        print(f"Triton fast path failed ({type(error).__name__}: {error}); using kernel_backend 'scan'")
        return "scan"
    print("Triton vs reference, max diff (recurrence abs; block-end out, dq, dk, dv relative): " + ", ".join(f"{d:.1e}" for d in diffs))
    return "auto" if max(diffs) < 1e-2 else "scan"


def calibrate_steps(settings: dict, models: list[str], backend: str, device: torch.device, budget_s: float) -> int:
    """The number of training steps (<= settings["steps"]) for which training every model fits budget_s."""
    per_step = 0.0
    batch = torch.randint(3, settings["vocab"] + 3, (settings["batch"], settings["seq_len"]), device=device)
    for kind in models:
        model = build_model(kind, settings, backend).to(device).train()
        for i in range(8):
            if i == 3:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.time()
            with autocast_for(device):
                model(batch, labels=batch).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        per_step += (time.time() - start) / 5 * 1.15  # + optimiser step
        del model
    steps = min(settings["steps"], int(budget_s / per_step))
    print(f"calibration: {per_step * 1000:.0f} ms per step for all models together -> {steps} steps")
    return steps


def train_models(settings: dict, models: list[str], backend: str, device: torch.device, out: Path | None = None) -> dict:
    """Train and evaluate ``models`` for one seed (``settings["seed"]``); the per-model results."""
    vocab, seq = settings["vocab"], settings["seq_len"]
    data = synthetic_language(settings["steps"] * settings["batch"], seq, vocab, seed=settings["seed"])
    held_out = synthetic_language(settings["eval_sequences"], seq, vocab, seed=settings["seed"] + 10_000)
    patterns = dilation_patterns(DILATIONS)
    results = {"settings": settings, "backend": backend, "device": str(device), "models": {}}
    if device.type == "cuda":
        results["device"] = torch.cuda.get_device_name(device)
    results["versions"] = {"torch": torch.__version__}
    for kind in models:
        model = build_model(kind, settings, backend)
        info = train(model, data, settings, device)
        with autocast_for(device):
            losses = evaluate_patterns(model, held_out, patterns, batch_size=settings["batch"])
        info["params"] = sum(p.numel() for p in model.parameters())
        info["eval_loss"] = {name: round(value, 4) for name, value in losses.items()}
        results["models"][kind] = info
        print(f"seed {settings['seed']} {kind:<16} trained in {info['train_seconds']}s, eval: "
              + "  ".join(f"{k} {v:.3f}" for k, v in info["eval_loss"].items()), flush=True)
        del model
        if out is not None:  # keep what is done if a later model runs out of time
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def markdown_table(results: dict) -> str:
    """One seed's table: held-out loss per dilation."""
    header = "| model | params | train | " + " | ".join(f"D={d}" for d in DILATIONS) + " |"
    lines = [header, "|" + "---|" * (len(DILATIONS) + 3)]
    for kind, info in results["models"].items():
        losses = " | ".join(f"{info['eval_loss'][f'D={d}']:.3f}" for d in DILATIONS)
        trained = "D=1" + (", D=64" if len(MODELS[kind]["training_dilations"]) > 1 else "")
        lines.append(f"| {kind} | {info['params'] / 1e6:.2f}M | {trained} | {losses} |")
    return "\n".join(lines)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _outcome(per_seed: dict[int, dict], models: list[str]) -> dict[str, bool]:
    """The deciding comparison (RAT+ vs dense attention at D=64) in the mean and in every seed."""
    checks = {}
    if {"rat_plus", "attention"} <= set(models):
        def gap(r):  # how much dilation D=64 costs: RAT+ must lose less than attention
            loss = {k: r["models"][k]["eval_loss"] for k in ("rat_plus", "attention")}
            return loss["rat_plus"]["D=64"] - loss["rat_plus"]["D=1"], loss["attention"]["D=64"] - loss["attention"]["D=1"]

        seeds = list(per_seed.values())
        checks["D=64 loss: rat_plus < attention in every seed"] = all(
            r["models"]["rat_plus"]["eval_loss"]["D=64"] < r["models"]["attention"]["eval_loss"]["D=64"] for r in seeds)
        checks["dilating to D=64 costs rat_plus less than attention in every seed"] = all(a < b for a, b in map(gap, seeds))
        checks["rat_plus degrades by < 0.1 nats from D=1 to D=64 (mean over seeds)"] = _mean(gap(r)[0] for r in seeds) < 0.1
    if {"rat_plus", "rat_plus_no_arl"} <= set(models):
        checks["D=64 loss: rat_plus <= rat_plus_no_arl (mean over seeds)"] = _mean(
            r["models"]["rat_plus"]["eval_loss"]["D=64"] for r in per_seed.values()) <= _mean(
            r["models"]["rat_plus_no_arl"]["eval_loss"]["D=64"] for r in per_seed.values())
    return checks


def run(settings: dict, out: Path, seeds: tuple[int, ...], models: list[str] | None = None, backend: str = "auto") -> Reproduction:
    if not seeds:
        raise ValueError("seeds: give at least one seed (two or more for the deciding comparison), e.g. --seeds 0,1.")
    models = list(MODELS) if models is None else models
    unknown = set(models) - set(MODELS)
    if unknown:
        raise ValueError(f"models: unknown {sorted(unknown)}; choose from {list(MODELS)}.")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "auto":
        backend = check_fast_paths(device)
    settings = dict(settings)
    if settings.get("time_budget"):
        settings["steps"] = calibrate_steps({**settings, "seed": seeds[0]}, models, backend, device, settings["time_budget"])
    per_seed = {seed: train_models({**settings, "seed": seed}, models, backend, device) for seed in seeds}
    mean_loss = {kind: {f"D={d}": round(_mean(per_seed[s]["models"][kind]["eval_loss"][f"D={d}"] for s in seeds), 4)
                        for d in DILATIONS} for kind in models}
    outcome = _outcome(per_seed, models)
    lines = ["Held-out loss (nats/token), mean over seeds " + ", ".join(map(str, seeds)) + ":", "",
             "| model | train | " + " | ".join(f"D={d}" for d in DILATIONS) + " |", "|" + "---|" * (len(DILATIONS) + 2)]
    for kind in models:
        trained = "D=1" + (", D=64" if len(MODELS[kind]["training_dilations"]) > 1 else "")
        lines.append(f"| {kind} | {trained} | " + " | ".join(f"{mean_loss[kind][f'D={d}']:.3f}" for d in DILATIONS) + " |")
    for seed in seeds:
        lines += ["", f"Seed {seed}:", "", markdown_table(per_seed[seed])]
    tokens = settings["steps"] * settings["batch"] * settings["seq_len"]
    lines += ["", f"Scale gap: {tokens / 1e6:.2f}M training tokens per model, hidden {settings['hidden']}, "
              f"{settings['layers']} layers, T = {settings['seq_len']}, synthetic data, no adaptation; the paper trains "
              "1B+ models on 100B+ tokens at T = 4K and adapts each D for 1B tokens.",
              "", "Cost of dilating D=1 -> D=64 (mean over seeds): " + ", ".join(
                  f"{kind} {mean_loss[kind]['D=64'] - mean_loss[kind]['D=1']:+.3f} nats" for kind in models)
              + " (the paper: RAT+ small, attention large).",
              "", "Outcome: " + ("every check holds" if all(outcome.values()) else "not every check holds (see Checks)")
              + (". Attention's collapse under dilation does not show at this scale: its D=64 cost is under 0.1 nats, "
                 "because a toy model trained for tens of steps learns little beyond unigram statistics, so dilation "
                 "costs little either way; the checks above are then within noise, not evidence"
                 if "attention" in models and mean_loss["attention"]["D=64"] - mean_loss["attention"]["D=1"] < 0.1 else "")
              + "."]

    def plot(figure):
        ax = figure.subplots()
        for kind in models:
            ax.plot(DILATIONS, [mean_loss[kind][f"D={d}"] for d in DILATIONS], marker="o", label=kind)
            for seed in seeds:
                ax.plot(DILATIONS, [per_seed[seed]["models"][kind]["eval_loss"][f"D={d}"] for d in DILATIONS],
                        color=ax.lines[-1].get_color() if seed == seeds[0] else None, alpha=0.25, linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("dilation D at inference")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title("RAT+ Table 3 shape: train dense, infer dilated")
        ax.legend(fontsize=8)

    raw = {"per_seed": {str(s): r for s, r in per_seed.items()}, "mean_eval_loss": mean_loss, "seeds": list(seeds),
           "backend": backend, "steps": settings["steps"]}
    return Reproduction(name="rat_plus", paper=PAPER, table="\n".join(lines), raw=raw, plot=plot, outcome=outcome)


def main(argv=None) -> None:
    """The one-seed ``table3`` CLI: results.json + table.md (the docs/reproductions.md GPU table)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for key in ("hidden", "layers", "heads", "seq_len", "batch", "steps", "vocab", "eval_sequences"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--kernel-backend", default="auto", choices=["auto", "reference", "triton", "scan"])
    parser.add_argument("--out", default=None, help="directory for results.json and table.md")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for training all models: lowers --steps after timing a few steps of each")
    args = parser.parse_args(argv)
    settings = dict(PRESETS[args.preset], seed=args.seed)
    for key in ("hidden", "layers", "heads", "seq_len", "batch", "steps", "vocab", "eval_sequences", "lr"):
        if getattr(args, key, None) is not None:
            settings[key] = getattr(args, key)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        raise ValueError(f"--models: unknown {sorted(unknown)}; choose from {list(MODELS)}.")
    backend = args.kernel_backend
    if backend == "auto":
        backend = check_fast_paths(device)
    if args.time_budget is not None:
        settings["steps"] = calibrate_steps(settings, models, backend, device, args.time_budget)
    out = Path(args.out) if args.out else None
    results = train_models(settings, models, backend, device, out)
    table = markdown_table(results)
    print(table)
    if out is not None:
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
