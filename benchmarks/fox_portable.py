"""``hf-hybrid bench`` with FoX on its portable Triton kernels where the Gluon (Hopper) kernels would
run: the A/B of the Hopper kernels at the layer or whole-model level (the op-level rows are the FoX
suite's ``ours_portable`` and ``ours_portable_bwd``).

    python -m benchmarks.fox_portable --suites models --only "train T=8K,prefill T=32K" --variants FoX
    python -m benchmarks.fox_portable --backward-only --suites models --only "train T=8K" --variants FoX

Every other argument is ``hf-hybrid bench``'s; compare with the same command through ``hf-hybrid bench``.
"""
from __future__ import annotations

import sys

from hf_hybrid.bench import main as bench_main
from hf_hybrid.bench.forgetting_attention import portable_kernels


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    backward_only = "--backward-only" in argv
    argv = [arg for arg in argv if arg != "--backward-only"]
    with portable_kernels(forward=not backward_only):
        return bench_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
