"""The RAT+ and RAT authors' trained checkpoints -> hf-hybrid ``rat_plus`` / ``rat`` models, and back.

    hf-hybrid convert rat-plus-official SRC DST [--preset 1b|3b|7b] [--dtype bfloat16]
    hf-hybrid convert rat-official SRC DST [--preset 1b]
    hf-hybrid convert rat-plus-official SRC DST --to official    # hf-hybrid rat_plus folder -> official .pth

SRC is what the official trainers save (``<step>.pth`` with the model under ``task`` and the hydra
config under ``config``; optimizer and scheduler states are skipped), a bare state dict, or a
folder holding one such file (the Hub layout of ``barpitf/ratplus``). Hyper-parameters come from
the checkpoint's config when it has one, else from ``--preset`` (the official experiment configs)
and the options; the state dict's shapes fill in and check the rest. Anything hf-hybrid cannot
represent exactly is refused with the field named. The weights are streamed: each tensor is read
from the memory-mapped source, written into safetensors shards (``--max-shard-size``, 5GB), and
dropped, so converting the 7B model needs about one copy of its weights. The written folder loads
with ``AutoModelForCausalLM.from_pretrained`` (with or without hf-hybrid installed: the model code
is bundled). Its model card names the source and the parity measured at conversion: the converted
model (float32, first ``--verify-layers`` layers) against a float64 restatement of the official
forward (``rat_official_reference.py``) on random tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .rat_official_format import (
    RAT,
    RAT_PLUS,
    PRESETS,
    OfficialSpec,
    UnsupportedCheckpoint,
    check_shapes,
    detect_kind,
    hf_config_kwargs,
    load_official,
    official_config,
    official_pattern,
    spec_from_config,
    spec_from_options,
)
from .rat_official_reference import official_logits_float64
from .rat_official_weights import to_hf_tensors, to_official_state

DTYPES = {"source": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KIND_NAMES = {RAT_PLUS: "rat-plus-official", RAT: "rat-official"}


def _classes(kind: str):
    if kind == RAT_PLUS:
        from ..models.rat_plus import RatPlusConfig, RatPlusForCausalLM

        return RatPlusConfig, RatPlusForCausalLM
    from ..models.rat import RatConfig, RatForCausalLM

    return RatConfig, RatForCausalLM


@dataclass
class Parity:
    """Converted model (float32) vs the float64 restatement of the official forward, on random tokens."""

    max_abs: float
    max_rel: float  # max |diff| / max |reference logit|
    tokens: int
    layers: int
    total_layers: int
    pattern: str
    weights_dtype: str = "float32"

    def describe(self) -> str:
        scope = "all" if self.layers == self.total_layers else f"the first {self.layers} of"
        return (f"max |logit difference| {self.max_abs:.3g} (relative {self.max_rel:.3g}) over {self.tokens} random tokens, "
                f"{scope} {self.total_layers} layers, {self.pattern} attention; the converted model computing in float32 vs a "
                f"float64 restatement of the official forward, both reading the weights as stored ({self.weights_dtype})")


def read_spec(state: dict, config: dict | None, kind: str | None, preset: str | None, overrides: dict) -> OfficialSpec:
    """The official hyper-parameters of a checkpoint (its config, else the preset and options), checked against its shapes."""
    found = detect_kind(state)
    if kind is not None and kind != found:
        raise UnsupportedCheckpoint(f"the weights are a {found!r} checkpoint (convert with `hf-hybrid convert {KIND_NAMES[found]}`), "
                                    f"not {kind!r}.")
    if config is not None:
        spec = spec_from_config(config, found)
        for name, value in overrides.items():
            if value is not None and getattr(spec, name, value) != value:
                raise UnsupportedCheckpoint(f"--{name.replace('_', '-')} {value} contradicts the checkpoint's config ({name} = "
                                            f"{getattr(spec, name)}); drop the option.")
    else:
        spec = spec_from_options(found, preset, overrides)
    return check_shapes(spec, state)


def _write_shards(tensors, dst: Path, dtype: torch.dtype | None, max_shard_bytes: int) -> dict[str, str]:
    """Stream (name, tensor) pairs into safetensors shards; returns the weight map."""
    from safetensors.torch import save_file

    for stale in list(dst.glob("model*.safetensors")) + list(dst.glob("model.safetensors.index.json")):
        stale.unlink()  # a folder converted into before: its weight files would mix with these
    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            name = f"shard-{len(shards):05d}.safetensors"
            save_file(current, dst / name, metadata={"format": "pt"})
            shards[-1] = {key: name for key in current}
            current, size = {}, 0

    for name, tensor in tensors:
        # a new tensor either way: the source's row slices share memory, which safetensors refuses
        tensor = (tensor.to(dtype) if dtype is not None and dtype != tensor.dtype else tensor.clone()).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name], size, total = tensor, size + nbytes, total + nbytes
    flush()
    weight_map = {key: file for shard in shards for key, file in shard.items()}
    files = sorted(set(weight_map.values()))
    if len(files) == 1:  # one shard: transformers' single-file name
        (dst / files[0]).rename(dst / "model.safetensors")
        return {key: "model.safetensors" for key in weight_map}
    renamed = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    for old, new in renamed.items():
        (dst / old).rename(dst / new)
    weight_map = {key: renamed[file] for key, file in weight_map.items()}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return weight_map


def _parse_size(text: str) -> int:
    text = str(text).strip().upper()
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _truncated_config(config, layers: int):
    """``config`` with its first ``layers`` layers (per-layer fields cut to match)."""
    values = config.to_dict()
    for key in ("transformers_version", "architectures", "auto_map", "model_type"):
        values.pop(key, None)
    values["num_hidden_layers"] = layers
    if "layer_types" in values:
        values["layer_types"] = values["layer_types"][:layers]
    sparse = values.get("sparse_config")
    if isinstance(sparse, dict) and sparse.get("layer_overrides"):
        values["sparse_config"] = dict(sparse, layer_overrides={k: v for k, v in sparse["layer_overrides"].items() if int(k) < layers})
    if "training_dilations" in values:
        values["training_dilations"] = [
            dict(p, layer_overrides={k: v for k, v in p.get("layer_overrides", {}).items() if int(k) < layers}) if isinstance(p, dict) else p
            for p in values["training_dilations"]]
    return type(config)(**values)


def check_parity(dst: Path, config, spec: OfficialSpec, state: dict, tokens: int = 16, layers: int | None = 2,
                 seed: int = 0) -> Parity:
    """The written weights (first ``layers`` layers, float32) against the float64 official forward
    of the source weights rounded to the dtype they were written in (the check is of the mapping;
    the rounding is the dtype's choice)."""
    from safetensors import safe_open

    layers = spec.num_layers if layers is None else min(layers, spec.num_layers)
    small = _truncated_config(config, layers)
    _, model_class = _classes(spec.kind)
    model = model_class(small).float().eval()
    wanted = set(model.state_dict())
    weights = {}
    index = dst / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for file in files:
        with safe_open(dst / file, framework="pt") as handle:
            for key in handle.keys():
                if key in wanted:
                    weights[key] = handle.get_tensor(key)
    weights_dtype = next(iter(weights.values())).dtype
    weights = {key: value.float() for key, value in weights.items()}
    model.load_state_dict(weights, strict=not small.tie_word_embeddings)
    if small.tie_word_embeddings:
        model.tie_weights()
    ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    per_layer_fields = {name: getattr(spec, name)[:layers] for name in ("dilation_size", "local_size", "initial_size")
                        if isinstance(getattr(spec, name), list)}
    small_spec = dataclasses.replace(spec, num_layers=layers, **per_layer_fields)
    dilated = spec.kind == RAT_PLUS and (config.sparse_config.get("dilation", 1) != 1 or bool(config.sparse_config.get("layer_overrides")))
    if dilated:
        pattern_dict = official_pattern(small_spec)
        per_layer = [(pattern_dict["dilation"], pattern_dict["local_window"], pattern_dict["num_sink_tokens"])] * layers
        for layer, o in pattern_dict.get("layer_overrides", {}).items():
            per_layer[int(layer)] = (o["dilation"], o["local_window"], o["num_sink_tokens"])
        pattern, label = per_layer, f"dilated (D={per_layer[0][0]}, W={per_layer[0][1]}, I={per_layer[0][2]})"
    else:
        pattern, label = (1, 0, 0), "dense causal" if spec.kind == RAT_PLUS else f"chunked RAT (L={spec.chunk_size})"
    reference = official_logits_float64(state, small_spec, ids, pattern, weights_dtype)
    with torch.no_grad():
        ours = model(ids, use_cache=False).logits.double()
    diff = (ours - reference).abs().max().item()
    return Parity(diff, diff / max(reference.abs().max().item(), 1e-30), tokens, layers, spec.num_layers, label,
                  str(weights_dtype).replace("torch.", ""))


def convert_official(src: str | Path, dst: str | Path, kind: str | None = None, preset: str | None = None,
                     overrides: dict | None = None, dtype: str = "source", max_shard_size: str = "5GB",
                     verify_tokens: int = 16, verify_layers: int | None = 2, command: str | None = None):
    """Official checkpoint -> hf-hybrid checkpoint folder. Returns (config, Parity or None)."""
    state, source_config, path = load_official(src)
    spec = read_spec(state, source_config, kind, preset, overrides or {})
    config_class, model_class = _classes(spec.kind)
    config = config_class(**hf_config_kwargs(spec))
    target = DTYPES[dtype] or next(iter(state.values())).dtype
    config.architectures = [model_class.__name__]
    config.dtype = target
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    _write_shards(to_hf_tensors(state, spec), dst, DTYPES[dtype], _parse_size(max_shard_size))
    config.save_pretrained(dst)
    parity = check_parity(dst, config, spec, state, verify_tokens, verify_layers) if verify_tokens else None
    _write_card_and_code(dst, config, model_class, path, spec, command, parity)
    return config, parity


def _write_card_and_code(dst: Path, config, model_class, path: Path, spec: OfficialSpec, command, parity: Parity | None) -> None:
    from ..hub import save_sharing_files

    with torch.device("meta"):
        model = model_class(config)  # no memory: only its code and parameter count are needed
    authors = "RAT+ authors' (wimh966/rat-plus)" if spec.kind == RAT_PLUS else "RAT authors' (CLAIRE-Labo/RAT)"
    save_sharing_files(model, dst, training_data=f"converted from the {authors} checkpoint {path.name}")
    name = KIND_NAMES[spec.kind]
    lines = ["", "## Conversion", "", f"Converted from `{path}` (the {authors} training checkpoint) by hf-hybrid:", "",
             "```bash", command or f"hf-hybrid convert {name} {path} DST", "```", "",
             f"Source hyper-parameters: {spec.num_layers} layers, d_model {spec.d_model}, d_head {spec.d_head}, "
             f"FFN {spec.act_fn} x{spec.d_ffn // spec.d_model}, RoPE base {spec.rope_base:g}, "
             + (f"dilation {spec.dilation_size} / local {spec.local_size} / initial {spec.initial_size}, joint training {spec.joint_train}"
                if spec.kind == RAT_PLUS else f"chunk size {spec.chunk_size}, {spec.ngroups} q/k groups")
             + f", {'tied' if spec.tie_embedding else 'untied'} head.", ""]
    lines.append(f"Parity at conversion: {parity.describe()}." if parity else "Parity was not checked at conversion (--verify-tokens 0).")
    lines += ["", "Run it:", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f"model = AutoModelForCausalLM.from_pretrained(\"{dst.name}\", trust_remote_code=True)",
              "tokenizer = AutoTokenizer.from_pretrained(\"hf-internal-testing/llama-tokenizer\")  # Llama-2's, the official models'",
              "ids = tokenizer(\"The capital of France is\", return_tensors=\"pt\").input_ids",
              "print(tokenizer.decode(model.generate(ids, max_new_tokens=20)[0]))", "```"]
    with (dst / "README.md").open("a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def convert_to_official(src: str | Path, dst: str | Path, kind: str) -> Path:
    """hf-hybrid rat_plus / rat checkpoint folder -> the official ``.pth`` (``task`` + ``config``)."""
    from .checkpoint_io import load_state

    config_class, _ = _classes(kind)
    config = config_class.from_pretrained(src)
    state = to_official_state(load_state(src), config, kind)
    dst = Path(dst)
    if dst.suffix not in (".pth", ".pt"):
        dst.mkdir(parents=True, exist_ok=True)
        dst = dst / "checkpoint.pth"
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"task": state, "config": official_config(config, kind), "step": 0}, dst)
    return dst


def _parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"hf-hybrid convert {KIND_NAMES[kind]}", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="the official .pth, a bare state dict, or a folder holding one (with --to official: an hf-hybrid folder)")
    parser.add_argument("dst", help="output folder (with --to official: a .pth path or a folder)")
    parser.add_argument("--to", choices=["official"], default=None, help="write an hf-hybrid checkpoint in the official format instead")
    parser.add_argument("--preset", default=None, help=f"official experiment config for files without one: {', '.join(sorted(PRESETS[kind]))}")
    parser.add_argument("--d-head", type=int, default=None, help="head width (bare state dicts)")
    parser.add_argument("--seq-len", type=int, default=None, help="training length -> max_position_embeddings")
    parser.add_argument("--rope-base", type=float, default=None, help="RoPE base")
    parser.add_argument("--act-fn", default=None, help="the official FFN activation (gelu, fastgelu, relu, silu, swiglu)")
    parser.add_argument("--tie-embedding", default=None, type=lambda s: s.lower() in ("1", "true", "yes"), help="true/false")
    if kind == RAT_PLUS:
        parser.add_argument("--dilation-size", "--dilation", dest="dilation", type=int, default=None,
                            help="dilation_size of the training / adapted pattern")
        parser.add_argument("--local-size", type=int, default=None, help="local_size (W)")
        parser.add_argument("--initial-size", type=int, default=None, help="initial_size (sink tokens)")
        parser.add_argument("--joint-train", default=None, type=lambda s: s.lower() in ("1", "true", "yes"),
                            help="true: a pretrained (dense + dilated) model; false: an adapted model whose pattern becomes the default")
    else:
        parser.add_argument("--chunk-size", type=int, default=None, help="RAT chunk size L")
    parser.add_argument("--dtype", default="source", choices=sorted(DTYPES), help="dtype of the converted weights")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard")
    parser.add_argument("--verify-tokens", type=int, default=16, help="random tokens of the parity check (0 skips it)")
    parser.add_argument("--verify-layers", default="2", help="layers in the parity check ('all' for the whole model)")
    return parser


def main(kind: str, argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(kind).parse_args(argv)
    if args.to:
        path = convert_to_official(args.src, args.dst, kind)
        print(f"wrote {path} in the official {kind} format")
        return
    overrides = dict(d_head=args.d_head, seq_len=args.seq_len, rope_base=args.rope_base, act_fn=args.act_fn, tie_embedding=args.tie_embedding)
    if kind == RAT_PLUS:
        overrides.update(dilation_size=args.dilation, local_size=args.local_size, initial_size=args.initial_size, joint_train=args.joint_train)
    else:
        overrides.update(chunk_size=args.chunk_size)
    layers = None if args.verify_layers == "all" else int(args.verify_layers)
    command = f"hf-hybrid convert {KIND_NAMES[kind]} " + " ".join(argv)
    try:
        config, parity = convert_official(args.src, args.dst, kind, args.preset, overrides, args.dtype, args.max_shard_size,
                                          args.verify_tokens, layers, command)
    except UnsupportedCheckpoint as error:
        raise SystemExit(f"cannot convert {args.src}: {error}") from None
    print(f"converted {args.src} -> {args.dst}: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}")
    if parity:
        print(parity.describe())


def main_rat_plus(argv: list[str] | None = None) -> None:
    main(RAT_PLUS, argv)


def main_rat(argv: list[str] | None = None) -> None:
    main(RAT, argv)
