"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over an hf-hybrid model, one unit per DecoderLayer.

FSDP2 all-gathers a unit's parameters before its forward (and again before its backward) and
hands the module plain tensors for the duration, so the mixers' custom ops, which read
``proj.weight`` directly instead of calling the projection, see whole weights with no copy of
their own. The root unit holds the embeddings, the final norm and the LM head (one unit: the LM
head may be tied to the embeddings). accelerate's ``fsdp_version: 2`` with
``fsdp_transformer_layer_cls_to_wrap: DecoderLayer`` builds the same units
(examples/accelerate/fsdp2.yaml).
"""
from __future__ import annotations

from torch import nn

from ..layers.backbone import DecoderLayer


def shard_decoder_layers(model: nn.Module, mesh, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """Apply ``fully_shard`` to every DecoderLayer of ``model`` and then to ``model`` itself, in
    place, on ``mesh`` (a 1-D DeviceMesh). ``mp_policy``: an FSDP2 MixedPrecisionPolicy (e.g.
    bf16 parameters with float32 gradient reduction), None for the parameters' own dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = [module for module in model.modules() if isinstance(module, DecoderLayer)]
    if not layers:
        raise ValueError(f"shard_decoder_layers: {type(model).__name__} has no DecoderLayer; pass an hf-hybrid model.")
    options = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model
