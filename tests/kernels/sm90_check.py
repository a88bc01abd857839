"""Ahead-of-time sm_90 compiles for the tests: Triton's bundled ptxas builds a kernel for the H100
on any machine, which catches kernels that the CPU interpreter runs but the real target rejects."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _json_from_fresh_process(code: str):
    """What ``code`` prints last, as JSON, run in a fresh process (the test session sets
    TRITON_INTERPRET=1, under which kernels cannot be compiled)."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sm90_report(call: str) -> list[dict]:
    """Rows of ``hf_hybrid.bench.sm90.<call>`` computed in a fresh process."""
    return _json_from_fresh_process(f"import json\nfrom hf_hybrid.bench import sm90\nprint(json.dumps(sm90.{call}))\n")


def sm90_compile(module: str, kernels: dict) -> dict:
    """``hf_hybrid.bench.sm90.compile_for_sm90`` for kernels of ``module`` that have no report there:
    kernels {name: (pointer_dtypes, constexprs, num_warps)} -> {name: resource use}."""
    code = (
        "import importlib, json\nfrom hf_hybrid.bench.sm90 import compile_for_sm90\n"
        f"module = importlib.import_module({module!r})\n"
        f"kernels = {kernels!r}\n"
        "print(json.dumps({name: compile_for_sm90(getattr(module, name), *spec) for name, spec in kernels.items()}))\n"
    )
    return _json_from_fresh_process(code)
