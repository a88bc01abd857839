"""The whole-model bench suite (hf_hybrid/bench/models.py) as CI runs it: ``--quick --device cpu``."""
from __future__ import annotations

import json

import pytest
import torch

from hf_hybrid.bench import models
from hf_hybrid.bench.__main__ import main as bench_main
from hf_hybrid.bench.cases import BenchConfig
from hf_hybrid.bench.runner import MODULES, collect

CPU = BenchConfig(device=torch.device("cpu"), dtype=torch.float32, quick=True)


def test_suite_is_registered_and_lists_every_architecture_against_llama():
    assert MODULES["models"] == "hf_hybrid.bench.models"
    cases, reason = collect("models", CPU)
    assert reason is None
    names = [case.name for case in cases]
    assert names == ["train T=64", "train T=128", "prefill T=128", "decode B=2 prompt=32 new=4", "decode B=2 prompt=64 new=4"]
    ours = [arch.name for arch in models.architectures(quick=True)]
    assert ours == ["RAT", "RAT-SWA", "RAT+", "RAT+ D=16", "FoX (llama)", "FoX (pro)", "RATTENTION", "SE hybrid"]
    for case in cases:
        assert list(case.variants)[:2] == ["Llama", "Llama+Liger"]  # Llama is every case's baseline
        expected = [a.name for a in models.architectures(True) if a.trains or not case.name.startswith("train")]
        assert [v for v in case.variants if v in ours] == expected
        assert ("Llama static" in case.variants) == case.name.startswith("decode")
        assert (models.LLAMA_OUR_KERNELS in case.variants) == case.name.startswith("train")


def test_quick_cpu_run_writes_json_and_markdown_with_every_model(tmp_path):
    out = tmp_path / "bench"
    assert bench_main(["--suites", "models", "--quick", "--device", "cpu", "--dtype", "fp32",
                       "--only", "prefill,decode B=2 prompt=32", "--out", str(out)]) == 0
    results = json.loads((out / "bench.json").read_text())["results"]
    assert {r["name"] for r in results} == {"prefill T=128", "decode B=2 prompt=32 new=4"}
    for r in results:
        if r["variant"] == "Llama+Liger":  # Liger's kernels need CUDA
            assert r["status"].startswith("skipped") and r["value"] is None
        else:
            assert r["status"] == "ok" and r["value"] > 0, r
    decode = [r for r in results if r["name"].startswith("decode") and r["value"] is not None]
    assert len(decode) == 10  # Llama, Llama static and our 8 models
    for r in decode:  # tokens/s counts the B x (new - 1) tokens after the first; prefill kept apart
        assert r["info"]["tokens"] == 2 * 3
        assert 0 < r["info"]["prefill_ms"] < r["info"]["generate_ms"]
    for r in results:  # every cell that ran timed its first call (the warm-up: compiles, autotuning)
        if r["value"] is not None:
            assert r["info"]["first_call_ms"] > 0, r
    summary = (out / "bench.md").read_text()
    assert "| RAT+ D=16 |" in summary and "(1.00x)" in summary  # the per-model table, Llama = 1.00x


def test_summary_compares_with_the_fastest_llama():
    def row(name, variant, value, unit="ms", peak=None):
        return {"group": "models", "name": name, "variant": variant, "value": value, "unit": unit,
                "status": "ok" if value is not None else "OOM", "peak_mem_gb": peak}

    results = [row("train T=8K", "Llama", 200.0, peak=10.0), row("train T=8K", "Llama+Liger", 100.0, peak=8.0),
               row("train T=8K", "RAT", 50.0, peak=6.0), row("train T=8K", "FoX (pro)", None),
               row("decode B=8", "Llama", 100.0, "tokens/s"), row("decode B=8", "Llama static", 400.0, "tokens/s"),
               row("decode B=8", "RAT", 800.0, "tokens/s")]
    text = models.summary_markdown(results)
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "50.0 (2.00x), 6.0 GB" in lines["RAT"]  # against Llama+Liger, the faster Llama
    assert "800 (2.00x)" in lines["RAT"]  # against Llama static, the faster decode
    assert "OOM" in lines["FoX (pro)"]
    results.append(row("train T=8K", models.LLAMA_OUR_KERNELS, 80.0))  # the fastest Llama is the baseline
    lines = {line.split(" | ")[0].strip("| "): line for line in models.summary_markdown(results).splitlines()}
    assert "50.0 (1.60x), 6.0 GB" in lines["RAT"]


def test_llama_with_our_kernels_has_the_same_loss():
    """The baseline row with our loss and norm (the fused kernels on CUDA; on the CPU float32
    logits and our RMSNorm's PyTorch lines)."""
    config = CPU if not torch.cuda.is_available() else BenchConfig(device=torch.device("cuda"), dtype=torch.float32, quick=True)
    plain = models.build_llama(config)
    ours = models.with_package_kernels(models.build_llama(config))
    ours.load_state_dict(plain.state_dict())
    ids = torch.randint(3, 200, (1, 64), device=config.device)
    torch.testing.assert_close(ours(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)


def test_summary_shows_each_models_first_training_step():
    def row(name, variant, value, first_ms=None):
        return {"group": "models", "name": name, "variant": variant, "value": value, "unit": "ms", "status": "ok",
                "peak_mem_gb": None, "info": {"first_call_ms": first_ms} if first_ms is not None else None}

    results = [row("train T=8K", "Llama", 100.0, 2500.0), row("train T=8K", "RAT", 50.0, 14200.0),
               row("train T=32K", "RAT", 200.0, 900.0), row("train T=8K", "FoX (pro)", 60.0)]
    text = models.summary_markdown(results)
    assert "first step, train T=8K (s)" in text.splitlines()[0]
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["RAT"].endswith("| 14.2 |") and lines["Llama"].endswith("| 2.5 |")
    assert lines["FoX (pro)"].endswith("| - |")  # no first call recorded


def test_liger_llama_variant_is_skipped_without_cuda():
    with pytest.raises(models.SkipVariant, match="CUDA"):
        models.build_llama(CPU, liger=True)


def test_time_budget_skips_variants_past_their_case_share():
    budget = models.TimeBudget(0.0, {"a": 1.0, "b": 1.0})
    assert budget.guard("a", lambda: "built")() == "built"  # the clock starts with the first variant
    with pytest.raises(models.SkipVariant, match="--budget"):
        budget.guard("b", lambda: "built")()
    assert models.TimeBudget(None, {"a": 1.0}).guard("a", lambda: "built")() == "built"  # no budget: no limit
    shared = models.TimeBudget(100.0, {"a": 1.0, "b": 1.0, "c": 2.0})
    assert shared.ends == {"a": 0.25, "b": 0.5, "c": 1.0}
    shared.keep(["b"])  # --only b: the whole budget goes to b
    assert shared.ends == {"b": 1.0}


def test_variant_names_match_by_substring_or_exactly():
    from hf_hybrid.bench.__main__ import keep_variants, matches

    assert matches("RAT-SWA", "RAT") and matches("RAT+ D=16", "RAT")
    assert matches("RAT", "=RAT") and not matches("RAT-SWA", "=RAT") and not matches("RAT+", "=RAT")
    variants = dict.fromkeys(["Llama", "Llama+Liger", "RAT", "RAT-SWA", "RAT+", "RATTENTION"])
    assert list(keep_variants(variants, "Liger,=RAT,=RAT-SWA")) == ["Llama", "Llama+Liger", "RAT", "RAT-SWA"]
