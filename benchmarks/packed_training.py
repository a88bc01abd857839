"""A packed training step against one long document of the same length, for every architecture.

    python -m benchmarks.packed_training [--docs 8] [--doc-len 4096] [--layers 8] [--json OUT]

Shape: the models suite's (8 layers of the 1.3B shape, bf16, B=1). "packed" is one row of
``docs`` documents of ``doc-len`` tokens (position_ids restarting at each, labels -100 at each
document's first token, as DataCollatorWithFlattening builds them); "one document" is a single
sequence of docs x doc-len tokens. Each cell: model(...).loss.backward(), median of --repeat steps
after one warm-up. The packed step computes each document alone (hf_hybrid/models/packed_sequences.py).
"""
from __future__ import annotations

import argparse
import json

import torch

from hf_hybrid.bench.cases import BenchConfig
from hf_hybrid.bench.models import architectures, build_ours
from hf_hybrid.bench.timing import latency_ms


def _time_step(model, batch: dict, repeat: int) -> float:
    def step():
        model(**batch, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    return latency_ms(step, warmup=1, repeat=repeat)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated architecture names (default: all that train)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    config = BenchConfig(device=torch.device("cuda"), dtype=torch.bfloat16)
    total = args.docs * args.doc_len
    ids = torch.randint(3, 32000, (1, total), device="cuda")
    positions = torch.arange(args.doc_len, device="cuda").repeat(args.docs)[None]
    packed_labels = ids.masked_fill(positions == 0, -100)
    rows = []
    wanted = {n.strip() for n in args.only.split(",") if n.strip()}
    for arch in architectures(quick=False):
        if not arch.trains or (wanted and arch.name not in wanted):
            continue
        model = build_ours(arch, config).train()
        single = _time_step(model, {"input_ids": ids, "labels": ids}, args.repeat)
        packed = _time_step(model, {"input_ids": ids, "labels": packed_labels, "position_ids": positions}, args.repeat)
        rows.append({"model": arch.name, "one_document_ms": single, "packed_ms": packed, "ratio": packed / single})
        print(f"| {arch.name} | {single:.1f} | {packed:.1f} | {packed / single:.2f}x |", flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"\n{args.docs} x {args.doc_len} packed vs one {total}-token document, {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"docs": args.docs, "doc_len": args.doc_len, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
