"""benchmarks/compile_cost.py: its catalogue matches the kernels' signatures, and a tiny case compiles
for sm_90 (no GPU needed) and reports seconds, registers and autotune configurations."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import compile_cost

ROOT = Path(__file__).resolve().parents[2]


def _declared(kernel: str) -> tuple[list[str], set[str]]:
    """(argument names, constexpr names) as the kernel's Python function declares them."""
    fn = compile_cost._module(kernel)
    fn = getattr(fn, "jit_function", fn)
    fn = getattr(fn, "fn", fn)  # autotuner -> JIT (or interpreted) function
    fn = getattr(fn, "fn", fn)  # -> the Python function
    params = inspect.signature(fn).parameters
    return list(params), {n for n, p in params.items() if "constexpr" in str(p.annotation)
                          and p.default is inspect.Parameter.empty}


def test_every_catalogued_launch_names_the_kernels_arguments_and_constexprs():
    paths = compile_cost.catalogue()
    assert {(p.arch, p.path) for p in paths} >= {("rat", "train"), ("rat", "generate"), ("se_hybrid", "train"),
                                                  ("se_hybrid", "generate")}
    for path in paths:
        assert path.launches, path
        for launch in path.launches:
            names, constexprs = _declared(launch.kernel)
            tuned = {k for c in compile_cost.autotune_configs(launch.kernel) for k in c.kwargs}
            assert set(launch.constexprs) <= set(names), (launch.kernel, set(launch.constexprs) - set(names))
            missing = constexprs - set(launch.constexprs) - tuned
            assert not missing, f"{launch.kernel}: constexprs {missing} not given"
            typed = set(launch.types) & set(names)
            assert typed and not typed & constexprs, launch.kernel


def test_fox_portable_launches_build_one_tile_each_unless_autotuning_is_on():
    from hf_hybrid import options
    from hf_hybrid.kernels.forgetting_attention import triton as fa

    def fox_launches():
        return next(p for p in compile_cost.catalogue() if p.arch == "fox").launches

    with options.override(HF_HYBRID_AUTOTUNE=None):
        launches = fox_launches()
        assert len(launches) == 3 and not any(l.tuned for l in launches)
        for launch, kind in zip(launches, ("fwd", "dkdv", "dq")):
            tile = fa.portable_tile(kind, compile_cost.TOKENS, compile_cost.HEAD_DIM, torch.bfloat16)
            assert {k: launch.constexprs[k] for k in tile.kwargs} == tile.kwargs
            assert (launch.num_warps, launch.num_stages) == (tile.num_warps, tile.num_stages)
    with options.override(HF_HYBRID_AUTOTUNE="1"):
        assert all(l.tuned and "BLOCK_M" not in l.constexprs for l in fox_launches())


def test_rat_keys_values_launches_use_the_shipped_unroll():
    from hf_hybrid.kernels.gated_recurrence import rat_keys_values_triton as kv

    launches = {l.kernel.split(":")[1]: l for l in compile_cost.catalogue()[0].launches if "rat_keys_values" in l.kernel}
    assert launches["_fwd_kernel"].constexprs["UNROLL"] == kv.unroll_for(compile_cost.CHUNK, kv.FWD_UNROLL)
    assert launches["_bwd_kernel"].constexprs["UNROLL"] == kv.unroll_for(compile_cost.CHUNK, kv.BWD_UNROLL)


def test_unroll_for_divides_the_chunk():
    from hf_hybrid.kernels.gated_recurrence.rat_keys_values_triton import unroll_for

    for chunk in range(1, 70):
        for most in (1, 2, 4, 8):
            u = unroll_for(chunk, most)
            assert chunk % u == 0 and 1 <= u <= most and u & (u - 1) == 0


def test_a_tiny_case_compiles_for_sm90_and_reports_its_seconds(tmp_path):
    """The script in its own process (kernels defined under the CPU interpreter cannot compile)."""
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_cost", "--kernel", "_rms_norm_bwd", "--json", str(out)],
        cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    # The backbone norm's backward, in every training path: built once, by the first.
    assert [(r["arch"], r["path"]) for r in rows] == [("rat", "train"), ("rat_plus", "train"), ("rattention", "train"),
                                                      ("se_hybrid", "train")]
    row, *again = rows
    assert row["configs"] == 1 and row["seconds"] > 0 and not row["shared"] and all(r["shared"] for r in again)
    [built] = row["compiled"]
    assert "error" not in built and 0 < built["regs"] <= 255
    assert "_rms_norm_bwd_kernel" in done.stdout and "total compile s" in done.stdout


def test_report_rows_are_timed_per_compile_and_the_helpers_put_back(monkeypatch):
    """_timed_report on a stand-in report: one timed row per compile, errors kept, helpers restored."""
    from benchmarks.sm90 import _resources

    module = _resources()
    monkeypatch.setattr(module, "compile_for_sm90", lambda *args, **kwargs: {"regs": 40, "stack_bytes": 0})
    before = (module.compile_for_sm90, module.compile_gluon_for_sm90, module._wgmma_serialized)

    def report():
        rows = []
        for name in ("_a_kernel", "_b_kernel"):
            rows.append(dict(kernel=name, **module.compile_for_sm90(None, {}, {}, 4)))
        rows.append({"kernel": "_c_kernel", "error": "ValueError: no"})
        return rows

    rows = compile_cost._timed_report(report, "stand-in")
    assert [r["kernel"] for r in rows] == ["_a_kernel", "_b_kernel", "_c_kernel"]
    assert all(r["compiled"][0]["cpu_s"] >= 0 and r["compiled"][0]["regs"] == 40 for r in rows[:2])
    assert rows[2]["compiled"][0]["error"].startswith("ValueError")
    assert (module.compile_for_sm90, module.compile_gluon_for_sm90, module._wgmma_serialized) == before
    assert {arch for arch, *_ in compile_cost.REPORTS} == {"rattention", "fox"}
