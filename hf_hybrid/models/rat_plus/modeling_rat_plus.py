"""RAT+ as a transformers model: train dense, infer sparse (RAT+ paper Sec. 4-5).

Block (shared backbone, ``hf_hybrid.layers.backbone``): x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)),
with :class:`hf_hybrid.layers.rat_plus_attention.RatPlusAttention` as the mixer of every layer
(full-sequence gated recurrence on k and v, RoPE after it, output gate, sparse pattern per call).

Inference pattern per call: ``model(ids, sparse_config=SparseInferenceConfig(...))`` and
``model.generate(ids, sparse_config=...)`` (generate hands unknown keywords to forward as
model_kwargs, which is why ``sparse_config`` is an explicit forward parameter); without it, the
config's stored default is used. Decoding uses :class:`RatPlusCache`, which keeps only what the
pattern needs.

Active recurrence learning (paper Sec. 4 "Active recurrence learning", Table 12; official code):
the paper trains every batch in a dense case (D = 1) and a sparse case (D = L* = 64, no window,
no sinks), so the recurrence must learn the length 64 that dilation needs, while the dense case
keeps full attention capacity; the official code runs two forwards of the same batch, switching
the whole model between the two masks. The paper does not write the combination rule; Table 12's
ablation "0.5 L_D64 + 0.5 L_D1" is reported worse "because dense connectivity is not sufficiently
learned", which reads as splitting each batch between the cases (a constant factor on the loss
hardly changes Adam's steps). Our choice: every training pattern sees the whole batch and the
loss is sum_i w_i L_i with w_i = 1 by default (``training_loss_weights`` changes it), costing one
forward per pattern. The patterns come from ``config.training_dilations`` (default [1, 64]) or
the forward keyword ``training_dilations=``; it applies in training mode when ``labels`` are
given and no ``sparse_config`` is passed (an explicit ``sparse_config`` trains that one pattern,
e.g. for single-pattern resolution adaptation), and in any mode when ``training_dilations`` is
passed explicitly. The returned logits (hidden_states, attentions) are the first pattern's; ``pattern_losses`` holds
each pattern's loss (detached) for logging.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...layers.rat_plus_attention import RatPlusAttention
from ...sparse import SparseInferenceConfig
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel
from ..heads import HybridForQuestionAnswering, HybridForSequenceClassification, HybridForTokenClassification
from .cache_rat_plus import RatPlusCache
from .configuration_rat_plus import RatPlusConfig


@dataclass
class RatPlusCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus ``pattern_losses`` [num_patterns] when the joint objective ran."""

    pattern_losses: torch.FloatTensor | None = None


class RatPlusPreTrainedModel(HybridPreTrainedModel):
    config_class = RatPlusConfig
    config: RatPlusConfig


class RatPlusModel(RatPlusPreTrainedModel, HybridModel):
    cache_class = RatPlusCache
    mixer_forward_kwargs = ("sparse_config",)

    def build_mixer(self, config: RatPlusConfig, layer_idx: int) -> nn.Module:
        return RatPlusAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            layer_idx,
            rope_theta=config.rope_theta if config.use_rope else None,
            use_recurrence=config.use_recurrence,
            recurrence_gate_bias=config.recurrence_gate_bias,
            backend=config.kernel_backend,
        )

    def _check_cache(self, cache: Cache) -> None:
        if not isinstance(cache, RatPlusCache):
            raise TypeError(
                f"past_key_values must be a RatPlusCache (build it with RatPlusCache(model.config)); got {type(cache).__name__}."
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        sparse_config: SparseInferenceConfig | dict | None = None,
        **kwargs,
    ):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            sparse_config=self.config.resolve_sparse_config(sparse_config),
            **kwargs,
        )


class RatPlusForCausalLM(RatPlusPreTrainedModel, HybridForCausalLM):
    base_model_class = RatPlusModel

    def _rebuilds_earlier_patterns(self, num_patterns: int, kwargs: dict) -> bool:
        """Whether the joint objective's earlier patterns run under activation checkpointing: on CPU,
        with gradients and more than one pattern (and no hidden states / attentions asked for, which
        would be kept anyway). Their graphs would otherwise stay alive while the last pattern runs,
        so a step held one forward's activations per pattern; the backward runs the last pattern's
        graph first and then rebuilds the others one at a time, so it holds one, for one more forward
        per earlier pattern. On GPUs the kernels keep little and the extra forward costs time: no."""
        return (
            num_patterns > 1 and torch.is_grad_enabled() and self.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and getattr(self, "context_parallel_group", None) is None  # (hf_hybrid.distributed.context_parallel)
            and not self.model.gradient_checkpointing  # checkpointed layers keep nothing a rebuild would free
            and not kwargs.get("output_hidden_states") and not kwargs.get("output_attentions")
        )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        sparse_config: SparseInferenceConfig | dict | None = None,
        training_dilations: list | tuple | None = None,
        **kwargs,
    ) -> RatPlusCausalLMOutput:
        common = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, labels=labels, logits_to_keep=logits_to_keep, **kwargs,
        )
        has_targets = labels is not None or kwargs.get("shift_labels") is not None
        joint = has_targets and sparse_config is None and (self.training or training_dilations is not None)
        if not joint:
            out = super().forward(past_key_values=past_key_values, use_cache=use_cache, sparse_config=sparse_config, **common)
            return RatPlusCausalLMOutput(**out)
        if past_key_values is not None:
            raise ValueError("The joint training objective runs full forwards; do not pass past_key_values with it.")
        patterns, weights = self.config.training_patterns(training_dilations)
        def pattern_forward(pattern):
            return super(RatPlusForCausalLM, self).forward(use_cache=False, sparse_config=pattern, **common)

        rebuild = self._rebuilds_earlier_patterns(len(patterns), kwargs)
        outputs = [
            checkpoint(pattern_forward, p, use_reentrant=False) if rebuild and i < len(patterns) - 1 else pattern_forward(p)
            for i, p in enumerate(patterns)
        ]
        loss = sum(w * out.loss for w, out in zip(weights, outputs))
        return RatPlusCausalLMOutput(
            loss=loss,
            logits=outputs[0].logits,
            hidden_states=outputs[0].hidden_states,  # the first pattern's, like the logits
            attentions=outputs[0].attentions,
            pattern_losses=torch.stack([out.loss.detach() for out in outputs]),
        )


class RatPlusForSequenceClassification(HybridForSequenceClassification, RatPlusPreTrainedModel):
    base_model_class = RatPlusModel


class RatPlusForTokenClassification(HybridForTokenClassification, RatPlusPreTrainedModel):
    base_model_class = RatPlusModel


class RatPlusForQuestionAnswering(HybridForQuestionAnswering, RatPlusPreTrainedModel):
    base_model_class = RatPlusModel


__all__ = [
    "RatPlusCausalLMOutput",
    "RatPlusForCausalLM",
    "RatPlusModel",
    "RatPlusPreTrainedModel",
    "RatPlusForSequenceClassification",
    "RatPlusForTokenClassification",
    "RatPlusForQuestionAnswering",
]
