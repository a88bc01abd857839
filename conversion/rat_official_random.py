"""Random checkpoints in the RAT / RAT+ authors' format, to try the converter without a download.

``write_random_official_checkpoint`` saves what the official trainer saves (``task`` state dict,
the hydra config pickled as an ``easydict.EasyDict``, step, optimizer and scheduler states), with
the official key names and layouts (rat_official_weights.py) and random weights. The tests and
``examples/convert_rat_plus_official.py`` use it; neither authors' package is needed.
"""
from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch

from .rat_official_format import RAT, RAT_PLUS


class _EasyDictStandIn(dict):
    """Pickles exactly as easydict.EasyDict does (items plus the same values as attributes)."""

    def __init__(self, values=None):
        super().__init__()
        for key, value in (values or {}).items():
            value = _EasyDictStandIn(value) if isinstance(value, dict) else value
            self[key] = value
            setattr(self, key, value)


_EasyDictStandIn.__module__, _EasyDictStandIn.__name__, _EasyDictStandIn.__qualname__ = "easydict", "EasyDict", "EasyDict"


@contextmanager
def _easydict_module():
    """The pickle names the class easydict.EasyDict; pickle looks it up there while saving."""
    if "easydict" in sys.modules:
        yield sys.modules["easydict"].EasyDict
        return
    module = types.ModuleType("easydict")
    module.EasyDict = _EasyDictStandIn
    sys.modules["easydict"] = module
    try:
        yield _EasyDictStandIn
    finally:
        del sys.modules["easydict"]


def random_official_config(kind: str = RAT_PLUS, num_layers: int = 2, d_model: int = 64, d_head: int = 16, vocab_size: int = 128,
                           seq_len: int = 64, act_fn: str = "gelu", ffn_bias: bool = False, tie_embedding: bool = True,
                           rope_base: float = 10000.0, **seq_cell) -> dict:
    """The official hydra config (resolved) of a small model; ``seq_cell`` overrides the mixer's fields."""
    if kind == RAT_PLUS:
        seq = dict(_name_="ratplus", d_model=d_model, d_head=d_head, num_head=d_model // d_head, k_channel=d_head, bias=False,
                   ln="rmsnorm", dilation_size=64, local_size=0, initial_size=0, apply_re=True, joint_train=True)
        pe = dict(_name_="rope", dim=d_head, base=rope_base, max_seq_len=seq_len)
    else:
        seq = dict(_name_="rat", d_model=d_model, d_head=d_head, num_head=d_model // d_head, k_channel=d_head, bias=False,
                   ngroups=2, chunk_size=16, ln="rmsnorm")
        pe = dict(_name_="interrope", dim=d_head, base=rope_base, chunk_size=seq_cell.get("chunk_size", 16))
    seq.update(seq_cell)
    ffn = dict(_name_="ffn", d_model=d_model, ln="rmsnorm", d_ffn=4 * d_model, act_fn=act_fn, bias=ffn_bias, dropout=0.0)
    return dict(
        model=dict(backbone=dict(_name_="sequence", num_layers=num_layers, d_model=d_model, bias=False, ln="rmsnorm", dropout=0.0,
                                 init=dict(_name_="fixed", initializer_range=0.02), seq_cell=seq, hidden_cell=ffn),
                   embedding=dict(_name_="lm", vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, pe=pe),
                   head=dict(_name_="lm", vocab_size=vocab_size, d_model=d_model)),
        task=dict(_name_="lm", tie_embedding=tie_embedding, ignore_index=-100),
        data=dict(vocab_size=vocab_size, seq_len=seq_len),
        trainer=dict(dtype="bfloat16", torch_compile=True),
    )


def random_official_state(config: dict, seed: int = 0, compiled: bool = True) -> dict[str, torch.Tensor]:
    """Random weights with the official names and shapes (``_orig_mod.`` prefixes when ``compiled``,
    as torch.compile leaves them; the tied head shares the embedding's tensor)."""
    generator = torch.Generator().manual_seed(seed)
    backbone, embedding = config["model"]["backbone"], config["model"]["embedding"]
    seq, ffn = backbone["seq_cell"], backbone["hidden_cell"]
    d, vocab = backbone["d_model"], embedding["vocab_size"]

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=generator) * std

    def norm_weight():
        return 1.0 + 0.1 * torch.randn(d, generator=generator)

    prefix = "_orig_mod." if compiled else ""
    wte = normal(vocab, d, std=0.5)
    state = {"embedding.wte.weight": wte}
    d_ffn = ffn["d_ffn"] * (2 if ffn["act_fn"] == "swiglu" else 1)
    for i in range(backbone["num_layers"]):
        p = f"backbone.layers.{i}."
        if seq["_name_"] == "ratplus":
            rows = 5 * d if seq.get("apply_re", True) else 4 * d
        else:
            rows = 3 * d + 2 * seq["ngroups"] * seq["d_head"]
            chunk = seq["chunk_size"]
            # official init: log(u), u ~ U(1, L - 1); random values at L = 1 (the official code leaves them uninitialised)
            state[p + "seq_layer.gate_bias"] = (torch.rand(d, generator=generator) * max(chunk - 2, 1) + 1).log()
        state[p + "seq_layer.in_proj.weight"] = normal(rows, d, std=0.2)
        state[p + "seq_layer.input_norm.weight"] = norm_weight()
        state[p + "seq_layer.out_proj.weight"] = normal(d, d, std=0.2)
        state[p + "hidden_layer.fc1.weight"] = normal(d_ffn, d, std=0.2)
        state[p + "hidden_layer.fc2.weight"] = normal(d, ffn["d_ffn"], std=0.2)
        if ffn.get("bias"):
            state[p + "hidden_layer.fc1.bias"] = normal(d_ffn, std=0.1)
            state[p + "hidden_layer.fc2.bias"] = normal(d, std=0.1)
        state[p + "hidden_layer.ln.weight"] = norm_weight()
    state["backbone.ln.weight"] = norm_weight()
    state["head.lm_head.weight"] = wte if config["task"]["tie_embedding"] else normal(vocab, d, std=0.5)
    return {prefix + key: value for key, value in state.items()}


def write_random_official_checkpoint(path: str | Path, kind: str = RAT_PLUS, seed: int = 0, with_config: bool = True,
                                     **config_kwargs) -> Path:
    """Save a random official-format checkpoint to ``path`` (a .pth file); returns the path."""
    config = random_official_config(kind, **config_kwargs)
    state = random_official_state(config, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not with_config:
        torch.save({key.replace("_orig_mod.", ""): value for key, value in state.items()}, path)
        return path
    with _easydict_module() as easydict:
        optimizer = {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]}
        torch.save({"task": state, "config": easydict(config), "step": 10, "optimizer": optimizer,
                    "lr_scheduler": {"last_epoch": 10, "base_lrs": [8e-4]}, "resume_kwargs": easydict({"epoch": 0})}, path)
    return path
