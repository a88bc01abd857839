"""Convert FoX checkpoints between the FoX authors' format, FLA's and hf-hybrid, and use the result.

What it does (tiny sizes, CPU, a minute at most):
1. make a small hf-hybrid FoX Pro model and write it in the FoX authors' checkpoint format
   (``hf-hybrid convert fox OURS OFFICIAL --to official``): this stands in for a checkpoint you
   downloaded (e.g. a ``fox-pro-760m`` folder of the official repository);
2. convert that folder into hf-hybrid (``hf-hybrid convert fox OFFICIAL CONVERTED``), which checks the
   converted model against a float64 restatement of the official forward and writes the figure into
   the converted folder's README;
3. load it with ``AutoModelForCausalLM``, check its logits equal the original model's, and generate.

    python examples/convert_fox.py --out /tmp/fox-conversion
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.conversion.fox import main as convert


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fox-conversion", help="folder for the three checkpoints")
    args = parser.parse_args(argv)
    out = Path(args.out)
    torch.manual_seed(0)
    config = AutoConfig.for_model("fox", block_type="pro", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, qk_norm_eps=1e-5)
    original = AutoModelForCausalLM.from_config(config).eval()
    original.save_pretrained(out / "ours")

    convert(["fox", str(out / "ours"), str(out / "official"), "--to", "official"])
    convert(["fox", str(out / "official"), str(out / "converted")])

    converted = AutoModelForCausalLM.from_pretrained(out / "converted").eval()
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        same = torch.equal(original(ids).logits, converted(ids).logits)
        tokens = converted.generate(ids, max_new_tokens=8, do_sample=False)
    print(f"logits identical after the round trip: {same}; generated {tokens[0, 24:].tolist()}")
    print((out / "converted" / "README.md").read_text().split("## Conversion")[1].strip())
    if not same:
        raise SystemExit("round trip changed the logits")


if __name__ == "__main__":
    main()
