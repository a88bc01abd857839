"""DeepSpeed ZeRO-3 over an hf-hybrid model: each DecoderLayer one gather unit.

ZeRO-3 gathers a module's parameters in hooks around that module's own forward. The mixers read
some of their sub-modules' weights directly (the shared-input projection Function, RAT's fused
gate, the fused norms, SE's causal convolution) without calling those sub-modules, so under the
default per-module hooks those weights would still be partitioned (empty) when read. Marking
DecoderLayer a ZeRO-3 "leaf" module makes DeepSpeed gather all of a layer's parameters before the
layer runs and release them after, as FSDP2 does per layer; the custom ops then read the gathered
tensors in place (no copy per step).

RAT+'s joint objective (several training patterns per step) runs here as ONE forward over the
patterns' rows stacked along the batch (``models/rat_plus/stacked_patterns.py``, chosen when the
parameters carry DeepSpeed's ``ds_id``): every parameter is gathered and its gradient reduced once
per step, as ZeRO-3's hooks require (one forward per pattern would reduce a parameter twice,
DeepSpeed issue #5321; a pattern's backward inside the forward is refused by its hooks).
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
    set_z3_leaf_modules(model, [DecoderLayer])
    return model
