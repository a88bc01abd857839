"""Task heads for every architecture, on transformers' generic heads (``transformers.modeling_layers``).

Each architecture declares three one-line subclasses at the bottom of its modeling file, e.g.
``class RatForSequenceClassification(HybridForSequenceClassification, RatPreTrainedModel)`` with
``base_model_class = RatModel``. The heads compute what Llama's do:

* sequence classification: a bias-free ``score`` on the last non-pad token of each row (the
  rightmost token that is not ``config.pad_token_id``, so left and right padding both work; with
  no pad token only batch size 1 is accepted, as for Llama);
* token classification: dropout + ``score`` on every token;
* extractive question answering: ``qa_outputs`` giving start / end logits.

Two differences from the generic classes, both needed by our models:

* the backbone is built from ``base_model_class``, not ``AutoModel.from_config``: a checkpoint
  loaded with ``trust_remote_code=True`` has no Auto registration for its config class, and
  AutoModel would ask again whether to trust the remote code;
* ``use_cache`` defaults to False (True only when a cache is passed in): a head reads the hidden
  states once, and building a decoding cache would cost memory and, for RAT, keep the forward off
  its fused no-cache kernels.

The generic heads take the cache under the installed transformers' name (``cache`` from 5.24,
hf_hybrid/compat.py); ours take either, like every hf-hybrid forward.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)

from ..compat import cache_field


def _use_cache(use_cache: bool | None, past_key_values: Cache | None) -> bool:
    return past_key_values is not None if use_cache is None else use_cache


class HybridForSequenceClassification(GenericForSequenceClassification):
    base_model_class: type

    def __init__(self, config):
        super(GenericForSequenceClassification, self).__init__(config)  # the generic __init__ would call AutoModel
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        return super().forward(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, **cache_field(past_key_values),
            inputs_embeds=inputs_embeds, labels=labels, use_cache=_use_cache(use_cache, past_key_values), **kwargs,
        )


class HybridForTokenClassification(GenericForTokenClassification):
    base_model_class: type

    def __init__(self, config):
        super(GenericForTokenClassification, self).__init__(config)  # the generic __init__ would call AutoModel
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)  # the generic head's default
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        return super().forward(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, **cache_field(past_key_values),
            inputs_embeds=inputs_embeds, labels=labels, use_cache=_use_cache(use_cache, past_key_values), **kwargs,
        )


class HybridForQuestionAnswering(GenericForQuestionAnswering):
    base_model_class: type

    def __init__(self, config):
        super(GenericForQuestionAnswering, self).__init__(config)  # the generic __init__ would call AutoModel
        self.model = self.base_model_class(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        return super().forward(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, **cache_field(past_key_values),
            inputs_embeds=inputs_embeds, start_positions=start_positions, end_positions=end_positions,
            use_cache=_use_cache(use_cache, past_key_values), **kwargs,
        )


TASK_HEADS = (HybridForSequenceClassification, HybridForTokenClassification, HybridForQuestionAnswering)

__all__ = ["HybridForQuestionAnswering", "HybridForSequenceClassification", "HybridForTokenClassification", "TASK_HEADS"]
