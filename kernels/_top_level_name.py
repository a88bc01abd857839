"""The top-level name ``kernels`` belongs to Hugging Face's kernel-hub package: when Python imports
this folder under that name (a checkout's root on sys.path), the hub package, if installed, takes
the name instead."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over_to_the_hub_package(init_file: str) -> None:
    """Load the hub's ``kernels`` from the sys.path entries other than this checkout's root and put
    it in sys.modules, where the running ``import kernels`` picks it up when this module returns."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    others = [entry for entry in sys.path if os.path.abspath(entry or os.getcwd()) != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise
