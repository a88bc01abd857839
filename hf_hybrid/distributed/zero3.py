"""DeepSpeed ZeRO-3 over an hf-hybrid model: each DecoderLayer one gather unit.

ZeRO-3 gathers a module's parameters in hooks around that module's own forward. The mixers read
some of their sub-modules' weights directly (the shared-input projection Function, RAT's fused
gate, the fused norms, SE's causal convolution) without calling those sub-modules, so under the
default per-module hooks those weights would still be partitioned (empty) when read. Marking
DecoderLayer a ZeRO-3 "leaf" module makes DeepSpeed gather all of a layer's parameters before the
layer runs and release them after, as FSDP2 does per layer; the custom ops then read the gathered
tensors in place (no copy per step).

One model cannot train under ZeRO-3: RAT+ with its joint objective of several training patterns.
Keeping every pattern's graph until the backward, ZeRO-3 reduces the gradient of a parameter used
by several forwards more than once in one backward (DeepSpeed 0.19's bucket check fails: DeepSpeed
issue #5321); running each other pattern's backward inside the forward (what RAT+ does elsewhere),
DeepSpeed's backward hooks refuse ``torch.autograd.grad``. FSDP2 trains it.
"""
from __future__ import annotations

from torch import nn

from ..layers.backbone import DecoderLayer


def gather_whole_decoder_layers(model: nn.Module) -> nn.Module:
    """Mark every DecoderLayer of ``model`` a ZeRO-3 leaf module (needs the ``deepspeed`` package).
    Call it before the model reaches ``deepspeed.initialize`` (before ``Trainer.train()``)."""
    try:
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError as error:
        raise ImportError("gather_whole_decoder_layers needs DeepSpeed: pip install deepspeed") from error
    if not any(isinstance(module, DecoderLayer) for module in model.modules()):
        raise ValueError(f"gather_whole_decoder_layers: {type(model).__name__} has no DecoderLayer; pass an hf-hybrid model.")
    patterns = getattr(getattr(model, "config", None), "training_dilations", None)
    if patterns is not None and len(patterns) > 1:
        raise ValueError(
            f"gather_whole_decoder_layers: this RAT+ model trains {len(patterns)} patterns per step "
            f"(training_dilations={list(patterns)}), one forward each, which DeepSpeed ZeRO-3 cannot "
            "partition gradients for. Train it with FSDP2 (examples/accelerate/fsdp2.yaml), or with a "
            "single pattern under ZeRO-3 (e.g. training_dilations=[64])."
        )
    set_z3_leaf_modules(model, [DecoderLayer])
    return model
