"""The RAT+ joint-step benchmark (benchmarks/rat_plus_joint_step.py) on its CPU-sized path: a row per
variant with the loss of its own objective, and the summary's ratios from those rows."""
from __future__ import annotations

import json

import pytest

from benchmarks.rat_plus_joint_step import main, summary


def test_cpu_run_measures_every_variant(tmp_path):
    out = tmp_path / "rows.jsonl"
    rows = main(["--device", "cpu", "--tiny", "--seq", "48", "--warmup", "0", "--repeat", "1", "--kept-graphs", "--json", str(out)])
    by = {row["variant"]: row for row in rows}
    assert set(by) == {"dense", "d64", "joint", "joint_kept_graphs", "summary"}
    assert all(by[v]["ms"] > 0 and by[v]["seq"] == 48 and by[v]["peak_gib"] is None for v in ("dense", "d64", "joint"))
    # Same weights and tokens: the joint loss is the sum of the two passes' losses, on either path.
    assert by["joint"]["loss"] == pytest.approx(by["dense"]["loss"] + by["d64"]["loss"], abs=2e-4)
    assert by["joint_kept_graphs"]["loss"] == pytest.approx(by["joint"]["loss"], abs=1e-4)
    ratio = by["joint"]["ms"] / (by["dense"]["ms"] + by["d64"]["ms"])
    assert by["summary"]["joint_over_passes_time"] == pytest.approx(ratio, abs=1e-3)
    assert [json.loads(line)["variant"] for line in out.read_text().splitlines()] == [r["variant"] for r in rows]


def test_summary_ratios_of_gpu_rows():
    rows = [dict(variant="dense", seq=8, ms=10.0, peak_gib=4.0), dict(variant="d64", seq=8, ms=8.0, peak_gib=3.0),
            dict(variant="joint", seq=8, ms=18.9, peak_gib=4.2), dict(variant="joint_kept_graphs", seq=8, ms=18.0, peak_gib=7.0)]
    result = summary(rows)
    assert result["joint_over_passes_time"] == 1.05 and result["joint_over_dense_peak"] == 1.05
    assert result["kept_graphs_over_dense_peak"] == 1.75 and result["kept_graphs_over_passes_time"] == 1.0
