"""`hf-hybrid reproduce se --preset cpu`: the four fine-tuning cells x two seeds run and write their outputs.

Asserts the outputs' shape (files, per-seed numbers, the outcome checks), not that the paper's effect
holds at toy size.
"""
import json

import pytest

from hf_hybrid.reproduce import se
from hf_hybrid.reproduce.__main__ import main


@pytest.mark.slow  # ~100 s on CPU: the four fine-tuning cells x two seeds
def test_reproduce_se_cpu_preset_writes_table_plot_and_raw_numbers(tmp_path):
    assert main(["se", "--preset", "cpu", "--out", str(tmp_path), "--seeds", "0,1"]) == 0
    for suffix in ("md", "png", "json"):
        assert (tmp_path / f"se.{suffix}").stat().st_size > 0
    result = json.loads((tmp_path / "se.json").read_text())
    assert result["name"] == "se" and result["paper"] == se.PAPER
    per_seed = result["raw"]["per_seed"]
    assert sorted(per_seed) == ["0", "1"]
    cells = {se.cell_name(mode, adapter) for mode, adapter in se.CELLS}
    assert cells == {"swa+lora", "swa+hylora", "se+lora", "se+hylora"}
    for run in per_seed.values():
        assert set(run["cells"]) == cells
        assert 0.0 <= run["recall_at_4L_before"]["full"] <= 1.0
        for cell in run["cells"].values():
            assert 0.0 <= cell["recall_full"] <= 1.0 and 0.0 <= cell["recall_own_mode"] <= 1.0
            assert cell["trainable_parameters"] > 0
        # HyLoRA trains the LoRA adapters plus embeddings, norms and conv1d: strictly more than LoRA.
        assert run["cells"]["se+hylora"]["trainable_parameters"] > run["cells"]["se+lora"]["trainable_parameters"]
    for cell in cells:  # the reported mean is the mean of the per-seed values
        values = [run["cells"][cell]["recall_full"] for run in per_seed.values()]
        assert abs(result["raw"]["mean"][cell]["recall_full"] - sum(values) / len(values)) < 1e-9
    assert set(result["outcome"]) == set(se.outcome_checks(result["raw"]["mean"], {int(k): v for k, v in per_seed.items()}))
    assert all(isinstance(held, bool) for held in result["outcome"].values())
    table = (tmp_path / "se.md").read_text()
    assert "SE-Attn + HyLoRA" in table and "Scale gap" in table and "## Checks" in table
