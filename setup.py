"""Package discovery for the mapped folders (metadata lives in pyproject.toml).

`kernels/`, `conversion/` and `model_cards/` are installed as `hf_hybrid.kernels`,
`hf_hybrid.conversion` and `hf_hybrid.model_cards`
(see `[tool.setuptools] package-dir` in pyproject.toml); their subpackages are listed here
because setuptools' automatic discovery does not follow a package-dir mapping.
"""
from setuptools import find_packages, setup


def mapped(folder: str, prefix: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(folder)]


setup(
    packages=find_packages(include=["hf_hybrid", "hf_hybrid.*"])
    + mapped("kernels", "hf_hybrid.kernels")
    + mapped("conversion", "hf_hybrid.conversion")
    + ["hf_hybrid.model_cards"],
    # The console script's launcher: answers `hf-hybrid --help` without importing torch (hf_hybrid_cli.py).
    py_modules=["hf_hybrid_cli"],
)
