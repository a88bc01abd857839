"""First use on a fresh install: each architecture's first training step and first generate(), each
in a fresh process with empty Triton and Inductor caches, within 20 s and 10 s.

    HF_HYBRID_FIRST_USE_OUT=first_use pytest -m gpu tests/gpu/test_first_use_gpu.py -s

The child process (tests/gpu/first_use_check.py) builds 2 layers of the 1.3B shape in bf16 and
times a training step at T = 2048 or generate() of 8 tokens after a 512-token prompt, with every
Triton compile and autotuning it caused per kernel; the JSON of each run is written to the folder
``HF_HYBRID_FIRST_USE_OUT`` names (pytest's temporary folder when unset), and one line per run is
printed. The per-kernel compile seconds there say where a slow first use goes; ``python -m
benchmarks.compile_cost`` compiles the catalogued kernels for sm_90 without a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_hybrid.architectures import ARCHITECTURES

pytestmark = pytest.mark.gpu

CHECK = Path(__file__).with_name("first_use_check.py")
LIMIT_S = {"train": 20.0, "generate": 10.0}
CHILD_TIMEOUT_S = 600


def first_use(model_type: str, mode: str, out_dir: Path, scratch: Path, extra=()) -> dict:
    """Run first_use_check.py for one architecture and mode in a fresh process with empty caches;
    returns its JSON (also left in ``out_dir``)."""
    caches = scratch / f"caches_{model_type}_{mode}"
    env = dict(
        os.environ,
        TRITON_CACHE_DIR=str(caches / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_INTERPRET="0",
    )
    out = out_dir / f"first_use_{model_type}_{mode}.json"
    done = subprocess.run([sys.executable, str(CHECK), "--arch", model_type, "--mode", mode, "--out", str(out), *extra],
                          env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise AssertionError(f"first_use_check.py --arch {model_type} --mode {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _out_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("HF_HYBRID_FIRST_USE_OUT") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _summary(result: dict) -> str:
    slowest = ", ".join(f"{c['kernel'].rsplit('.', 1)[-1]} {c['seconds']:.1f}s x{c['count']}" for c in result["compiles"][:5])
    tuned = ", ".join(f"{a['kernel'].rsplit('.', 1)[-1]} {a['seconds']:.1f}s" for a in result["autotune"][:3])
    inductor = max(result.get("torch_compile", {}).values(), default=0.0)  # the outermost phase holds the others
    halves = (f" (forward {result['first_forward_s']:.1f} s, backward {result['first_backward_s']:.1f} s)"
              if "first_forward_s" in result else "")
    return (f"{result['row']} {result['mode']}: first {result['first_s']:.1f} s{halves}, second {result['second_s']:.2f} s, "
            f"Triton compiles {result['triton_compile_s']:.1f} s ({result['triton_compiles']}); slowest: {slowest}"
            + (f"; autotuned: {tuned}" if tuned else "") + (f"; torch.compile {inductor:.1f} s" if inductor else ""))


@pytest.mark.parametrize("mode", ["train", "generate"])
@pytest.mark.parametrize("model_type", [arch.model_type for arch in ARCHITECTURES])
def test_first_use_is_quick(model_type, mode, tmp_path):
    result = first_use(model_type, mode, _out_dir(tmp_path), tmp_path)
    line = _summary(result)
    print(line)
    assert result["first_s"] <= LIMIT_S[mode], f"first {mode} took {result['first_s']:.1f} s > {LIMIT_S[mode]:.0f} s: {line}"


def test_fox_portable_first_training_step_builds_one_tile_per_kernel(tmp_path, monkeypatch):
    """FoX's portable kernels (GPUs before Hopper; held off the Gluon kernels here) launch the tile
    portable_tile picks: nothing is autotuned, one build per kernel, within the first step's limit."""
    monkeypatch.delenv("HF_HYBRID_AUTOTUNE", raising=False)
    out_dir = _out_dir(tmp_path) / "fox_portable"
    out_dir.mkdir(exist_ok=True)
    result = first_use("fox", "train", out_dir, tmp_path, extra=("--fox-portable",))
    line = _summary(result)
    print("fox portable " + line)
    assert result["fox_portable"] and not result["autotune"], line
    portable = [c for c in result["compiles"] if "forgetting_attention.triton." in c["kernel"]]
    assert portable and all(c["count"] == 1 for c in portable), portable
    assert result["first_s"] <= LIMIT_S["train"], f"first train took {result['first_s']:.1f} s > {LIMIT_S['train']:.0f} s: {line}"
