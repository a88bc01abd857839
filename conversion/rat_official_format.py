"""Reading the RAT and RAT+ authors' checkpoints, and their hyper-parameters as hf-hybrid configs.

Both authors' trainers (CLAIRE-Labo/RAT, wimh966/rat-plus) save ``<step>.pth`` =
``torch.save({"task": state_dict, "config": <EasyDict of the resolved hydra config>, "step": ...,
"optimizer": ..., "lr_scheduler": ..., "resume_kwargs": ...})``; the Hub repository of RAT+
(``barpitf/ratplus``) holds such files under ``pretrain/`` and ``adapt/``. The file is read with a
restricted unpickler: tensors, containers and plain values are rebuilt, EasyDict becomes a dict,
and every other class is replaced by an inert placeholder, so no code from the file runs and
neither authors' package is imported. Tensors are memory-mapped (nothing is read twice).

Official names used below: ``model.backbone`` {num_layers, d_model, ln, bias, seq_cell
{_name_ "rat"/"ratplus", d_head, num_head, chunk_size, ngroups, dilation_size, local_size,
initial_size, apply_re, joint_train}, hidden_cell {d_ffn, act_fn, bias, ln}}, ``model.embedding``
{vocab_size, seq_len, pe {_name_, base, dim}}, ``task.tie_embedding``. Every norm is RMSNorm with
eps 1e-6 in both codes.
"""
from __future__ import annotations

import functools
import pickle
import types
from dataclasses import dataclass
from pathlib import Path

import torch

RAT, RAT_PLUS = "rat", "ratplus"
OFFICIAL_NORM_EPS = 1e-6  # hard-coded in every norm of both official codes
# The official FFN's act_fn -> (hf-hybrid mlp_type, hidden_act)
ACTIVATIONS = {"gelu": ("plain", "gelu"), "fastgelu": ("plain", "gelu_pytorch_tanh"), "relu": ("plain", "relu"),
               "silu": ("plain", "silu"), "swiglu": ("gated", "silu")}

# The official experiment configs' values (RAT+: configs/experiment/fineweb_edu/ratplus-{1b,3b,7b}.yaml;
# RAT: configs/experiment/fineweb_edu/rat-xl.yaml), for bare state dicts that carry no config.
_COMMON = dict(vocab_size=32000, seq_len=4096, d_head=128, ln="rmsnorm", bias=False, act_fn="gelu", ffn_mult=4,
               rope_base=10000.0, tie_embedding=True)
PRESETS = {
    RAT_PLUS: {
        "1b": dict(_COMMON, num_layers=24, d_model=2048, dilation_size=64, local_size=0, initial_size=0, joint_train=True),
        "3b": dict(_COMMON, num_layers=28, d_model=2560, dilation_size=64, local_size=0, initial_size=0, joint_train=True),
        "7b": dict(_COMMON, num_layers=32, d_model=4096, dilation_size=64, local_size=0, initial_size=0, joint_train=True),
    },
    RAT: {
        "1b": dict(_COMMON, num_layers=24, d_model=2048, chunk_size=16, ngroups=2),
        "xl": dict(_COMMON, num_layers=24, d_model=2048, chunk_size=16, ngroups=2),
    },
}


class UnsupportedCheckpoint(ValueError):
    """The checkpoint uses something hf-hybrid cannot represent exactly; the message names the field."""


# ----------------------------------------------------------------------------- restricted reading
class ConfigDict(dict):
    """What an EasyDict becomes: its items (the attribute copy in its pickled state is dropped)."""

    def __setstate__(self, state):
        pass


class Opaque(dict):
    """Stands in for any other pickled class or function (optimizer extras, scheduler objects):
    accepts whatever the pickle hands it and does nothing."""

    def __new__(cls, *args, **kwargs):
        return dict.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return Opaque()

    def __setstate__(self, state):
        pass

    def append(self, item):
        pass

    def extend(self, items):
        pass


@functools.lru_cache(maxsize=1)
def _allowed_globals() -> dict[str, object]:
    """torch's own weights-only allowlist (tensor rebuilders, storages, dtypes, OrderedDict, ...)."""
    from torch import _weights_only_unpickler

    return dict(_weights_only_unpickler._get_allowed_globals())


CONFIG_CLASSES = {("easydict", "EasyDict"), ("omegaconf.dictconfig", "DictConfig")}


class RestrictedUnpickler(pickle.Unpickler):
    """Rebuilds only what torch's weights-only loader allows; config classes become ConfigDict,
    everything else Opaque (nothing named by the file is imported or called)."""

    def find_class(self, module: str, name: str):
        allowed = _allowed_globals().get(f"{module}.{name}")
        if allowed is not None:
            return allowed
        return ConfigDict if (module, name) in CONFIG_CLASSES else Opaque


# torch.load takes a pickle module: ours differs from pickle only in the Unpickler's find_class.
restricted_pickle = types.ModuleType("restricted_pickle")
restricted_pickle.Unpickler = RestrictedUnpickler
restricted_pickle.load = lambda file, **kwargs: RestrictedUnpickler(file, **kwargs).load()


def find_checkpoint_file(src: str | Path) -> Path:
    """SRC itself when it is a file; in a folder (the Hub layout: ``pretrain/<size>/...pth``,
    ``adapt/...pth``) its only ``.pth`` / ``.pt`` file."""
    src = Path(src)
    if src.is_file():
        return src
    if not src.is_dir():
        raise FileNotFoundError(f"{src} does not exist: give the .pth file the official trainer saved or a folder holding one.")
    files = sorted(p for p in src.rglob("*") if p.suffix in (".pth", ".pt") and p.is_file())
    if len(files) != 1:
        listing = ", ".join(str(p.relative_to(src)) for p in files[:20]) or "none"
        raise FileNotFoundError(f"{src} holds {len(files)} .pth/.pt files ({listing}); give SRC as the one to convert.")
    return files[0]


def load_official(src: str | Path) -> tuple[dict[str, torch.Tensor], dict | None, Path]:
    """(state dict with ``_orig_mod.`` removed, the pickled config as plain dicts or None, the file read).

    Tensors are memory-mapped when the file is in torch's zip format, so reading a 7B checkpoint
    costs no copy of the weights; optimizer and scheduler states are never materialised as objects.
    """
    path = find_checkpoint_file(src)
    load = dict(map_location="cpu", weights_only=False, pickle_module=restricted_pickle)
    try:
        obj = torch.load(path, mmap=True, **load)
    except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
        obj = torch.load(path, **load)
    if not isinstance(obj, dict):
        raise UnsupportedCheckpoint(f"{path} holds a {type(obj).__name__}, not a checkpoint dict or a state dict.")
    if "task" in obj and isinstance(obj["task"], dict):
        state, config = obj["task"], obj.get("config")
    elif obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        state, config = obj, None
    else:
        raise UnsupportedCheckpoint(f"{path} has no 'task' state dict (keys: {sorted(obj)[:10]}) and is not a bare state dict.")
    state = {key.replace("_orig_mod.", ""): value for key, value in state.items() if isinstance(value, torch.Tensor)}
    return state, _plain(config) if isinstance(config, dict) else None, path


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- hyper-parameters
@dataclass
class OfficialSpec:
    """The official hyper-parameters that decide the converted model (official names)."""

    kind: str  # RAT or RAT_PLUS
    num_layers: int
    d_model: int
    d_head: int
    vocab_size: int
    d_ffn: int
    act_fn: str = "gelu"
    ffn_bias: bool = False
    ln: str = "rmsnorm"
    ffn_ln: str = "rmsnorm"
    bias: bool = False
    rope_base: float = 10000.0
    pe: str = "rope"
    seq_len: int = 4096
    tie_embedding: bool = True
    # RAT+
    apply_re: bool = True
    joint_train: bool = True
    dilation_size: int | list = 64
    local_size: int | list = 0
    initial_size: int | list = 0
    # RAT
    chunk_size: int = 16
    ngroups: int = 2


def detect_kind(state: dict[str, torch.Tensor]) -> str:
    if any(key.endswith("seq_layer.gate_bias") for key in state):
        return RAT
    if any(key.endswith("seq_layer.in_proj.weight") for key in state):
        return RAT_PLUS
    raise UnsupportedCheckpoint("no backbone.layers.*.seq_layer.in_proj.weight in the state dict: not a RAT or RAT+ checkpoint.")


def spec_from_config(config: dict, kind: str) -> OfficialSpec:
    """The official hydra config (as plain dicts) -> OfficialSpec; refuses what we cannot represent."""
    try:
        model = config["model"]
        backbone, embedding = model["backbone"], model["embedding"]
        seq, ffn = backbone["seq_cell"], backbone["hidden_cell"]
    except (KeyError, TypeError) as error:
        raise UnsupportedCheckpoint(
            f"the checkpoint's config has no model.backbone.seq_cell / hidden_cell / model.embedding ({error})."
        ) from None
    if backbone.get("_name_", "sequence") != "sequence":
        raise UnsupportedCheckpoint(f"model.backbone._name_ = {backbone.get('_name_')!r}: only the 'sequence' backbone (one mixer "
                                    "type in every layer) converts; interleaved RAT + local-attention stacks are not supported.")
    name = seq.get("_name_", kind)
    if name != kind:
        raise UnsupportedCheckpoint(f"model.backbone.seq_cell._name_ = {name!r} but the weights are {kind!r}; convert it with the "
                                    f"'{name}' converter or check the file.")
    pe = embedding.get("pe") or {}
    d_model = int(backbone["d_model"])
    d_head = int(seq.get("d_head") or d_model // int(seq["num_head"]))
    spec = OfficialSpec(
        kind=kind, num_layers=int(backbone["num_layers"]), d_model=d_model, d_head=d_head,
        vocab_size=int(embedding["vocab_size"]), d_ffn=int(ffn.get("d_ffn", 4 * d_model)), act_fn=str(ffn.get("act_fn", "gelu")),
        ffn_bias=bool(ffn.get("bias", False)), ln=str(backbone.get("ln", "rmsnorm")), ffn_ln=str(ffn.get("ln", backbone.get("ln", "rmsnorm"))),
        bias=bool(seq.get("bias", False)), rope_base=float(pe.get("base", 10000.0)), pe=str(pe.get("_name_", "rope")),
        seq_len=int(embedding.get("seq_len", 4096)), tie_embedding=bool((config.get("task") or {}).get("tie_embedding", False)),
    )
    for name, value in (("model.backbone.seq_cell.k_channel", seq.get("k_channel")), ("model.embedding.pe.dim", pe.get("dim"))):
        if value is not None and int(value) != d_head:
            raise UnsupportedCheckpoint(f"{name} = {value} differs from d_head ({d_head}): hf-hybrid rotates whole heads.")
    if "num_head" in seq and d_model // int(seq["num_head"]) != d_head:
        raise UnsupportedCheckpoint(f"model.backbone.seq_cell.num_head ({seq['num_head']}) and d_head ({d_head}) disagree with "
                                    f"d_model ({d_model}): the official layer uses d_model // num_head.")
    if kind == RAT_PLUS:
        spec.apply_re = bool(seq.get("apply_re", True))
        spec.joint_train = bool(seq.get("joint_train", True))
        spec.dilation_size = seq.get("dilation_size", 64)
        spec.local_size = seq.get("local_size", 0)
        spec.initial_size = seq.get("initial_size", 0)
    else:
        spec.chunk_size = int(seq.get("chunk_size", 64))
        spec.ngroups = int(seq.get("ngroups", 2))
    return spec


def spec_from_options(kind: str, preset: str | None, overrides: dict) -> OfficialSpec:
    """A bare state dict's hyper-parameters: a named preset (the official experiment configs)
    with command-line overrides; fields the shapes fix are filled in by ``check_shapes``."""
    values = {}
    if preset is not None:
        if preset not in PRESETS[kind]:
            raise ValueError(f"--preset {preset!r} is not one of {sorted(PRESETS[kind])} for {kind}.")
        values.update(PRESETS[kind][preset])
    values.update({k: v for k, v in overrides.items() if v is not None})
    ffn_mult = values.pop("ffn_mult", 4)
    missing = [name for name in ("d_head",) if name not in values]
    if missing:
        raise UnsupportedCheckpoint(f"the checkpoint carries no config, so {missing} must come from --preset or --d-head "
                                    "(the state dict's shapes do not fix the head width).")
    values.setdefault("num_layers", 0)
    values.setdefault("d_model", 0)
    values.setdefault("vocab_size", 0)
    values.setdefault("d_ffn", ffn_mult * values["d_model"])
    return OfficialSpec(kind=kind, **values)


def check_shapes(spec: OfficialSpec, state: dict[str, torch.Tensor]) -> OfficialSpec:
    """Fill in what the shapes fix (layers, d_model, vocab, d_ffn, recurrence, tying) and refuse a
    config that disagrees with the weights, naming the field."""
    layers = sorted({int(key.split(".")[2]) for key in state if key.startswith("backbone.layers.")})
    if not layers or layers != list(range(len(layers))):
        raise UnsupportedCheckpoint(f"backbone.layers.* are not numbered 0..n-1 (found {layers[:8]}...).")
    wte = state.get("embedding.wte.weight")
    if wte is None:
        raise UnsupportedCheckpoint("embedding.wte.weight is missing: the converted model needs the token embedding.")
    fc1 = state["backbone.layers.0.hidden_layer.fc1.weight"]
    shapes = dict(num_layers=len(layers), d_model=wte.shape[1], vocab_size=wte.shape[0],
                  d_ffn=fc1.shape[0] // (2 if spec.act_fn == "swiglu" else 1))
    for name, value in shapes.items():
        given = getattr(spec, name)
        if given and given != value:
            raise UnsupportedCheckpoint(f"{name} = {given} (config / preset) but the weights say {value}; "
                                        f"fix --{name.replace('_', '-')} or the preset.")
        setattr(spec, name, int(value))
    rows = state["backbone.layers.0.seq_layer.in_proj.weight"].shape[0]
    if spec.kind == RAT_PLUS:
        has_fgate = "backbone.layers.0.seq_layer.fgate_proj.weight" in state
        apply_re = rows == 5 * spec.d_model or (rows == 4 * spec.d_model and has_fgate)
        if rows not in (4 * spec.d_model, 5 * spec.d_model):
            raise UnsupportedCheckpoint(f"seq_layer.in_proj.weight has {rows} rows; RAT+ has 5 x d_model (4 x without recurrence).")
        spec.apply_re = apply_re
    else:
        qk = rows - 3 * spec.d_model
        if qk <= 0 or qk % (2 * spec.d_head):
            raise UnsupportedCheckpoint(f"seq_layer.in_proj.weight has {rows} rows, not 3 x d_model + 2 x ngroups x d_head "
                                        f"with d_head {spec.d_head}: check --d-head.")
        spec.ngroups = qk // (2 * spec.d_head)
    head = state.get("head.lm_head.weight")
    spec.tie_embedding = head is None or head.data_ptr() == wte.data_ptr() or (spec.tie_embedding and torch.equal(head, wte))
    return spec


def _per_layer(value, num_layers: int, name: str) -> list[int]:
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise UnsupportedCheckpoint(f"model.backbone.seq_cell.{name} lists {len(value)} values for {num_layers} layers.")
        return [int(v) for v in value]
    return [int(value)] * num_layers


def official_pattern(spec: OfficialSpec) -> dict:
    """The official inference mask (dilation_size, local_size, initial_size; per layer when they
    are lists) as a SparseInferenceConfig dict."""
    dilation = _per_layer(spec.dilation_size, spec.num_layers, "dilation_size")
    local = _per_layer(spec.local_size, spec.num_layers, "local_size")
    initial = _per_layer(spec.initial_size, spec.num_layers, "initial_size")
    if any(d < 1 for d in dilation):
        raise UnsupportedCheckpoint(f"model.backbone.seq_cell.dilation_size = {spec.dilation_size}: the local-window-only mask "
                                    "(dilation_size -1) has no exact SparseInferenceConfig; only dilations >= 1 convert.")
    if any(w < 0 for w in local) or any(i < 0 for i in initial):
        raise UnsupportedCheckpoint("model.backbone.seq_cell.local_size / initial_size must be >= 0.")
    base = dict(dilation=dilation[0], local_window=local[0], num_sink_tokens=initial[0])
    overrides = {}
    for layer, triple in enumerate(zip(dilation, local, initial)):
        if triple != (base["dilation"], base["local_window"], base["num_sink_tokens"]):
            overrides[layer] = dict(dilation=triple[0], local_window=triple[1], num_sink_tokens=triple[2])
    return dict(base, layer_overrides=overrides) if overrides else base


def hf_config_kwargs(spec: OfficialSpec) -> dict:
    """OfficialSpec -> keyword arguments of RatPlusConfig / RatConfig (refusing what has no exact form)."""
    for name, value in (("model.backbone.ln", spec.ln), ("model.backbone.hidden_cell.ln", spec.ffn_ln)):
        if value != "rmsnorm":
            raise UnsupportedCheckpoint(f"{name} = {value!r}: hf-hybrid's backbone uses RMSNorm only (the official 'rmsnorm').")
    if spec.bias:
        raise UnsupportedCheckpoint("model.backbone.seq_cell.bias = true: the token mixers have no projection biases.")
    if spec.act_fn not in ACTIVATIONS:
        raise UnsupportedCheckpoint(f"model.backbone.hidden_cell.act_fn = {spec.act_fn!r}: convertible activations are {sorted(ACTIVATIONS)}.")
    expected_pe = "rope" if spec.kind == RAT_PLUS else "interrope"
    if spec.pe != expected_pe:
        raise UnsupportedCheckpoint(f"model.embedding.pe._name_ = {spec.pe!r}: {spec.kind} converts with {expected_pe!r} positions "
                                    "(RAT: RoPE at the chunk index; RAT+: RoPE at the token position).")
    if spec.d_model % spec.d_head:
        raise UnsupportedCheckpoint(f"model.backbone.seq_cell.d_head ({spec.d_head}) must divide d_model ({spec.d_model}).")
    mlp_type, hidden_act = ACTIVATIONS[spec.act_fn]
    kwargs = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.d_ffn, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.d_model // spec.d_head, num_key_value_heads=spec.d_model // spec.d_head, head_dim=spec.d_head,
        rope_theta=float(spec.rope_base), max_position_embeddings=spec.seq_len, rms_norm_eps=OFFICIAL_NORM_EPS,
        tie_word_embeddings=spec.tie_embedding, mlp_type=mlp_type, hidden_act=hidden_act, mlp_bias=spec.ffn_bias,
        # Llama tokenizer ids (the official data pipeline tokenizes with Llama's tokenizer)
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    if spec.kind == RAT_PLUS:
        pattern = official_pattern(spec)
        kwargs.update(use_recurrence=spec.apply_re, use_rope=True)
        if spec.joint_train:
            # Joint training: dense and the sparse pattern on every batch; inference defaults to dense.
            simple = "layer_overrides" not in pattern and not pattern["local_window"] and not pattern["num_sink_tokens"]
            kwargs.update(training_dilations=[1, pattern["dilation"] if simple else pattern], sparse_config=None)
        else:
            # An adapted model: trained and run with its pattern, which becomes the default at inference.
            kwargs.update(training_dilations=[pattern], sparse_config=pattern)
    else:
        if spec.chunk_size < 1:
            raise UnsupportedCheckpoint(f"model.backbone.seq_cell.chunk_size = {spec.chunk_size} must be >= 1.")
        if (spec.d_model // spec.d_head) % spec.ngroups:
            raise UnsupportedCheckpoint(f"model.backbone.seq_cell.ngroups ({spec.ngroups}) must divide the {spec.d_model // spec.d_head} heads.")
        kwargs.update(chunk_size=spec.chunk_size, num_qk_groups=spec.ngroups, use_rope=True, layer_types=["rat"] * spec.num_layers)
    return kwargs


def official_config(config, kind: str) -> dict:
    """An hf-hybrid config -> the official hydra config fields (plain dicts) for ``--to official``."""
    if config.mlp_type == "gated" and config.hidden_act == "silu":
        act_fn = "swiglu"
    else:
        reverse = {v: k for k, v in ACTIVATIONS.items() if v[0] == "plain"}
        if (config.mlp_type, config.hidden_act) not in reverse:
            raise UnsupportedCheckpoint(f"mlp_type={config.mlp_type!r} with hidden_act={config.hidden_act!r} has no official FFN.")
        act_fn = reverse[(config.mlp_type, config.hidden_act)]
    if config.rms_norm_eps != OFFICIAL_NORM_EPS:
        raise UnsupportedCheckpoint(f"rms_norm_eps = {config.rms_norm_eps}: the official code hard-codes 1e-6.")
    if config.num_key_value_heads != config.num_attention_heads or config.head_dim * config.num_attention_heads != config.hidden_size:
        raise UnsupportedCheckpoint("num_key_value_heads / head_dim: the official layers have num_heads x d_head = d_model and no GQA.")
    seq = dict(_name_=kind, d_model=config.hidden_size, d_head=config.head_dim, num_head=config.num_attention_heads,
               k_channel=config.head_dim, bias=False, ln="rmsnorm")
    if kind == RAT_PLUS:
        if getattr(config, "recurrence_gate_bias", False):
            raise UnsupportedCheckpoint("recurrence_gate_bias = true: the official RAT+ gate has no bias.")
        patterns = [p if isinstance(p, dict) else dict(dilation=p, local_window=0, num_sink_tokens=0) for p in config.training_dilations]
        sparse = [p for p in patterns if p.get("dilation", 1) != 1 or p.get("local_window", 0) or p.get("num_sink_tokens", 0)]
        joint = len(config.training_dilations) > 1
        pattern = (sparse[0] if sparse else dict(dilation=1, local_window=0, num_sink_tokens=0)) if joint else config.sparse_config
        if pattern.get("top_k") is not None or pattern.get("layer_overrides") or pattern.get("head_overrides"):
            raise UnsupportedCheckpoint(f"sparse pattern {pattern}: the official config holds one dilation / local / initial "
                                        "triple (no top-k, no per-layer or per-head overrides).")
        seq.update(dilation_size=pattern.get("dilation", 1), local_size=pattern.get("local_window", 0),
                   initial_size=pattern.get("num_sink_tokens", 0), apply_re=config.use_recurrence, joint_train=joint)
        pe = dict(_name_="rope", dim=config.head_dim, base=config.rope_theta, max_seq_len=config.max_position_embeddings)
    else:
        seq.update(chunk_size=config.chunk_size, ngroups=config.num_qk_groups)
        pe = dict(_name_="interrope", dim=config.head_dim, base=config.rope_theta, chunk_size=config.chunk_size,
                  max_num_chunk=config.max_position_embeddings // config.chunk_size)
    ffn = dict(_name_="ffn", d_model=config.hidden_size, d_ffn=config.intermediate_size, act_fn=act_fn, bias=config.mlp_bias, ln="rmsnorm")
    return dict(
        model=dict(backbone=dict(_name_="sequence", num_layers=config.num_hidden_layers, d_model=config.hidden_size, ln="rmsnorm",
                                 bias=False, seq_cell=seq, hidden_cell=ffn),
                   embedding=dict(_name_="lm", vocab_size=config.vocab_size, seq_len=config.max_position_embeddings,
                                  d_model=config.hidden_size, pe=pe),
                   head=dict(_name_="lm", vocab_size=config.vocab_size, d_model=config.hidden_size)),
        task=dict(_name_="lm", tie_embedding=bool(config.tie_word_embeddings)),
        data=dict(vocab_size=config.vocab_size, seq_len=config.max_position_embeddings),
    )
