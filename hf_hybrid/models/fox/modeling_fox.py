"""FoX (Forgetting Transformer) as a transformers model: LLaMA and Pro blocks.

Block (shared backbone, ``hf_hybrid.layers.backbone``): x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Mixer: :class:`hf_hybrid.layers.forgetting_attention.ForgettingAttention`, softmax attention whose
logits get the forget-gate bias c_i - c_j (c = cumsum log f per head); ``block_type="pro"`` adds
QK-norm, KV-shift, output gate and per-head output norm (FoX paper Sec. 3, Appendix A).
Cache: :class:`FoxCache` (K/V, cumulative log forget per head, KV-shift state).
"""
from __future__ import annotations

from torch import nn

from ...layers.forgetting_attention import ForgettingAttention
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel
from ..heads import HybridForQuestionAnswering, HybridForSequenceClassification, HybridForTokenClassification
from .cache_fox import FoxCache
from .configuration_fox import FoxConfig


class FoxPreTrainedModel(HybridPreTrainedModel):
    config_class = FoxConfig
    config: FoxConfig


class FoxModel(FoxPreTrainedModel, HybridModel):
    cache_class = FoxCache

    def build_mixer(self, config: FoxConfig, layer_idx: int) -> nn.Module:
        return ForgettingAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            qk_norm=config.qk_norm,
            kv_shift=config.kv_shift,
            output_gate=config.output_gate,
            output_norm=config.output_norm,
            forget_gate=config.forget_gate,
            forget_gate_t_min=config.forget_gate_t_min,
            forget_gate_t_max=config.forget_gate_t_max,
            rope_theta=config.rope_theta if config.use_rope else None,
            rms_norm_eps=config.rms_norm_eps,
            qk_norm_eps=config.qk_norm_eps,
            backend=config.kernel_backend,
        )


class FoxForCausalLM(FoxPreTrainedModel, HybridForCausalLM):
    base_model_class = FoxModel


class FoxForSequenceClassification(HybridForSequenceClassification, FoxPreTrainedModel):
    base_model_class = FoxModel


class FoxForTokenClassification(HybridForTokenClassification, FoxPreTrainedModel):
    base_model_class = FoxModel


class FoxForQuestionAnswering(HybridForQuestionAnswering, FoxPreTrainedModel):
    base_model_class = FoxModel


__all__ = [
    "FoxPreTrainedModel",
    "FoxModel",
    "FoxForCausalLM",
    "FoxForSequenceClassification",
    "FoxForTokenClassification",
    "FoxForQuestionAnswering",
]
