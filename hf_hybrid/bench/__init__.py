"""Benchmark harness: ``hf-hybrid bench`` / ``python -m hf_hybrid.bench``.

Op, layer and whole-model speed against SDPA attention (and flex_attention where available) in the
same process, CUDA-event timing (warm-up, median of >= 10), a printed ratio table, JSON and a PNG.
Each architecture contributes a module with ``cases(config) -> list[Case]`` (see cases.py);
``runner.MODULES`` lists them and ``runner.register`` adds one.
"""
from .cases import BenchConfig, Case
from .report import Result
from .runner import MODULES, register

__all__ = ["BenchConfig", "Case", "MODULES", "Result", "register", "main"]


def main(argv=None) -> int:
    from .__main__ import main as _main

    return _main(argv)
