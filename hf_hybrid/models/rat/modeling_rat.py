"""RAT, RAT-SWA and their attention baselines as transformers models.

Block (shared backbone, ``hf_hybrid.layers.backbone``): x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Mixer per ``config.layer_types``:
  * ``rat``               -> :class:`hf_hybrid.layers.rat_attention.RatAttention` (Eq. 3: intra-chunk gated
                             recurrence on k and v, inter-chunk attention over chunk ends + own key,
                             chunk-index RoPE, output gate)
  * ``sliding_attention`` -> softmax attention over a window of ``config.sliding_window`` tokens
  * ``full_attention``    -> causal softmax attention
Cache: :class:`RatCache` (chunk ends + recurrent state for RAT layers, K/V windows otherwise).
"""
from __future__ import annotations

from torch import nn

from ...layers.attention import SoftmaxAttention
from ...layers.rat_attention import RatAttention
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel
from ..heads import HybridForQuestionAnswering, HybridForSequenceClassification, HybridForTokenClassification
from .cache_rat import RatCache
from .configuration_rat import RatConfig


class RatPreTrainedModel(HybridPreTrainedModel):
    config_class = RatConfig
    config: RatConfig


class RatModel(RatPreTrainedModel, HybridModel):
    cache_class = RatCache

    def build_mixer(self, config: RatConfig, layer_idx: int) -> nn.Module:
        layer_type = config.layer_types[layer_idx]
        rope_theta = config.rope_theta if config.use_rope else None
        if layer_type == "rat":
            return RatAttention(
                config.hidden_size,
                config.num_attention_heads,
                config.head_dim,
                config.chunk_size,
                config.num_qk_groups,
                rope_theta,
                backend=config.kernel_backend,
            )
        return SoftmaxAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            rope_theta,
            sliding_window=config.sliding_window if layer_type == "sliding_attention" else None,
            config=config,  # the layer reads config._attn_implementation at every call
            layer_idx=layer_idx,
        )


class RatForCausalLM(RatPreTrainedModel, HybridForCausalLM):
    base_model_class = RatModel


class RatForSequenceClassification(HybridForSequenceClassification, RatPreTrainedModel):
    base_model_class = RatModel


class RatForTokenClassification(HybridForTokenClassification, RatPreTrainedModel):
    base_model_class = RatModel


class RatForQuestionAnswering(HybridForQuestionAnswering, RatPreTrainedModel):
    base_model_class = RatModel


__all__ = [
    "RatPreTrainedModel",
    "RatModel",
    "RatForCausalLM",
    "RatForSequenceClassification",
    "RatForTokenClassification",
    "RatForQuestionAnswering",
]
