"""Model plumbing shared by every architecture: the decoder stack's forward, the causal-LM head,
weight init, and generate() integration (each model brings its own Cache class).

Each architecture subclasses these in its own modeling file and supplies only what differs:
``build_mixer`` (the token mixer of layer i), its config class and its cache class.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..layers.backbone import DecoderLayer
from ..layers.context import SequenceContext
from ..layers.norm import RMSNorm


class HybridPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    def save_pretrained(self, save_directory, *args, card_repo_id=None, card_training_data=None, **kwargs):
        """transformers' save_pretrained, plus self-contained remote code and a filled model card (hub.py)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            from ..hub import save_sharing_files

            save_sharing_files(self, save_directory, card_repo_id, card_training_data)
        return result

    def push_to_hub(self, repo_id: str, *, training_data: str | None = None, **kwargs):
        """Upload weights, config, remote code and the filled model card (not transformers' generic card)."""
        from ..hub import push_model_to_hub

        return push_model_to_hub(self, repo_id, training_data=training_data, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Mixers with parameters beyond Linear/Embedding/RMSNorm (gate biases, ...) re-draw them here,
        # unless they were just loaded from a checkpoint.
        reset = getattr(module, "reset_extra_parameters", None)
        if reset is not None and not all(getattr(p, "_is_hf_initialized", False) for p in module.parameters(recurse=False)):
            reset()


class HybridModel(HybridPreTrainedModel):
    """embed_tokens -> N x DecoderLayer(mixer_i) -> norm. Subclasses implement ``build_mixer``."""

    # Names of forward keywords that are handed on to every token mixer (e.g. "sparse_config").
    mixer_forward_kwargs: tuple[str, ...] = ()
    cache_class: type[Cache]

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            DecoderLayer(config.hidden_size, config.intermediate_size, self.build_mixer(config, i), config.rms_norm_eps)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def build_mixer(self, config, layer_idx: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} must define build_mixer(config, layer_idx)")

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _check_cache(self, cache: Cache) -> None:
        if not isinstance(cache, self.cache_class) and not (
            isinstance(cache, DynamicCache) and len(cache.layers) == self.config.num_hidden_layers
        ):
            raise TypeError(
                f"past_key_values must be a {self.cache_class.__name__} (build it with "
                f"{self.cache_class.__name__}(model.config)); got {type(cache).__name__} with {len(cache.layers)} layers."
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False  # recomputation would write the cache twice
        if use_cache and past_key_values is None:
            past_key_values = self.cache_class(self.config)
        if past_key_values is not None:
            self._check_cache(past_key_values)
        batch, seq = inputs_embeds.shape[:2]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        context = SequenceContext.build(batch, seq, past_length, attention_mask, position_ids, inputs_embeds.device)
        mixer_kwargs = {name: kwargs[name] for name in self.mixer_forward_kwargs if kwargs.get(name) is not None}

        hidden_states = inputs_embeds
        for layer_idx, layer in enumerate(self.layers):
            cache_layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
            hidden_states = layer(hidden_states, context, cache_layer, **mixer_kwargs)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states),
            past_key_values=past_key_values if use_cache else None,
        )


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    """Language-model head over a :class:`HybridModel`; subclasses set ``base_model_class``."""

    base_model_class: type[HybridModel]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

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
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        # logits_to_keep: an int keeps the last N positions (0 = all), a tensor selects indices.
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss_kwargs = {k: v for k, v in kwargs.items() if k in ("num_items_in_batch", "ignore_index")}
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() would build a DynamicCache from config.layer_types; build the model's own cache instead."""
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache_class = self.base_model_class.cache_class
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported by "
                f"{type(self).__name__}: it decodes with its own {cache_class.__name__}. Leave cache_implementation unset."
            )
        model_kwargs["past_key_values"] = cache_class(self.config)
