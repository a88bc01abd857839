"""Ahead-of-time sm_90 compiles for the tests: Triton's bundled ptxas builds a kernel for the H100
on any machine, which catches kernels that the CPU interpreter runs but the real target rejects."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helper_process import shared_helper


SM90_RESOURCES = Path(__file__).with_name("sm90_resources.py")
# Makes ``import sm90_resources`` work in a process started elsewhere (the helper, a subprocess), by
# path: neither the repository root nor tests/ goes on sys.path.
LOAD_SM90_RESOURCES = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('sm90_resources', {str(SM90_RESOURCES)!r})\n"
    "sys.modules['sm90_resources'] = module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
)


def _json_from_compile_helper(code: str):
    """What ``code`` prints last, as JSON, run outside the test process (the test session sets
    TRITON_INTERPRET=1, under which kernels cannot be compiled): in one helper process for every
    compile check of the session, so torch and hf_hybrid are imported once, not once per check."""
    pytest.importorskip("triton.backends.nvidia")
    printed = shared_helper("sm90", dict(os.environ, TRITON_INTERPRET="0"), LOAD_SM90_RESOURCES).run(code)
    return json.loads(printed.strip().splitlines()[-1])


def sm90_report(call: str) -> list[dict]:
    """Rows of ``sm90_resources.<call>`` (tests/kernels/sm90_resources.py) computed in the compile helper process."""
    return _json_from_compile_helper(f"import json\nimport sm90_resources\nprint(json.dumps(sm90_resources.{call}))\n")


def sm90_compile(module: str, kernels: dict) -> dict:
    """``sm90_resources.compile_for_sm90`` for kernels of ``module`` that have no report there:
    kernels {name: (pointer_dtypes, constexprs, num_warps)} -> {name: resource use}."""
    code = (
        "import importlib, json\nfrom sm90_resources import compile_for_sm90\n"
        f"module = importlib.import_module({module!r})\n"
        f"kernels = {kernels!r}\n"
        "print(json.dumps({name: compile_for_sm90(getattr(module, name), *spec) for name, spec in kernels.items()}))\n"
    )
    return _json_from_compile_helper(code)
