"""Run the RAT+ authors' trained models with transformers: convert, load, generate.

With the real checkpoints (Hub repository ``barpitf/ratplus``) the three commands are:

    hf download barpitf/ratplus --include "adapt/*" --local-dir ratplus
    hf-hybrid convert rat-plus-official ratplus/adapt rat-plus-adapted --dtype bfloat16
    python -c "from transformers import AutoModelForCausalLM; m = AutoModelForCausalLM.from_pretrained('rat-plus-adapted', trust_remote_code=True)"

(point SRC at the ``.pth`` file itself when the folder holds several; ``--preset 1b|3b|7b`` when a
file carries no config). This example runs the same path offline at tiny size (CPU, seconds):
1. write a random checkpoint in the official format, shaped like the Hub's adapted model (dilation
   16, local window 256, 4 initial tokens; the official trainer's ``.pth`` with an EasyDict config);
2. convert it (``hf-hybrid convert rat-plus-official SRC DST``): the converter checks the result
   against a float64 restatement of the official forward and writes the figure into the model card;
3. load it with ``AutoModelForCausalLM`` and generate with its default, dilated pattern.

    python examples/convert_rat_plus_official.py --out /tmp/rat-plus-conversion
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.conversion.cli import main as convert
from hf_hybrid.conversion.rat_official_random import write_random_official_checkpoint

PATTERN = dict(dilation_size=16, local_size=256, initial_size=4)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="rat-plus-conversion", help="folder for the official and the converted checkpoint")
    args = parser.parse_args(argv)
    out = Path(args.out)
    source = write_random_official_checkpoint(out / "ratplus" / "adapt" / "checkpoint.pth", "ratplus", vocab_size=256,
                                              seq_len=1024, joint_train=False, **PATTERN)

    convert(["rat-plus-official", str(out / "ratplus" / "adapt"), str(out / "converted"), "--verify-tokens", "320"])

    model = AutoModelForCausalLM.from_pretrained(out / "converted").eval()
    model.generation_config.eos_token_id = None  # random weights: generate the full length
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    card = (out / "converted" / "README.md").read_text()
    parity_line = next(line for line in card.splitlines() if line.startswith("Parity at conversion"))
    print(f"source: {source}\ndefault pattern: {model.config.sparse_config}\ngenerated: {tokens[0, 300:].tolist()}\n{parity_line}")
    return {"sparse_config": model.config.sparse_config, "new_tokens": tokens.shape[1] - ids.shape[1], "parity": parity_line}


if __name__ == "__main__":
    main()
