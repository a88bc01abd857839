"""What a training forward keeps for its backward: saved bytes per token and layer, by op.

A training step's activation memory is the tensors the forward's ops save for the backward, held
until that backward runs. This runs one training forward (``model(input_ids, labels=...)``) under
``torch.autograd.graph.saved_tensors_hooks`` and records every saved tensor once per storage (a
storage saved by several ops, or as several views, costs its bytes once: that is the real memory),
tagged with the op that saved it first and the module it ran in. Parameters and tensors that do not
grow with the sequence (RoPE tables, the loss's scalars) are reported apart from the per-token sum.

Saved bytes grow linearly in the tokens, so tiny CPU shapes (Triton's interpreter,
``TRITON_INTERPRET=1``, ``kernel_backend="triton"``: the same autograd Functions save the same
tensors as on the GPU) give the per-token figure of the real shape, up to the per-head widths.

    TRITON_INTERPRET=1 python -m benchmarks.saved_tensors     RAT, RAT-SWA, RATTENTION, Llama, tiny shape

Activation recomputation (hf_hybrid/layers/recompute.py) stacks its own hooks above these: what
it rebuilds in the backward is never handed to them, so it is not counted, as it is not kept.
"""
from __future__ import annotations

import argparse
import linecache
import os
import re
import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_RECOMPUTE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layers", "recompute.py")


@dataclass
class SavedStorage:
    nbytes: int
    op: str  # the first op that saved it
    module: str  # the module it was saved in, layer index as "*"
    layer: int | None  # decoder layer index, None outside the layers
    saved_by: set[str] = field(default_factory=set)


@dataclass
class SavedReport:
    tokens: int
    num_layers: int
    storages: list[SavedStorage]
    fixed_bytes: int  # saved storages that do not grow with the tokens (tables, scalars)

    def per_token(self, layer_only: bool = True) -> float:
        """Saved bytes per token, per decoder layer (layer_only) or for the whole model."""
        chosen = [s for s in self.storages if s.layer is not None or not layer_only]
        total = sum(s.nbytes for s in chosen)
        return total / self.tokens / (self.num_layers if layer_only else 1)

    def by_op(self) -> dict[tuple[str, str], float]:
        """Bytes per token and layer, grouped by (module, op), largest first (decoder layers only)."""
        groups: dict[tuple[str, str], float] = defaultdict(float)
        for s in self.storages:
            if s.layer is not None:
                groups[(s.module, s.op)] += s.nbytes / self.tokens / self.num_layers
        return dict(sorted(groups.items(), key=lambda kv: -kv[1]))

    def table(self) -> str:
        rows = [f"{'bytes/token/layer':>18}  module / op"]
        for (module, op), value in self.by_op().items():
            rows.append(f"{value:18.1f}  {module} / {op}")
        rows.append(f"{self.per_token():18.1f}  total per layer (outside the layers: "
                    f"{self.per_token(False) * 1 - self.per_token() * self.num_layers:.1f} per token; fixed "
                    f"{self.fixed_bytes} bytes)")
        return "\n".join(rows)


def _op_label() -> str:
    """The saving op, from the Python stack at pack time: a hf_hybrid kernel op by name, else the
    innermost caller outside torch with the torch function it called (``file:line text [via fn]``)."""
    frame, torch_fn = sys._getframe(1), None
    while frame is not None:
        code = frame.f_code
        if code.co_filename in (__file__, _RECOMPUTE_FILE):  # the hooks themselves
            frame = frame.f_back
            continue
        if code.co_name == "__call__" and code.co_filename.endswith("_custom_ops.py"):
            return f"hf_hybrid::{frame.f_locals['self']._name}"
        if code.co_filename.startswith(_TORCH_DIR):
            torch_fn = torch_fn or code.co_name
        else:
            text = linecache.getline(code.co_filename, frame.f_lineno).strip()[:60]
            where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {text}"
            return where if torch_fn is None else f"{where} [via {torch_fn}]"
        frame = frame.f_back
    return "?"


class _Packed:
    """What the pack hook hands autograd: the tensor, in an object the recorder can watch (weakly)
    to tell whether a save is still held once the forward is done."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _SavedTensorRecorder:
    """Pack hook: one record per save, tagged with its op and module (found on the Python stack,
    not with module hooks: a hooked module takes other code paths, layers/projections.py)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.names = {id(m): name for name, m in model.named_modules()}
        self.saves: list[tuple[weakref.ref, int, int, str, str]] = []  # (packed, storage, bytes, op, module)

    def _module(self) -> str:
        frame = sys._getframe(1)
        while frame is not None:
            name = self.names.get(id(frame.f_locals.get("self")))
            if name is not None:
                return name
            frame = frame.f_back
        return ""

    def pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self.params or storage.nbytes() == 0:
            return tensor
        packed = _Packed(tensor)
        self.saves.append((weakref.ref(packed), storage.data_ptr(), storage.nbytes(), _op_label(), self._module()))
        return packed

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Packed) else packed

    def held(self) -> list[SavedStorage]:
        """One record per storage that some save still holds (a save that recomputation let go
        is not held: its packed object is gone), tagged with the first op that saved it."""
        storages: dict[int, SavedStorage] = {}
        for ref, ptr, nbytes, op, name in self.saves:
            if ref() is None:
                continue
            if ptr in storages:
                storages[ptr].saved_by.add(op)
                continue
            match = re.search(r"\blayers\.(\d+)\b", name)
            module = re.sub(r"\blayers\.\d+\b", "layers.*", name)
            storages[ptr] = SavedStorage(nbytes, op, module, int(match.group(1)) if match else None, {op})
        return list(storages.values())


# The recorder marks its pack hook as observing only: layers/recompute.py then still applies and
# stacks its own hooks above it, passing through what it does not rebuild.
def _observer(fn):
    fn.observes_only = True
    return fn


def saved_tensor_report(model: torch.nn.Module, input_ids: torch.Tensor, *, min_bytes_per_token: float = 1.0,
                        **forward_kwargs) -> SavedReport:
    """Run ``model(input_ids, labels=input_ids, **forward_kwargs)`` with gradients and report what its
    backward would read. Storages smaller than ``min_bytes_per_token`` x tokens (tables, scalars
    and other fixed-size saves) go to ``fixed_bytes``."""
    recorder = _SavedTensorRecorder(model)
    pack = _observer(lambda t: recorder.pack(t))
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, recorder.unpack):
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False, **forward_kwargs)
    tokens = input_ids.numel()
    storages, fixed = [], 0
    for record in recorder.held():
        if record.nbytes < min_bytes_per_token * tokens:
            fixed += record.nbytes
        else:
            storages.append(record)
    del out
    num_layers = model.config.num_hidden_layers
    return SavedReport(tokens, num_layers, storages, fixed)


# ------------------------------------------------------------------------------ the models compared

TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4)
# The bench's widths (hf_hybrid/bench/models.py FULL_SHAPE) with 2 layers: per-token bytes as at the
# 1.3B shape; slow in the interpreter, so with a short sequence.
WIDE_SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16)


def build_model(name: str, shape: dict | None = None, dtype: torch.dtype = torch.float32, backend: str = "triton"):
    """RAT / RAT-SWA / RATTENTION (our configs, ``kernel_backend=backend``) or Llama (transformers),
    built at ``shape`` (default TINY_SHAPE: head_dim 16, the smallest the kernels take)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_hybrid  # noqa: F401  (registers the architectures)
    from hf_hybrid.models.rat import RatConfig

    shape = dict(TINY_SHAPE if shape is None else shape)
    layers = shape["num_hidden_layers"]
    torch.manual_seed(0)
    if name == "Llama":
        config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=4096,
                             pad_token_id=0, attn_implementation="sdpa")
        return LlamaForCausalLM(config).to(dtype).train()
    overrides = {
        "RAT": dict(model_type="rat", chunk_size=8),
        "RAT-SWA": dict(model_type="rat", chunk_size=8, sliding_window=16,
                        layer_types=RatConfig.hybrid_layer_types(layers, "rat")),
        "RATTENTION": dict(model_type="rattention", window_size=16),
    }[name]
    config = AutoConfig.for_model(**overrides, **shape, kernel_backend=backend, pad_token_id=0,
                                  max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(config).to(dtype).train()


MODELS = ("RAT", "RAT-SWA", "RATTENTION", "Llama")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--wide", action="store_true", help="the bench's widths (hidden 2048, 16 heads, SwiGLU 5632)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--backend", default="triton", help="kernel_backend of our models (triton needs CUDA or TRITON_INTERPRET=1)")
    parser.add_argument("--quiet", action="store_true", help="totals only, no per-op table")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    for name in args.models.split(","):
        model = build_model(name, WIDE_SHAPE if args.wide else None, dtype=dtype, backend=args.backend)
        ids = torch.randint(3, model.config.vocab_size, (1, args.seq))
        report = saved_tensor_report(model, ids)
        print(f"== {name}: {report.per_token():.1f} bytes per token and layer saved "
              f"({args.dtype}, T={args.seq}, hidden {model.config.hidden_size})")
        if not args.quiet:
            print(report.table())


if __name__ == "__main__":
    main()
