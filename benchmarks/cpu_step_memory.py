"""Peak resident memory of one CPU training step (forward + backward with labels) of each model.

Every model at one small shape (hidden 256, 4 layers, 4 heads, vocab 256, intermediate 512,
float32, batch 1) on the CPU path (reference kernels, SDPA), one model per process: the figure is
the process's peak RSS (``ru_maxrss``) after the step, imports included, so it is what a user's
process needs. Attention-like ops run over blocks of queries on CPU (kernels/_query_blocks.py),
so the peak grows linearly in T.

    python -m benchmarks.cpu_step_memory                      every model at T = 16384
    python -m benchmarks.cpu_step_memory --models se --seq 4096
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import torch

SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)


def _config(name: str):
    import hf_hybrid as H

    builders = {
        "rat": lambda: H.RatConfig(**SHAPE),
        "rat_swa": lambda: H.RatConfig(**SHAPE, layer_types=H.RatConfig.hybrid_layer_types(SHAPE["num_hidden_layers"], "rat")),
        "rat_plus": lambda: H.RatPlusConfig(**SHAPE),  # training_dilations [1, 64]: active recurrence learning
        "rat_plus_dense": lambda: H.RatPlusConfig(**SHAPE, training_dilations=[1]),
        "fox_llama": lambda: H.FoxConfig(**SHAPE, block_type="llama"),
        "fox_pro": lambda: H.FoxConfig(**SHAPE, block_type="pro"),
        "rattention": lambda: H.RattentionConfig(**SHAPE),
        "se": lambda: H.SEHybridConfig(**SHAPE, attention_mode="se"),
        "se_full": lambda: H.SEHybridConfig(**SHAPE, attention_mode="full"),
    }
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; pick from {sorted(builders)}.")
    return builders[name]()


MODELS = ("rat", "rat_swa", "rat_plus", "rat_plus_dense", "fox_llama", "fox_pro", "rattention", "se", "se_full")


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def train_step(name: str, seq: int, seed: int = 0) -> dict:
    """One forward + backward of model ``name`` on ``seq`` random tokens in this process."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(name)).train()
    ids = torch.randint(0, SHAPE["vocab_size"], (1, seq))
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    finite = bool(torch.isfinite(loss)) and all(
        p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()
    )
    return {"model": name, "seq": seq, "peak_rss_bytes": peak_rss_bytes(), "seconds": time.perf_counter() - start,
            "finite": finite}


def measure_in_subprocess(name: str, seq: int, timeout: float | None = None) -> dict:
    """:func:`train_step` in a fresh interpreter (its own peak RSS); returns its JSON result."""
    # This file loaded by path, from a neutral folder: neither benchmarks/ (its profile.py would
    # shadow the standard library's) nor the repository root (its kernels/ folder) goes on sys.path.
    code = (
        "import importlib.util, json, sys; "
        f"spec = importlib.util.spec_from_file_location('cpu_step_memory', {__file__!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        f"print(json.dumps(module.train_step({name!r}, {seq})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise RuntimeError(f"{name} at T={seq} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, out of {', '.join(MODELS)}")
    parser.add_argument("--seq", type=int, default=16384)
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    for name in args.models.split(","):
        result = measure_in_subprocess(name.strip(), args.seq)
        print(f"{result['model']:>15}  T={result['seq']}  peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB  "
              f"{result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
