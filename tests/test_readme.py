"""The README's Python usage blocks run as written (in order, sharing one namespace)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the usage example saves a checkpoint in the working directory
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "the README should show usage for RAT and for the other architectures"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102  (our own README)
    # The last block leaves a PEFT-wrapped SE hybrid and its full-attention logits behind.
    assert namespace["logits"].shape[-1] == namespace["model"].config.vocab_size
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 20
