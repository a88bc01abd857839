"""Make ``hf_hybrid.kernels`` / ``.conversion`` / ``.model_cards`` importable from a source checkout.

Installed (also editable), setuptools maps the top-level folders kernels/, conversion/ and
model_cards/ to these names. When the package is imported straight from a checkout instead (for
example ``python -m hf_hybrid.bench`` run from the repository root, where the current directory
shadows the installed package), nothing maps them; this loads each from its folder under its
package name. A top-level ``kernels`` module is never created.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

MAPPED_FOLDERS = ("kernels", "conversion", "model_cards")


def map_checkout_folders(package: str, package_file: str) -> None:
    root = Path(package_file).resolve().parent.parent
    for name in MAPPED_FOLDERS:
        full_name = f"{package}.{name}"
        init = root / name / "__init__.py"
        if full_name in sys.modules or not init.exists() or importlib.util.find_spec(full_name) is not None:
            continue
        spec = importlib.util.spec_from_file_location(full_name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[full_name] = module
        spec.loader.exec_module(module)
