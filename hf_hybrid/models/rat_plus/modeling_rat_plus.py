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

With gradients, a step holds one pattern's activations, not one per pattern: every other pattern
runs its backward right after its forward and its gradients reach the parameters through the
caller's backward (``joint_objective.py``), so loss scaling, gradient accumulation and DDP apply to
every pattern as to a plain sum. Where that cannot run (torch.compile, FSDP2, ZeRO-3, a
context-parallel group, reentrant checkpointing, float16), every pattern's activations are kept
until the backward, with a warning naming the reason (``_keeps_every_pattern_graph``): the patterns
then run as row groups of ONE forward over the batch stacked once per pattern
(``stacked_patterns.py``: each parameter is used once per step, which ZeRO-3's gradient
partitioning requires, and FSDP2 gathers each layer once), or, under a context-parallel group (whose
exchanges run one pattern per forward), one forward per pattern.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

from ...layers.rat_plus_attention import RatPlusAttention
from ...sparse import RowPatterns, SparseInferenceConfig
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel, check_input_shapes
from ..heads import HybridForQuestionAnswering, HybridForSequenceClassification, HybridForTokenClassification
from .cache_rat_plus import RatPlusCache
from .configuration_rat_plus import RatPlusConfig
from .joint_objective import joint_loss
from .stacked_patterns import stacked_joint_forward

logger = logging.get_logger(__name__)


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

    def _resolve_sparse_config(self, sparse_config):
        """The call's pattern (or the config's default); a RowPatterns (a pattern per row group, the
        joint objective's one forward) is checked and kept."""
        if isinstance(sparse_config, RowPatterns):
            sparse_config.validate_for_model(self.config.num_hidden_layers, self.config.num_attention_heads, self.config.max_position_embeddings)
            return sparse_config
        return self.config.resolve_sparse_config(sparse_config)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        sparse_config: SparseInferenceConfig | RowPatterns | dict | None = None,
        **kwargs,
    ):
        return super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            sparse_config=self._resolve_sparse_config(sparse_config),
            **kwargs,
        )


class RatPlusForCausalLM(RatPlusPreTrainedModel, HybridForCausalLM):
    base_model_class = RatPlusModel

    def _keeps_every_pattern_graph(self) -> str | None:
        """Why the joint objective must keep every pattern's activations until the caller's backward
        (one forward over the patterns' stacked rows, stacked_patterns.py, or one forward per
        pattern under a context-parallel group), or None: then each other pattern's backward runs
        right after its forward (joint_objective.py), one pass's memory."""
        if torch.compiler.is_compiling():
            return "torch.compile traces the forward as one graph, and a backward inside it breaks the graph"
        # FSDP2 (DTensor parameters) and ZeRO-3 gather parameters in forward hooks and reduce gradients
        # in backward hooks made for one backward per step; a backward inside the forward breaks both
        # (FSDP2 reshards the root's parameters before the next pass; DeepSpeed's hooks refuse
        # torch.autograd.grad). A context-parallel group's exchanges are verified with one backward.
        if any(hasattr(p, "ds_id") or any(c.__name__ == "DTensor" for c in type(p).__mro__) for p in self.parameters()):
            return "the parameters are sharded (FSDP2 or DeepSpeed ZeRO-3)"
        if getattr(self, "context_parallel_group", None) is not None:  # (hf_hybrid.distributed.context_parallel)
            return "the model runs under a context-parallel group"
        checkpointing = getattr(self.model, "_gradient_checkpointing_func", None)
        reentrant = getattr(checkpointing, "keywords", {}).get("use_reentrant", True) is not False
        if self.model.gradient_checkpointing and self.model.training and reentrant:
            return "reentrant gradient checkpointing does not support torch.autograd.grad"
        device = self.device.type
        fp16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
        if fp16 or any(p.dtype == torch.float16 for p in self.parameters() if p.requires_grad):
            # A GradScaler's scale reaches the backward only through the caller's loss; an earlier
            # pattern's float16 backward run at scale 1 would underflow.
            return "float16 training scales the loss for its backward"
        return None

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

        def pattern_forward(pattern, inputs):
            return super(RatPlusForCausalLM, self).forward(use_cache=False, sparse_config=pattern, **inputs)

        parameters = [p for p in self.parameters() if p.requires_grad]
        grad_inputs = any(isinstance(v, torch.Tensor) and v.requires_grad for v in common.values())
        grads = torch.is_grad_enabled() and bool(parameters or grad_inputs)
        several = grads and len(patterns) > 1  # else there is one graph, or none
        keep_graphs = self._keeps_every_pattern_graph() if several else None
        if several and keep_graphs is None:
            first, loss, pattern_losses = joint_loss(pattern_forward, patterns, weights, common, parameters)
        elif several and getattr(self, "context_parallel_group", None) is None:
            # Every pattern's activations are kept anyway: one forward over the patterns' rows stacked.
            if not torch.compiler.is_compiling():
                logger.warning_once(
                    f"RAT+'s joint objective runs its {len(patterns)} patterns as row groups of one forward (the "
                    f"memory of {len(patterns)} passes): {keep_graphs}."
                )
            check_input_shapes(input_ids, inputs_embeds, self.config.hidden_size)
            first, loss, pattern_losses = stacked_joint_forward(self, patterns, weights, common)
            first = RatPlusCausalLMOutput(**first)
        else:
            if several and not torch.compiler.is_compiling():  # (logging would break a traced graph)
                logger.warning_once(
                    f"RAT+'s joint objective keeps all {len(patterns)} patterns' graphs until the backward (the "
                    f"memory of {len(patterns)} passes): {keep_graphs}."
                )
            outputs = [pattern_forward(p, common) for p in patterns]
            first = outputs[0]
            loss = sum(w * out.loss for w, out in zip(weights, outputs))
            pattern_losses = torch.stack([out.loss.detach() for out in outputs])
        return RatPlusCausalLMOutput(
            loss=loss,
            logits=first.logits,
            hidden_states=first.hidden_states,  # the first pattern's, like the logits
            attentions=first.attentions,
            pattern_losses=pattern_losses,
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
