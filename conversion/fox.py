"""FoX checkpoints people already have -> hf-hybrid ``fox`` models, and back.

    hf-hybrid convert fox SRC DST                  # official FoX or FLA checkpoint -> hf-hybrid
    hf-hybrid convert fox SRC DST --to fla         # hf-hybrid fox checkpoint -> FLA format
    hf-hybrid convert fox SRC DST --to official    # hf-hybrid fox checkpoint -> the FoX authors' format

The source is read as files (config.json + safetensors or PyTorch bins); neither source package is
imported. Tokenizer files are copied through. Converting into hf-hybrid also checks the converted
model (float32) against a float64 restatement of the source forward (``fox_reference.py``) on random
tokens and writes the figure into the checkpoint's README with the command that made it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.fox import FoxConfig, FoxForCausalLM
from .checkpoint_io import copy_side_files, load_state, read_config, save_state
from .fox_formats import FLA, OFFICIAL, fox_config_from_source, source_config_from_fox, source_format
from .fox_reference import source_logits_float64
from .fox_weights import from_fox_state, to_fox_state

DTYPES = {"source": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Parity:
    """Converted model (float32) vs the float64 restatement of the source, on random tokens."""

    max_abs: float
    max_rel: float  # max |diff| / max |reference logit|
    tokens: int

    def describe(self) -> str:
        return (f"max |logit difference| {self.max_abs:.3g} (relative {self.max_rel:.3g}) over {self.tokens} random tokens, "
                "float32 converted model vs a float64 restatement of the source forward")


def check_parity(model: FoxForCausalLM, source_config: dict, source_state: dict, tokens: int = 32, seed: int = 0) -> Parity:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    reference = source_logits_float64(source_config, source_state, ids)
    fp32 = model.float().eval()
    with torch.no_grad():
        ours = fp32(ids, use_cache=False).logits.double()
    diff = (ours - reference).abs().max().item()
    return Parity(diff, diff / max(reference.abs().max().item(), 1e-30), tokens)


def convert_to_fox(src: str | Path, dst: str | Path | None = None, dtype: str = "source",
                   verify_tokens: int = 32, command: str | None = None) -> tuple[FoxForCausalLM, Parity | None]:
    """Official / FLA checkpoint folder -> FoxForCausalLM (saved with tokenizer files when ``dst`` is given)."""
    source_config = read_config(src)
    fmt = source_format(source_config)
    config = fox_config_from_source(source_config)
    source_state = load_state(src)
    model = FoxForCausalLM(config)
    model.load_state_dict(to_fox_state(source_state, fmt, config), strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
    target = DTYPES[dtype] or next(iter(source_state.values())).dtype
    parity = check_parity(model, source_config, source_state, verify_tokens) if verify_tokens else None
    model = model.to(target).eval()
    if dst is not None:
        dst = Path(dst)
        model.save_pretrained(dst, card_training_data=f"converted from {src} ({fmt} FoX format)")
        copy_side_files(src, dst)
        _append_conversion_section(dst / "README.md", src, fmt, command, parity)
    return model, parity


def convert_from_fox(src: str | Path, dst: str | Path, fmt: str) -> dict[str, torch.Tensor]:
    """hf-hybrid fox checkpoint folder -> ``fmt`` ("fla" or "official") checkpoint folder."""
    config = FoxConfig.from_pretrained(src)
    source_config = source_config_from_fox(config, fmt)
    state = from_fox_state(load_state(src), fmt, config)
    save_state(dst, source_config, state)
    copy_side_files(src, dst)
    return state


def _append_conversion_section(card: Path, src, fmt: str, command: str | None, parity: Parity | None) -> None:
    lines = ["", "## Conversion", "", f"Converted from `{src}` ({'the FoX authors' if fmt == OFFICIAL else 'flash-linear-attention'} "
             "checkpoint format) by hf-hybrid's FoX converter:", "", "```bash", command or f"hf-hybrid convert fox {src} DST", "```", ""]
    lines.append(f"Parity at conversion: {parity.describe()}." if parity else "Parity was not checked at conversion (--verify-tokens 0).")
    with card.open("a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fox":
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="hf-hybrid convert fox", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint folder (official FoX or FLA format; with --to, an hf-hybrid fox checkpoint)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--to", choices=[FLA, OFFICIAL], default=None, help="write an hf-hybrid fox checkpoint in this format instead")
    parser.add_argument("--dtype", default="source", choices=sorted(DTYPES), help="dtype of the converted weights")
    parser.add_argument("--verify-tokens", type=int, default=32, help="random tokens for the parity check (0 skips it)")
    args = parser.parse_args(argv)
    if args.to:
        convert_from_fox(args.src, args.dst, args.to)
        print(f"wrote {args.dst} in the {args.to} format")
        return
    command = "hf-hybrid convert fox " + " ".join(argv)
    model, parity = convert_to_fox(args.src, args.dst, args.dtype, args.verify_tokens, command)
    print(f"converted {args.src} -> {args.dst}: fox ({model.config.block_type} block), "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    if parity:
        print(parity.describe())


if __name__ == "__main__":
    main()
