"""``hf-hybrid reproduce NAME [--preset cpu|gpu] [--out DIR] [--seeds 0,1] [--set key=value ...]``."""
from __future__ import annotations

import argparse
import importlib
import shlex
import sys

import torch

from ..cli import parse_overrides
from . import REPRODUCTIONS
from .report import write_reproduction


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hf-hybrid reproduce", description=__doc__)
    parser.add_argument("name", choices=REPRODUCTIONS)
    parser.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--out", default="reproductions")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (at least two for the deciding comparison)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override preset settings")
    args = parser.parse_args(argv)
    module = importlib.import_module(f"hf_hybrid.reproduce.{args.name}")
    settings = {**module.PRESETS[args.preset], **parse_overrides(args.set)}
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    if args.preset == "gpu" and not torch.cuda.is_available():
        print("hf-hybrid reproduce: the gpu preset needs a CUDA device; use --preset cpu.", file=sys.stderr)
        return 2
    result = module.run(settings, args.out, seeds)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    paths = write_reproduction(result, args.out, settings, "hf-hybrid reproduce " + shlex.join(argv), device)
    print(result.table)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
