"""The FoX length-extrapolation reproduction's cpu preset runs end to end through the CLI and writes its outputs."""
from __future__ import annotations

import json

import pytest

from hf_hybrid.reproduce.__main__ import main
from hf_hybrid.reproduce.fox import PRESETS


@pytest.mark.slow  # a CPU preset end to end (~1 min on a 2-core CI runner); HF_HYBRID_SLOW=1 runs it
def test_fox_cpu_preset_writes_table_plot_and_per_seed_numbers(tmp_path):
    assert main(["fox", "--preset", "cpu", "--out", str(tmp_path), "--seeds", "0,1"]) == 0
    for suffix in ("md", "png", "json"):
        assert (tmp_path / f"fox.{suffix}").stat().st_size > 0
    report = json.loads((tmp_path / "fox.json").read_text())
    raw = report["raw"]
    assert raw["seeds"] == [0, 1]
    assert set(raw["models"]) == set(PRESETS["cpu"]["models"])
    eval_positions = raw["eval_length"]
    for entry in raw["models"].values():
        assert set(entry["per_seed"]) == {"0", "1"}
        for run in entry["per_seed"].values():
            assert len(run["per_token_loss"]) == eval_positions
            for key in ("within", "beyond", "gap", "final_train_loss"):
                assert isinstance(run[key], float)
        assert set(entry["mean"]) >= {"within", "beyond", "gap"}
    outcome = report["outcome"]
    assert any("beyond T_train in every seed" in claim for claim in outcome)
    assert any("rises beyond T_train" in claim for claim in outcome)
    assert all(isinstance(held, bool) for held in outcome.values())
    table = (tmp_path / "fox.md").read_text()
    assert "FoX (Pro)" in table and "Transformer (Pro)" in table and "Scale gap" in table
