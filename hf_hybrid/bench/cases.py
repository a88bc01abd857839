"""What a benchmark is: a :class:`Case` compares named variants of one computation at one shape.

Every bench module (ops, layers, model, and the other architectures' modules) exposes
``cases(config: BenchConfig) -> list[Case]``. A variant is a *builder*: called once, it allocates
its inputs and returns a zero-argument callable, the thing that is timed, or ``(callable, info)``
where ``info`` is a dict the report keeps (``info["tokens"]``: tokens produced per call, which
turns a "tokens/s" case's median time into a throughput). Builders run one at a
time and their tensors are dropped before the next, so large shapes of different variants never
share the GPU. The first variant of a case is its baseline; ratios are baseline time / variant time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Builder = Callable[[], Callable[[], object]]


@dataclass
class BenchConfig:
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    quick: bool = False  # a few small shapes: for smoke runs (CPU) and quick looks
    flex: bool = False  # also time torch's flex_attention where a case offers it (compiles per shape)
    warmup: int = 3
    repeat: int = 10
    seqs: tuple[int, ...] | None = None  # override a module's default sequence lengths
    budget_s: float | None = None  # wall-clock cap of a time-budgeted suite (the models suite), seconds

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Case:
    group: str  # "op", "layer", "model", or an architecture's own label
    name: str  # what is measured, e.g. "RAT(L=16) attention fwd+bwd"
    params: dict  # the shape: seq, batch, position, ...
    variants: dict[str, Builder]  # label -> builder; the first entry is the baseline
    unit: str = "ms"  # "ms" (lower is better) or "tokens/s" (higher is better)
    x_key: str = "seq"  # the parameter plotted on the x axis
    repeat: int | None = None  # overrides BenchConfig.repeat for very long cases
    notes: str = ""

    @property
    def baseline(self) -> str:
        return next(iter(self.variants))
