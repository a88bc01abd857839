"""Every Python block of the README runs alone, as a reader would paste it: each in a fresh interpreter
(so a block that leans on another block's imports or names fails here), in an empty working directory."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)

# After a block: the shapes of what it leaves behind, for the checks below.
REPORT = """
import json as _json
_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
_eos = [] if _eos is None else [_eos] if isinstance(_eos, int) else list(_eos)
print("README-BLOCK-RESULT " + _json.dumps({
    name: list(value.shape) for name, value in dict(globals()).items() if name in ("ids", "out", "logits")
} | {"vocab_size": model.config.vocab_size,
     "out_ends_at_eos": "out" in globals() and bool((out[:, -1:] == torch.tensor(_eos or [-1])).any(-1).all())}))
"""


def run_block(block: str, cwd: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", block + REPORT], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"README block fails on its own:\n{block}\n{result.stderr[-3000:]}"
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("README-BLOCK-RESULT ")]
    return json.loads(line.split(" ", 1)[1])


def test_the_readme_shows_usage_for_every_architecture():
    assert len(BLOCKS) >= 2
    text = "".join(BLOCKS)
    for model_type in ("rat", "rat_plus", "fox", "rattention", "se_hybrid"):
        assert f'"{model_type}"' in text, model_type


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_alone(index, tmp_path):
    shapes = run_block(BLOCKS[index], tmp_path)
    if "generate(" in BLOCKS[index] and "out" in shapes:  # the prompt plus the new tokens
        new_tokens = int(re.findall(r"max_new_tokens=(\d+)", BLOCKS[index])[-1])
        if shapes["out_ends_at_eos"]:  # a random model may pick its end-of-text token: generate() stops there
            assert shapes["ids"][1] < shapes["out"][1] <= shapes["ids"][1] + new_tokens
        else:
            assert shapes["out"][1] == shapes["ids"][1] + new_tokens
    if "logits" in shapes:
        assert shapes["logits"][-1] == shapes["vocab_size"]
