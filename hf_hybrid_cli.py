"""Entry point of the ``hf-hybrid`` console script.

``import hf_hybrid`` registers every architecture with transformers' Auto classes, which imports torch
and transformers: seconds before anything prints. The command table and ``--help`` need neither, so
this launcher reads hf_hybrid/cli.py on its own, without running the package's ``__init__``; the module
of the command that runs imports the package (and so registers the architectures) as usual.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _command_table():
    """hf_hybrid/cli.py (standard library imports only): the loaded module if the package is imported,
    else the file executed alone."""
    if "hf_hybrid.cli" in sys.modules:
        return sys.modules["hf_hybrid.cli"]
    package = importlib.util.find_spec("hf_hybrid")  # locates the package without importing it
    if package is None or not package.submodule_search_locations:
        raise SystemExit("hf-hybrid: the hf_hybrid package is not installed in this Python environment.")
    path = Path(next(iter(package.submodule_search_locations))) / "cli.py"
    spec = importlib.util.spec_from_file_location("hf_hybrid_cli.commands", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    return _command_table().main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
