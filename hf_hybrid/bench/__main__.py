"""Command line of the benchmark harness: ``hf-hybrid bench [options]`` or ``python -m hf_hybrid.bench``.

Examples::

    hf-hybrid bench                                   # every suite, paper shapes, needs a GPU
    hf-hybrid bench --suites ops,layers --seqs 32768  # some suites, one sequence length
    hf-hybrid bench --quick --device cpu              # tiny smoke run of the harness itself

Development diagnostics and tile sweeps are not suites: they are scripts of the repository
(``python -m benchmarks.<name>`` from a checkout, listed in benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from .cases import BenchConfig
from .report import fill_speedups, table, write_json, write_png
from .runner import MODULES, Delegated, collect, run_case, run_delegated

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-hybrid bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", default="ops,layers,model,fox,rattention,se",
                   help=f"comma-separated suites out of {', '.join(MODULES)} (or module paths)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the harness")
    p.add_argument("--flex", action="store_true", help="also time flex_attention variants (compiles per shape)")
    p.add_argument("--seqs", default=None, help="comma-separated sequence lengths overriding the suites' defaults")
    p.add_argument("--only", default=None, help="run only cases whose name contains this text (comma-separated: any of them)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10, help="timed calls per variant (at least 10)")
    p.add_argument("--variants", default=None,
                   help="time only variants whose label contains this text (comma-separated: any of them); "
                        "each case's first variant, its baseline, always runs")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="cap the models suite's wall-clock time: each case gets a share, later variants are reported as skipped")
    p.add_argument("--out", default="bench_results", help="folder for bench.json and bench.png")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p


def matches(name: str, wanted: str) -> bool:
    """Whether ``name`` contains one of the comma-separated parts of ``wanted`` (--only, --variants);
    a part that starts with "=" must equal the name ("=RAT" picks RAT, not RAT-SWA or RAT+)."""
    parts = [part.strip() for part in wanted.split(",") if part.strip()]
    return any(name == part[1:] if part.startswith("=") else part in name for part in parts)


def keep_variants(variants: dict, wanted: str) -> dict:
    """The baseline (first) variant and those whose label matches ``wanted``."""
    return {label: builder for index, (label, builder) in enumerate(variants.items())
            if index == 0 or matches(label, wanted)}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("hf-hybrid bench: --device cuda but no CUDA device is visible; use --device cpu --quick for a smoke run.")
        return 2
    config = BenchConfig(
        device=device, dtype=DTYPES[args.dtype], quick=args.quick, flex=args.flex, warmup=args.warmup,
        repeat=args.repeat, seqs=tuple(int(s) for s in args.seqs.split(",")) if args.seqs else None,
        budget_s=args.budget,
    )
    results, skipped, delegated = [], [], []
    out = Path(args.out)
    command = "hf-hybrid bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    for suite in [s.strip() for s in args.suites.split(",") if s.strip()]:
        try:
            cases, reason = collect(suite, config)
        except Delegated as standalone:
            delegated.append(standalone.module)
            if args.list:
                print(f"{suite} | standalone module {standalone.module.__name__} (runs its own main)")
            continue
        if reason:
            skipped.append(f"{suite}: {reason}")
            print(f"[bench] skipping suite {suite}: {reason}")
        selected = [c for c in cases if args.only is None or matches(c.name, args.only)]
        if args.variants is not None:
            for case in selected:
                case.variants = keep_variants(case.variants, args.variants)
        for schedule in {id(c.schedule): c.schedule for c in cases if hasattr(c, "schedule")}.values():
            schedule.keep([c.name for c in selected])  # a time-budgeted suite shares its budget among these
        for case in cases if args.list else selected:
            if args.list:
                print(f"{case.group} | {case.name} | {case.params} | {', '.join(case.variants)}")
            else:
                results.extend(run_case(case, config))
                out.mkdir(parents=True, exist_ok=True)
                write_json(results, out / "bench.json", command)  # after every case: a run cut short keeps its rows
    if args.list:
        return 0
    fill_speedups(results)
    print()
    print(table(results, markdown=args.markdown))
    for module in delegated:
        reason = run_delegated(module, config) if args.only is None else "--only given"
        if reason:
            skipped.append(f"{module.__name__}: {reason}")
    for line in skipped:
        print(f"skipped {line}")
    out.mkdir(parents=True, exist_ok=True)
    write_json(results, out / "bench.json", command)
    markdown = table(results, markdown=True)
    if any(r.group == "models" for r in results):  # the per-model summary of the models suite
        from dataclasses import asdict

        from .models import summary_markdown

        markdown += "\n\n" + summary_markdown([asdict(r) for r in results])
    (out / "bench.md").write_text(f"`{command}`\n\n{markdown}\n")
    wrote_png = write_png(results, out / "bench.png")
    why_no_png = " (no PNG: no timed results)" if not any(r.value is not None for r in results) else " (no PNG: matplotlib missing)"
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}" + (f" and {out / 'bench.png'}" if wrote_png else why_no_png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
