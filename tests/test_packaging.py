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


def test_a_checkout_root_on_sys_path_leaves_the_name_kernels_to_the_hub_package():
    """From a checkout's root (`python -m benchmarks.X`), ``import kernels`` finds this repository's
    kernels/ first. Where Hugging Face's kernel-hub package is installed (transformers imports it),
    the name must be the hub's; elsewhere it is an empty shell. transformers and hf_hybrid import."""
    import importlib.metadata
    import subprocess
    import sys

    try:
        importlib.metadata.version("kernels")
        hub = True
    except importlib.metadata.PackageNotFoundError:
        hub = False
    probe = (
        "import kernels, transformers.modeling_utils, hf_hybrid.kernels as ours; "
        "print(kernels.__file__); print(hasattr(kernels, 'causal_conv1d')); print(hasattr(ours, 'causal_conv1d'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    location, shell_has_ops, ours_has_ops = done.stdout.split()
    assert shell_has_ops == "False" and ours_has_ops == "True"
    assert (Path(location).resolve().parent == ROOT / "kernels") is not hub
