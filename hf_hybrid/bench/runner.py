"""Run bench modules: collect their cases, time every variant, turn failures into table rows.

A bench module is any importable module with ``cases(config) -> list[Case]``: its cases join the
one ratio table, JSON and PNG. A module with only a ``main(argv)`` (a standalone benchmark script)
is *delegated*: the harness runs it after the table and it prints its own results. The built-in
modules and the other architectures' modules are listed in MODULES; ``register`` adds more. A
module that is not installed is reported and skipped, not fatal.
"""
from __future__ import annotations

import importlib

import torch

from .cases import BenchConfig, Case
from .report import Result
from .timing import free_memory, time_fn

MODULES = {
    "ops": "hf_hybrid.bench.ops",  # RAT / RAT+ operators vs SDPA (and flex)
    "layers": "hf_hybrid.bench.layers",  # RAT / RAT+ layers with projections vs an SDPA layer
    "model": "hf_hybrid.bench.model",  # whole 1.3B-shaped RAT model vs the same model with attention
    "fox": "hf_hybrid.bench.forgetting_attention",  # written with the FoX kernels
    "rattention": "hf_hybrid.bench.rattention",
    "se": "hf_hybrid.bench.se_attention",
    "mamba": "hf_hybrid.bench.mamba",  # the SE hybrid's Mamba-2 mixer (Triton ops) vs Bamba's torch_forward
    "models": "hf_hybrid.bench.models",  # every architecture vs LlamaForCausalLM: train, prefill, generate()
}


def register(name: str, module_path: str) -> None:
    """Add a bench module (``cases(config)``) under a suite name usable with ``--suites``."""
    MODULES[name] = module_path


class Delegated(Exception):
    """Raised by collect() for a module that has main(argv) but no cases(config)."""

    def __init__(self, module):
        super().__init__(module.__name__)
        self.module = module


def collect(suite: str, config: BenchConfig) -> tuple[list[Case], str | None]:
    """The suite's cases, or ([], reason) when its module is missing or fails to build cases.
    Raises :class:`Delegated` for a standalone module (main(argv) only)."""
    path = MODULES.get(suite, suite)
    try:
        module = importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name and path.startswith(exc.name):
            return [], f"module {path} is not written yet"
        return [], f"cannot import {path}: {exc}"
    except Exception as exc:  # a broken module must not stop the other suites
        return [], f"cannot import {path}: {type(exc).__name__}: {exc}"
    if not hasattr(module, "cases"):
        if hasattr(module, "main"):
            raise Delegated(module)
        return [], f"{path} has neither cases(config) nor main(argv)"
    try:
        return list(module.cases(config)), None
    except Exception as exc:
        return [], f"{path}.cases failed: {type(exc).__name__}: {exc}"


def run_delegated(module, config: BenchConfig, log=print) -> str | None:
    """Run a standalone bench module's main([]) (its defaults); returns a reason if it did not run."""
    if not config.on_cuda:
        return f"{module.__name__} is a standalone GPU benchmark; run it on a CUDA device"
    log(f"\n[bench] delegating to {module.__name__}.main([]) (it prints its own table)")
    try:
        module.main([])
    except SystemExit as exc:  # argparse-style exits
        return None if not exc.code else f"{module.__name__}.main exited with {exc.code}"
    except Exception as exc:
        return f"{module.__name__}.main failed: {type(exc).__name__}: {exc}"
    return None


def run_case(case: Case, config: BenchConfig, log=print) -> list[Result]:
    results = []
    for variant, builder in case.variants.items():
        value, status, timing, info = None, "ok", None, None
        free_memory(config.device)
        try:
            built = builder()
            fn, info = built if isinstance(built, tuple) else (built, None)
            # A case may time its variants itself (models.py: whole training steps / generate() calls,
            # a warm-up and a few repeats instead of the usual >= 10).
            custom = getattr(case, "time_variant", None)
            timing = custom(fn, config) if custom else time_fn(fn, config.device, config.warmup, case.repeat or config.repeat)
            value = timing.median_ms
            if timing.first_ms is not None:
                info = dict(info or {}, first_call_ms=round(timing.first_ms, 1))
            if case.unit == "tokens/s":
                value = (info or {}).get("tokens", 1) / (timing.median_ms / 1e3)
        except torch.cuda.OutOfMemoryError:
            status = "OOM"
        except Exception as exc:  # one failing variant still leaves a row in the table
            if type(exc).__name__ == "SkipVariant":  # the variant cannot run here (e.g. needs CUDA)
                status = f"skipped: {exc}"
            elif "out of memory" in str(exc).lower():  # OOM re-raised by a library as another type
                status = "OOM"
            else:
                status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        finally:
            built = fn = None
            free_memory(config.device)
        result = Result(
            group=case.group, name=case.name, params=dict(case.params), variant=variant, baseline=case.baseline,
            unit=case.unit, value=value, status=status, peak_mem_gb=timing.peak_mem_gb if timing else None,
            repeat=timing.repeat if timing else None, notes=case.notes, x_key=case.x_key, info=info,
        )
        results.append(result)
        shown = f"{value:.3f} {case.unit}" if value is not None else status
        if info and info.get("first_call_ms") is not None:
            shown += f" (first call {info['first_call_ms'] / 1e3:.1f} s)"
        log(f"[bench] {case.group} | {case.name} | {case.params} | {variant}: {shown}")
    return results
