"""Reading and writing checkpoint folders without importing the code that wrote them.

A checkpoint folder is ``config.json`` plus weights in one of transformers' layouts (one or
sharded safetensors, one or sharded PyTorch bins) and, often, tokenizer files that conversions
copy through unchanged.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja",
)


def read_config(src: str | Path) -> dict:
    path = Path(src) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: SRC must be a checkpoint folder (config.json + weights).")
    return json.loads(path.read_text())


def load_state(src: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (safetensors, sharded or not, or PyTorch bins)."""
    from safetensors.torch import load_file

    src = Path(src)
    for index_name, loader in (("model.safetensors.index.json", load_file), ("pytorch_model.bin.index.json", None)):
        index = src / index_name
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state = {}
            for file in files:
                state.update(load_file(src / file) if loader else torch.load(src / file, map_location="cpu", weights_only=True))
            return state
    if (src / "model.safetensors").exists():
        return load_file(src / "model.safetensors")
    if (src / "pytorch_model.bin").exists():
        return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {src}: expected one of {WEIGHT_FILES}.")


def save_state(dst: str | Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors (contiguous, unshared tensors, as safetensors requires)."""
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, dst / "model.safetensors", metadata={"format": "pt"})


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer and generation files from src to dst; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in SIDE_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
