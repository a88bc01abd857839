"""`hf-hybrid reproduce rattention --preset cpu` writes its table, figure and raw numbers.

Runs the toy preset end to end; asserts the outputs and their structure, not that the paper's effect
holds at this size."""
import json

import pytest

from hf_hybrid.reproduce.__main__ import main
from hf_hybrid.reproduce.rattention import PRESETS


@pytest.mark.slow  # a CPU preset end to end (~1 min on a 2-core CI runner); HF_HYBRID_SLOW=1 runs it
def test_reproduce_rattention_cpu_preset(tmp_path):
    assert main(["rattention", "--preset", "cpu", "--out", str(tmp_path), "--seeds", "0,1"]) == 0
    for suffix in ("md", "png", "json"):
        assert (tmp_path / f"rattention.{suffix}").stat().st_size > 0
    result = json.loads((tmp_path / "rattention.json").read_text())
    windows = PRESETS["cpu"]["windows"]
    names = ["full"] + [f"{kind}_w{w}" for w in windows for kind in ("swa", "rattention")]
    assert sorted(result["raw"]["models"]) == sorted(names)
    for name in names:
        entry = result["raw"]["models"][name]
        assert sorted(entry["per_seed"]) == ["0", "1"]
        for run in entry["per_seed"].values():
            assert 0 < run["loss"] < 10 and 0 < run["far_loss"] < 10
        assert "mean_loss" in entry
    for w in windows:
        assert any(key.startswith(f"rattention_w{w} beats swa_w{w}") for key in result["outcome"])
        assert any(key.startswith(f"rattention_w{w} loss within") for key in result["outcome"])
        assert any(key.startswith(f"rattention_w{w} local-layer cache constant") for key in result["outcome"])
    assert all(isinstance(held, bool) for held in result["outcome"].values())
    # Structural (not a scale effect): full attention's cache grows with the prefill in every layer
    # (its local windows span the whole context), RATTENTION's local layers stay constant.
    short, long = (str(n) for n in PRESETS["cpu"]["prefill_lengths"])
    full = result["raw"]["cache_bytes"]["full"]
    assert full[long]["global"] > full[short]["global"] and full[long]["local"] > full[short]["local"] > 0
    rla = result["raw"]["cache_bytes"][f"rattention_w{windows[0]}"]
    assert rla[long]["local"] == rla[short]["local"]
    table = (tmp_path / "rattention.md").read_text()
    assert "| rattention_w" in table and "Scale gap" in table
