"""`hf-hybrid eval`: compare saved causal LMs side by side on long-context measurements.

    hf-hybrid eval DIR [LABEL=DIR ...] --task loss-by-position --lengths 128,256,512 --output-dir out
    hf-hybrid eval DIR [...] --task needle --needle-task single_1 --lengths 256,512 --depths 0,0.5,1

loss-by-position: per-token loss L(i) and perplexity P(l) for each l in --lengths (FoX Sec. 4.2) on
--data: ``language`` (hf_hybrid's synthetic language, preset --language; --oracle adds its ideal
predictor's curve),
a .txt file (tokenized with each model's tokenizer), or a folder saved with Dataset.save_to_disk
(an ``input_ids`` column). needle: accuracy by context length x needle depth on RULER-style tasks,
tokenized with the model's tokenizer when its folder has one, else over NeedleVocab ids.

Writes <task>.json and <task>.png to --output-dir and prints a table. Any model that
AutoModelForCausalLM loads works (hf-hybrid architectures and plain transformers ones).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..data.language import LANGUAGE_PRESETS, make_language_dataset, oracle_loss_by_position
from ..data.needle import RULER_TASKS, TEMPLATES, NeedleVocab, make_needle_dataset, resolve_task
from .needle import needle_accuracy
from .positions import PositionLoss, per_token_loss

TASKS = ("loss-by-position", "needle")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _numbers(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-hybrid eval", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("models", nargs="+", metavar="MODEL", help="a save_pretrained folder (or hub id), optionally LABEL=PATH")
    parser.add_argument("--task", choices=TASKS, default="loss-by-position")
    parser.add_argument("--lengths", type=_numbers(int), default=None, help="context lengths (default 64,128,256,512; needle 256,512)")
    parser.add_argument("--depths", type=_numbers(float), default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    parser.add_argument("--num-examples", type=int, default=None, help="sequences (loss, default 16) or examples per length x depth cell (needle, default 4)")
    parser.add_argument("--data", default="language", help="loss-by-position data: language | FILE.txt | DATASET_DIR")
    parser.add_argument("--language", choices=tuple(LANGUAGE_PRESETS), default="default", help="with --data language: which preset (the one the models were trained on)")
    parser.add_argument("--oracle", action="store_true", help="with --data language: add the ideal predictor's curve")
    parser.add_argument("--needle-task", default="single_1", help=f"RULER task {tuple(RULER_TASKS)} or single|multikey|multivalue|multiquery")
    parser.add_argument("--template", choices=tuple(TEMPLATES), default=None, help="needle sentence template (default: the task's, ruler)")
    parser.add_argument("--tokenizer", choices=("auto", "synthetic"), default="auto", help="needle: the model's tokenizer if it has one (auto) or NeedleVocab ids")
    parser.add_argument("--forward-kwargs", action="append", type=json.loads, default=[], metavar="JSON",
                        help="extra forward keywords as JSON, once for all models or once per model (e.g. '{\"attention_mode\": \"se\"}')")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("eval_output"))
    return parser


def _split_model(spec: str) -> tuple[str, str]:
    label, sep, path = spec.partition("=")
    if sep and label and path:
        return label, path
    return Path(spec).name or spec, spec


def _forward_kwargs(raw: dict) -> dict:
    kwargs = dict(raw)
    if isinstance(kwargs.get("sparse_config"), dict):  # JSON cannot carry the dataclass itself
        from ..sparse import SparseInferenceConfig

        kwargs["sparse_config"] = SparseInferenceConfig.from_dict(kwargs["sparse_config"])
    return kwargs


def load_model(path: str, device: str, dtype: torch.dtype):
    import hf_hybrid  # noqa: F401  (registers the architectures)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(path).is_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=local).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
    except Exception:  # no tokenizer files: synthetic-vocabulary models
        tokenizer = None
    return model, tokenizer


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *map(line, rows)])


def _loss_data(args, lengths: list[int], tokenizer, vocab_size: int | None):
    """Equal-length sequences of max(lengths) + 1 tokens (so that P(max length) is defined)."""
    need, count = max(lengths) + 1, args.num_examples or 16
    if args.data == "language":
        language = LANGUAGE_PRESETS[args.language]
        if vocab_size is not None and vocab_size < language.vocab_size:
            raise SystemExit(
                f"--data language needs a model with vocab_size >= {language.vocab_size} trained on "
                f"hf_hybrid.data.make_language_dataset; this one has {vocab_size}. Pass --data FILE.txt instead."
            )
        return make_language_dataset(count, need, language, seed=args.seed)["input_ids"]
    source = Path(args.data)
    if source.is_dir():
        from datasets import load_from_disk

        rows = [r[:need] for r in load_from_disk(str(source))["input_ids"] if len(r) >= need][:count]
    elif source.is_file():
        if tokenizer is None:
            raise SystemExit(f"--data {source} is text, but the model folder has no tokenizer to read it with.")
        ids = tokenizer(source.read_text(), add_special_tokens=False)["input_ids"]
        rows = [ids[i : i + need] for i in range(0, len(ids) - need + 1, need)][:count]
    else:
        raise SystemExit(f"--data must be 'language', a .txt file or a dataset folder; {args.data!r} is none of these.")
    if not rows:
        raise SystemExit(f"--data {args.data}: no sequence of {need} tokens (max --lengths + 1) in it.")
    return rows


def run_loss_by_position(args, models) -> dict:
    lengths = args.lengths or [64, 128, 256, 512]
    results, curves, perplexities = {}, {}, {}
    for (label, path), kwargs in models:
        model, tokenizer = load_model(path, args.device, DTYPES[args.dtype])
        rows = _loss_data(args, lengths, tokenizer, model.config.vocab_size)  # same seed: same data for every model
        result = per_token_loss(model, rows, batch_size=args.batch_size, **kwargs)
        results[label] = {"path": path, "forward_kwargs": args.forward_kwargs_raw.get(label, {}), **_summary(result, lengths)}
        curves[label], perplexities[label] = result.loss.tolist(), results[label]["perplexity"]
        del model
    if args.oracle and args.data == "language":
        oracle = PositionLoss(loss=torch.tensor(oracle_loss_by_position(rows, LANGUAGE_PRESETS[args.language]), dtype=torch.float64),
                              count=torch.full((len(rows[0]) - 1,), len(rows)))
        results["oracle"] = {"path": None, **_summary(oracle, lengths)}
        curves["oracle"], perplexities["oracle"] = oracle.loss.tolist(), results["oracle"]["perplexity"]
    headers = ["model", *(f"L({lo},{hi}]" for lo, hi in zip([0, *lengths[:-1]], lengths)), *(f"PPL({l})" for l in lengths)]
    rows = [[label, *(f"{v:.3f}" for v in r["bucket_loss"]), *(f"{r['perplexity'][l]:.2f}" for l in lengths)] for label, r in results.items()]
    return {"lengths": lengths, "models": results, "table": format_table(headers, rows), "_plot": (curves, perplexities)}


def _summary(result: PositionLoss, lengths: list[int]) -> dict:
    return {"perplexity": result.perplexity(lengths), "bucket_loss": result.bucketed(lengths), **result.to_dict()}


def run_needle(args, models) -> dict:
    lengths = args.lengths or [256, 512]
    task = resolve_task(args.needle_task, **({"template": args.template} if args.template else {}))
    results, grids = {}, {}
    for (label, path), kwargs in models:
        model, tokenizer = load_model(path, args.device, DTYPES[args.dtype])
        if args.tokenizer == "synthetic" or tokenizer is None:
            tokenizer = None
            if model.config.vocab_size < NeedleVocab().size:
                raise SystemExit(f"{label}: the synthetic needle vocabulary has {NeedleVocab().size} tokens but the model only {model.config.vocab_size}.")
        dataset = make_needle_dataset(args.num_examples or 4, task, lengths, args.depths, seed=args.seed, tokenizer=tokenizer)
        grid = needle_accuracy(model, dataset, batch_size=args.batch_size, **kwargs)
        results[label] = {"path": path, "tokenizer": "model" if tokenizer is not None else "NeedleVocab", **grid.to_dict()}
        grids[label] = grid
        del model
    headers = ["model", *(f"len {l}" for l in lengths), "mean"]
    rows = [[label, *(f"{g.by_length()[l]:.1%}" for l in lengths), f"{g.mean:.1%}"] for label, g in grids.items()]
    return {"task": task.label, "lengths": lengths, "depths": args.depths, "models": results, "table": format_table(headers, rows), "_plot": grids}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda was given but no CUDA device is available; use --device cpu")
    if args.num_examples is not None and args.num_examples < 1:
        parser.error("--num-examples must be >= 1")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.task == "needle" and not all(0.0 <= d <= 1.0 for d in args.depths):
        parser.error("--depths must lie in [0, 1]")
    specs = [_split_model(m) for m in args.models]
    if len({label for label, _ in specs}) != len(specs):
        parser.error("two models share a label; name them LABEL=PATH")
    if len(args.forward_kwargs) not in (0, 1, len(specs)):
        parser.error(f"--forward-kwargs must be given once (all models) or once per model ({len(specs)}), got {len(args.forward_kwargs)}")
    raw = args.forward_kwargs * len(specs) if len(args.forward_kwargs) == 1 else args.forward_kwargs or [{}] * len(specs)
    args.forward_kwargs_raw = {label: r for (label, _), r in zip(specs, raw)}
    models = [(spec, _forward_kwargs(r)) for spec, r in zip(specs, raw)]

    out = run_loss_by_position(args, models) if args.task == "loss-by-position" else run_needle(args, models)
    plot_data = out.pop("_plot")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.task.replace("-", "_")
    payload = {"task": args.task, "command": "hf-hybrid eval " + " ".join(sys.argv[1:] if argv is None else argv), **out}
    (args.output_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1, default=str))
    png = args.output_dir / f"{stem}.png"
    try:
        from .plots import plot_loss_by_position, plot_needle_heatmaps

        if args.task == "loss-by-position":
            plot_loss_by_position(plot_data[0], png, plot_data[1])
        else:
            plot_needle_heatmaps(plot_data, png, title=f"needle: {out['task']}")
        wrote = f" and {png}"
    except ImportError as error:
        wrote = f" (no PNG: {error})"
    print(out["table"])
    print(f"\nwrote {args.output_dir / (stem + '.json')}{wrote}")
    return payload


if __name__ == "__main__":
    main()
