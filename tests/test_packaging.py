"""A non-editable install ships every module: each source folder must be a regular package."""
from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def test_every_source_folder_is_a_package_that_setuptools_finds():
    found = set(find_packages(str(ROOT), include=["hf_hybrid", "hf_hybrid.*"]))
    for top in ("hf_hybrid", "kernels", "conversion"):
        for folder in (ROOT / top).rglob("*"):
            if not folder.is_dir() or folder.name == "__pycache__" or not any(folder.glob("*.py")):
                continue
            assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} has modules but no __init__.py"
            if top == "hf_hybrid":
                assert ".".join(folder.relative_to(ROOT).parts) in found


def test_the_package_never_imports_the_uninstalled_benchmarks():
    """benchmarks/ (diagnostics, sweeps, A/B scripts) is not in the wheel: nothing installed may
    import it, and setuptools must not find it as a package of the distribution."""
    import re

    pattern = re.compile(r"^\s*(from|import)\s+benchmarks\b", re.MULTILINE)
    for top in ("hf_hybrid", "kernels", "conversion"):
        for path in (ROOT / top).rglob("*.py"):
            assert not pattern.search(path.read_text()), f"{path.relative_to(ROOT)} imports benchmarks/"
    found = find_packages(str(ROOT), include=["hf_hybrid", "hf_hybrid.*"])
    assert not [name for name in found if "benchmarks" in name.split(".")]
