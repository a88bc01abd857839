"""RATTENTION local-global models as transformers models.

Block (shared backbone, ``hf_hybrid.layers.backbone``): x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Mixer per ``config.layer_types``:
  * ``local``  -> :class:`hf_hybrid.layers.residual_linear_attention.RattentionLocalAttention`:
                  sliding-window attention (window w, QK-norm, RoPE theta 5e5) + residual linear
                  attention over the tokens that left the window (raw q/k/v, feature map phi),
                  o = W_o (RMSNorm_h(o_swa) + RMSNorm_h(o_rla))
  * ``global`` -> :class:`hf_hybrid.layers.residual_linear_attention.RattentionGlobalAttention`:
                  full causal attention, QK-norm, no RoPE
Cache: :class:`RattentionCache` (window K/V + RLA state for local layers, all K/V for global ones).
"""
from __future__ import annotations

from torch import nn

from ...layers.residual_linear_attention import RattentionGlobalAttention, RattentionLocalAttention
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel
from ..heads import HybridForQuestionAnswering, HybridForSequenceClassification, HybridForTokenClassification
from .cache_rattention import RattentionCache
from .configuration_rattention import RattentionConfig


class RattentionPreTrainedModel(HybridPreTrainedModel):
    config_class = RattentionConfig
    config: RattentionConfig


class RattentionModel(RattentionPreTrainedModel, HybridModel):
    cache_class = RattentionCache

    def build_mixer(self, config: RattentionConfig, layer_idx: int) -> nn.Module:
        if config.layer_types[layer_idx] == "global":
            return RattentionGlobalAttention(
                config.hidden_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                qk_norm=config.qk_norm,
                rms_norm_eps=config.rms_norm_eps,
                config=config,  # the layer reads config._attn_implementation at every call
                layer_idx=layer_idx,
            )
        return RattentionLocalAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.window_size,
            feature_map=config.feature_map,
            use_rla=config.use_residual_linear_attention,
            qk_norm=config.qk_norm,
            rope_theta=config.rope_theta,
            rms_norm_eps=config.rms_norm_eps,
            branch_norm_eps=config.branch_norm_eps,
            backend=config.kernel_backend,
        )


class RattentionForCausalLM(RattentionPreTrainedModel, HybridForCausalLM):
    base_model_class = RattentionModel


class RattentionForSequenceClassification(HybridForSequenceClassification, RattentionPreTrainedModel):
    base_model_class = RattentionModel


class RattentionForTokenClassification(HybridForTokenClassification, RattentionPreTrainedModel):
    base_model_class = RattentionModel


class RattentionForQuestionAnswering(HybridForQuestionAnswering, RattentionPreTrainedModel):
    base_model_class = RattentionModel


__all__ = [
    "RattentionPreTrainedModel",
    "RattentionModel",
    "RattentionForCausalLM",
    "RattentionForSequenceClassification",
    "RattentionForTokenClassification",
    "RattentionForQuestionAnswering",
]
