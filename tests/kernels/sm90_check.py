"""Ahead-of-time sm_90 compiles for the tests: Triton's bundled ptxas builds a kernel for the H100
on any machine, which catches kernels that the CPU interpreter runs but the real target rejects."""
from __future__ import annotations

import json
import os

import pytest

from helper_process import shared_helper


def _json_from_compile_helper(code: str):
    """What ``code`` prints last, as JSON, run outside the test process (the test session sets
    TRITON_INTERPRET=1, under which kernels cannot be compiled): in one helper process for every
    compile check of the session, so torch and hf_hybrid are imported once, not once per check."""
    pytest.importorskip("triton.backends.nvidia")
    printed = shared_helper("sm90", dict(os.environ, TRITON_INTERPRET="0")).run(code)
    return json.loads(printed.strip().splitlines()[-1])


def sm90_report(call: str) -> list[dict]:
    """Rows of ``hf_hybrid.bench.sm90.<call>`` computed in the compile helper process."""
    return _json_from_compile_helper(f"import json\nfrom hf_hybrid.bench import sm90\nprint(json.dumps(sm90.{call}))\n")


def sm90_compile(module: str, kernels: dict) -> dict:
    """``hf_hybrid.bench.sm90.compile_for_sm90`` for kernels of ``module`` that have no report there:
    kernels {name: (pointer_dtypes, constexprs, num_warps)} -> {name: resource use}."""
    code = (
        "import importlib, json\nfrom hf_hybrid.bench.sm90 import compile_for_sm90\n"
        f"module = importlib.import_module({module!r})\n"
        f"kernels = {kernels!r}\n"
        "print(json.dumps({name: compile_for_sm90(getattr(module, name), *spec) for name, spec in kernels.items()}))\n"
    )
    return _json_from_compile_helper(code)
