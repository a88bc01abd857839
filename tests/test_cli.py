"""`hf-hybrid --help` answers without importing torch, transformers or the hf_hybrid package (whose
import registers the architectures: seconds of imports); a command still runs through its module."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import hf_hybrid_cli
from hf_hybrid import cli

HEAVY = ("torch", "transformers", "hf_hybrid", "peft", "triton")


def run_launcher(argv: list[str]) -> subprocess.CompletedProcess:
    """The launcher in a fresh interpreter; prints the heavy modules it imported on its last line."""
    code = (
        "import sys, hf_hybrid_cli\n"
        f"rc = hf_hybrid_cli.main({argv!r})\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
        "sys.exit(rc)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_console_script_is_the_launcher():
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "hf-hybrid"]
    assert script.value == "hf_hybrid_cli:main"


def test_help_imports_nothing_heavy():
    result = run_launcher(["--help"])
    assert result.returncode == 0, result.stderr
    *help_lines, imported = result.stdout.strip().splitlines()
    assert imported == "[]"
    for name in cli.COMMANDS:
        assert any(line.split()[:1] == [name] for line in help_lines), name


def test_an_unknown_command_is_refused_without_heavy_imports():
    result = run_launcher(["nonsense"])
    assert result.returncode == 2
    assert "unknown command 'nonsense'" in result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _imports_beyond_the_standard_library(path, seen=None) -> set[str]:
    """Top-level imports of ``path`` outside the standard library, following its relative imports
    of sibling modules (which the launcher runs too)."""
    import ast

    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 1 and node.module, f"{path.name}: only `from .sibling import` is runnable by the launcher"
            found |= _imports_beyond_the_standard_library(path.parent / f"{node.module}.py", seen)
    return found - set(sys.stdlib_module_names) - {"__future__"}


def test_cli_module_imports_only_the_standard_library():
    # The launcher runs hf_hybrid/cli.py without the package: an import of torch (or of a module that
    # imports it) there would bring the seconds back.
    from pathlib import Path

    assert _imports_beyond_the_standard_library(Path(cli.__file__)) == set()


def test_a_command_runs_through_its_module(capsys):
    with pytest.raises(SystemExit) as exit_info:
        hf_hybrid_cli.main(["reproduce", "--help"])
    assert exit_info.value.code == 0
    assert "rat" in capsys.readouterr().out
