"""Running the CLI, an example or a README snippet from the repository root leaves git status clean:
every default output folder is ignored. The defaults are read from the argument parsers themselves."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def default_output_folders() -> set[str]:
    """The default of every --out / --output-dir option in the CLI modules and the examples' parsers,
    and every folder the README's snippets save into."""
    found = set()
    sources = [*ROOT.joinpath("examples").glob("*.py"), *ROOT.joinpath("hf_hybrid").rglob("*.py"),
               *ROOT.joinpath("benchmarks").glob("*.py"), *ROOT.joinpath("conversion").glob("*.py")]
    option = re.compile(r"""add_argument\(\s*"--(?:out|output-dir)"[^)]*?default=(?:Path\()?"([^"]+)\"""")
    for path in sources:
        found |= set(option.findall(path.read_text(encoding="utf-8")))
    readme = ROOT.joinpath("README.md").read_text(encoding="utf-8")
    found |= set(re.findall(r"""save_pretrained\("([^"/]+)"\)""", readme))
    return found


def test_the_scan_finds_the_known_defaults():
    assert {"demo_output", "pretrain_output", "eval_output"} <= default_output_folders()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_every_default_output_folder_is_ignored():
    folders = sorted(default_output_folders())
    result = subprocess.run(["git", "check-ignore", "--no-index", *(f"{name}/results.json" for name in folders)],
                            cwd=ROOT, capture_output=True, text=True)
    ignored = {line.split("/")[0] for line in result.stdout.splitlines()}
    assert ignored == set(folders), f"not git-ignored: {sorted(set(folders) - ignored)}"
