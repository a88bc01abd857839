"""Entry point of the ``hf-hybrid`` console script.

``import hf_hybrid`` registers every architecture with transformers' Auto classes, which imports torch
and transformers: seconds before anything prints. The command table and ``--help`` need neither, so
this launcher runs hf_hybrid/cli.py without the package's ``__init__``: as a module of a private
package whose folder is hf_hybrid/, so that cli.py's relative imports of the package's
standard-library-only modules (the architecture table) work. The module of the command that runs
imports the package (and so registers the architectures) as usual.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_PRIVATE_PACKAGE = "_hf_hybrid_cli_package"


def _command_table():
    """hf_hybrid/cli.py: the package's own module if the package is imported already, else the
    file run under the private package (nothing of hf_hybrid's __init__ runs)."""
    if "hf_hybrid.cli" in sys.modules:
        return sys.modules["hf_hybrid.cli"]
    package = importlib.util.find_spec("hf_hybrid")  # locates the package without importing it
    if package is None or not package.submodule_search_locations:
        raise SystemExit("hf-hybrid: the hf_hybrid package is not installed in this Python environment.")
    if _PRIVATE_PACKAGE not in sys.modules:
        private = types.ModuleType(_PRIVATE_PACKAGE, "hf_hybrid's folder, without its __init__ (hf_hybrid_cli.py)")
        private.__path__ = list(package.submodule_search_locations)
        sys.modules[_PRIVATE_PACKAGE] = private
    return importlib.import_module(f"{_PRIVATE_PACKAGE}.cli")


def main(argv: list[str] | None = None) -> int:
    return _command_table().main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
