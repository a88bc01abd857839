"""hf_hybrid/options.py: every runtime switch in one table, read through one function."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hf_hybrid import options

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_values(monkeypatch):
    for name in options.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert options.get("HF_HYBRID_RECOMPUTE") is True
    assert options.get("HF_HYBRID_BLOCK_ENDS") == "auto"
    monkeypatch.setenv("HF_HYBRID_RECOMPUTE", "off")
    assert options.get("HF_HYBRID_RECOMPUTE") is False
    monkeypatch.setenv("HF_HYBRID_FOX_ATTENTION", "Triton")
    assert options.get("HF_HYBRID_FOX_ATTENTION") == "triton"


def test_bad_values_and_names_are_refused_with_what_is_accepted(monkeypatch):
    monkeypatch.setenv("HF_HYBRID_FUSED_BACKBONE", "maybe")
    with pytest.raises(ValueError, match="HF_HYBRID_FUSED_BACKBONE='maybe': set it to 1 or 0"):
        options.get("HF_HYBRID_FUSED_BACKBONE")
    monkeypatch.setenv("HF_HYBRID_BLOCK_ENDS", "cudnn")
    with pytest.raises(ValueError, match="auto, triton, sdpa"):
        options.get("HF_HYBRID_BLOCK_ENDS")
    with pytest.raises(KeyError, match="not a switch of hf-hybrid"):
        options.get("HF_HYBRID_FOX_HOPPER")


def test_a_former_name_is_read_when_the_new_one_is_unset(monkeypatch):
    monkeypatch.delenv("HF_HYBRID_FUSED_BACKBONE", raising=False)
    monkeypatch.setenv("HF_HYBRID_LIGER", "0")
    assert options.get("HF_HYBRID_FUSED_BACKBONE") is False
    monkeypatch.setenv("HF_HYBRID_FUSED_BACKBONE", "1")  # the new name wins
    assert options.get("HF_HYBRID_FUSED_BACKBONE") is True
    monkeypatch.delenv("HF_HYBRID_FUSED_BACKBONE")
    monkeypatch.setenv("HF_HYBRID_LIGER", "maybe")
    with pytest.raises(ValueError, match="HF_HYBRID_LIGER='maybe'"):  # named as the user set it
        options.get("HF_HYBRID_FUSED_BACKBONE")


def test_override_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("HF_HYBRID_RECOMPUTE", "1")
    monkeypatch.delenv("HF_HYBRID_DEFERRED_STOP", raising=False)
    with options.override(HF_HYBRID_RECOMPUTE="0", HF_HYBRID_DEFERRED_STOP="0"):
        assert options.get("HF_HYBRID_RECOMPUTE") is False and options.get("HF_HYBRID_DEFERRED_STOP") is False
    assert os.environ["HF_HYBRID_RECOMPUTE"] == "1" and "HF_HYBRID_DEFERRED_STOP" not in os.environ
    with pytest.raises(ValueError):
        with options.override(HF_HYBRID_RECOMPUTE="sometimes"):
            pass
    assert os.environ["HF_HYBRID_RECOMPUTE"] == "1"


def test_readme_table_is_the_modules_table():
    assert options.table() in (ROOT / "README.md").read_text()


def test_the_package_reads_hf_hybrid_variables_only_here():
    """No other installed module reads an HF_HYBRID_* variable from the environment itself."""
    pattern = re.compile(r"environ(\.get)?[\[(]\s*[\"']HF_HYBRID_")
    for top in ("hf_hybrid", "kernels", "conversion"):
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "hf_hybrid" / "options.py":
                continue
            assert not pattern.search(path.read_text()), f"{path.relative_to(ROOT)} reads an HF_HYBRID_ variable"
