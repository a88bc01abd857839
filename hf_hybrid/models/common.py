"""Model plumbing shared by every architecture: the decoder stack's forward, the causal-LM head,
weight init, and generate() integration (each model brings its own Cache class).

Each architecture subclasses these in its own modeling file and supplies only what differs:
``build_mixer`` (the token mixer of layer i), its config class and its cache class.

Outputs, for every model class (re-declared forwards and task heads included): ``hidden_states``
and ``attentions`` are collected by :meth:`HybridModel.forward` (``output_hidden_states`` /
``output_attentions``, defaulting to the config's), and ``return_dict`` is resolved in one place,
a wrapper every subclass's forward gets (``HybridPreTrainedModel.__init_subclass__``): the forward
bodies always build ModelOutputs, the wrapper returns ``to_tuple()`` when return_dict is False.
Inputs no model can run (wrong rank, no tokens) fail early with ``check_input_shapes``, in
forward() and in generate().
"""
from __future__ import annotations

import functools
import inspect
from contextvars import ContextVar

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import ModelOutput, logging

from ..compat import CACHE_KWARGS, CACHE_NAME, cache_field, cache_of, rename_cache_kwarg
from ..generation.graph_decode import DecodeGraphMixin
from ..generation.sliced_prefill import SlicedPrefillMixin
from ..layers.backbone import DecoderLayer, add_norm, deferred_adds_apply
from ..layers.context import SequenceContext
from ..layers.loss import lm_head_and_loss
from ..layers.norm import RMSNorm
from .cache_layer import DEFAULT_CROP_WINDOW
from .packed_sequences import find_packed_documents

logger = logging.get_logger(__name__)

# True while a model forward runs: a model called from inside another one's forward (the backbone
# of a head) returns a ModelOutput whatever its config's return_dict, so its caller can read fields.
_INSIDE_FORWARD: ContextVar[bool] = ContextVar("hf_hybrid_inside_forward", default=False)


def _return_dict_from_config(forward):
    """Wrap a model's forward: ``return_dict`` (keyword, else ``config.return_dict``) picks a
    ModelOutput or ``ModelOutput.to_tuple()``; the forward itself always builds a ModelOutput and
    gets ``return_dict=True`` when it takes keywords (transformers' generic heads read it). A
    ``cache=`` keyword (transformers >= 5.24's name) reaches the forward as ``past_key_values``."""
    parameters = inspect.signature(forward).parameters.values()
    takes_return_dict = any(p.kind is p.VAR_KEYWORD or p.name == "return_dict" for p in parameters)

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        rename_cache_kwarg(kwargs, "past_key_values")
        return_dict = kwargs.pop("return_dict", None)
        compiling = torch.compiler.is_compiling()  # dynamo does not trace ContextVars
        nested = not compiling and _INSIDE_FORWARD.get()
        if return_dict is None:
            return_dict = True if nested else getattr(self.config, "return_dict", True)
        if takes_return_dict:
            kwargs["return_dict"] = True
        token = None if compiling else _INSIDE_FORWARD.set(True)
        try:
            outputs = forward(self, *args, **kwargs)
        finally:
            if token is not None:
                _INSIDE_FORWARD.reset(token)
        return outputs.to_tuple() if not return_dict and isinstance(outputs, ModelOutput) else outputs

    wrapper._resolves_return_dict = True
    return wrapper


def check_input_shapes(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, hidden_size: int, caller: str = "forward()") -> None:
    """Raise a ValueError naming the argument and the fix for inputs no model can run: input_ids
    that are not [batch, seq], inputs_embeds that are not [batch, seq, hidden_size], no tokens."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"{caller}: pass exactly one of input_ids or inputs_embeds.")
    if input_ids is not None:
        name, tensor = "input_ids", input_ids
        if input_ids.dim() != 2:
            fix = " For one sequence, add the batch dimension: input_ids[None]." if input_ids.dim() == 1 else ""
            raise ValueError(
                f"{caller}: input_ids must be a 2-D [batch, seq] tensor of token ids; got shape {tuple(input_ids.shape)}.{fix}"
            )
    else:
        name, tensor = "inputs_embeds", inputs_embeds
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
            fix = " For one sequence, add the batch dimension: inputs_embeds[None]." if inputs_embeds.dim() == 2 else ""
            raise ValueError(
                f"{caller}: inputs_embeds must be a 3-D [batch, seq, hidden_size={hidden_size}] tensor; "
                f"got shape {tuple(inputs_embeds.shape)}.{fix}"
            )
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise ValueError(
            f"{caller}: {name} has shape {tuple(tensor.shape)}: every row needs at least one token "
            "(start a prompt with the BOS token, e.g. torch.full((batch, 1), config.bos_token_id))."
        )


# What save_pretrained writes besides weights and config (self-contained code, a filled model card)
# and how push_to_hub uploads: hf_hybrid/hub.py, a layer above the models, plugs both in on
# `import hf_hybrid` (register_sharing). In a checkpoint's bundled code, where transformers copies
# the code itself, neither is plugged in and both stay transformers' own.
_SHARING: dict = {}


def register_sharing(save_files, push) -> None:
    """``save_files(model, directory, repo_id, training_data)`` runs after every save_pretrained;
    ``push(model, repo_id, training_data=..., **kwargs)`` replaces push_to_hub."""
    _SHARING.update(save_files=save_files, push=push)


class HybridPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = list(CACHE_KWARGS)
    # Softmax layers go through transformers' attention interface (hf_hybrid/layers/attention.py) and
    # read config._attn_implementation per call; mixers without a softmax form accept every value.
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # One place for return_dict: every model class's forward (its own or inherited, e.g. a
        # task head's) returns a ModelOutput, or its tuple when return_dict resolves to False.
        forward = cls.forward
        if forward is not nn.Module.forward and not getattr(forward, "_resolves_return_dict", False):
            cls.forward = _return_dict_from_config(forward)

    def save_pretrained(self, save_directory, *args, card_repo_id=None, card_training_data=None, **kwargs):
        """transformers' save_pretrained, plus self-contained remote code and a filled model card (hub.py)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and "save_files" in _SHARING:
            _SHARING["save_files"](self, save_directory, card_repo_id, card_training_data)
        return result

    def push_to_hub(self, repo_id: str, *, training_data: str | None = None, **kwargs):
        """Upload weights, config, remote code and the filled model card (not transformers' generic card)."""
        if "push" not in _SHARING:  # a checkpoint's bundled code: transformers uploads it with the weights
            return super().push_to_hub(repo_id, **kwargs)
        return _SHARING["push"](self, repo_id, training_data=training_data, **kwargs)

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
            DecoderLayer(config.hidden_size, config.intermediate_size, self.build_mixer(config, i), config.rms_norm_eps,
                         config.mlp_type, config.hidden_act, config.mlp_bias)
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
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``output_hidden_states``: the embeddings and every layer's output (the last one after the
        final norm), as transformers' Llama returns them. ``output_attentions``: each layer's
        attention probabilities [batch, heads, seq, keys] where it has them (softmax layers run with
        attn_implementation="eager"), None for the others. Both default to the config's values."""
        check_input_shapes(input_ids, inputs_embeds, self.config.hidden_size)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        if output_attentions and self.config._attn_implementation != "eager":
            logger.warning_once(
                f"output_attentions=True: only softmax layers run with attn_implementation='eager' return attention "
                f"probabilities (this model uses {self.config._attn_implementation!r}, so every entry is None). "
                "Call model.set_attn_implementation('eager') first to get them."
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        explicit_use_cache = use_cache
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False  # recomputation would write the cache twice
        elif explicit_use_cache is None and self.training and torch.is_grad_enabled():
            # A training step (Trainer's, TRL's) continues no sequence: the cache would only cost
            # time and memory (the Mamba-2 and RAT layers would record states). use_cache=True keeps it.
            use_cache = False
        batch, seq = inputs_embeds.shape[:2]
        mixer_kwargs = {name: kwargs[name] for name in self.mixer_forward_kwargs if kwargs.get(name) is not None}
        packed = find_packed_documents(batch, seq, position_ids, attention_mask, kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx"))
        if packed is not None:
            return self._forward_packed(
                packed, inputs_embeds, mixer_kwargs, explicit_use_cache or past_key_values is not None,
                bool(output_attentions), bool(output_hidden_states),
            )
        if use_cache and past_key_values is None:
            past_key_values = self.cache_class(self.config)
        if past_key_values is not None:
            self._check_cache(past_key_values)
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        context = SequenceContext.build(
            batch, seq, past_length, attention_mask, position_ids, inputs_embeds.device,
            output_attentions=bool(output_attentions),
        )

        hidden_states = inputs_embeds
        if not (output_hidden_states or output_attentions) and deferred_adds_apply(hidden_states, self.layers, self.norm):
            # generate()'s static decode step: every residual add fused into the norm after it.
            residual, delta = hidden_states, None
            for layer_idx, layer in enumerate(self.layers):
                cache_layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
                residual, delta = layer.forward_deferred_add(residual, delta, context, cache_layer, **mixer_kwargs)
            return BaseModelOutputWithPast(
                last_hidden_state=add_norm(residual, delta, self.norm)[1],
                **cache_field(past_key_values if use_cache else None),
            )
        hidden_states, all_hidden_states, all_attentions = self._run_layers(
            hidden_states, context, past_key_values, mixer_kwargs, output_hidden_states, output_attentions
        )
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            **cache_field(past_key_values if use_cache else None),
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )

    def _run_layers(self, hidden_states, context, past_key_values, mixer_kwargs, output_hidden_states, output_attentions):
        """The decoder stack and the final norm: (last hidden state, every layer's hidden states or
        None, every layer's attention probabilities or None)."""
        all_hidden_states = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        for layer_idx, layer in enumerate(self.layers):
            if all_hidden_states is not None:
                all_hidden_states.append(hidden_states)
            cache_layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
            hidden_states = layer(hidden_states, context, cache_layer, **mixer_kwargs)
            if all_attentions is not None:
                all_attentions.append(context.take_attention_weights())
        hidden_states = self.norm(hidden_states)
        if all_hidden_states is not None:
            all_hidden_states.append(hidden_states)
        return (
            hidden_states,
            None if all_hidden_states is None else tuple(all_hidden_states),
            None if all_attentions is None else tuple(all_attentions),
        )

    def _forward_packed(self, packed, inputs_embeds, mixer_kwargs, use_cache, output_attentions, output_hidden_states):
        """Packed rows (hf_hybrid/models/packed_sequences.py): the stack runs on each group of whole
        documents as an unpadded batch, and the outputs return to the packed layout."""
        if use_cache:
            raise ValueError(
                "use_cache=True or past_key_values with packed rows (position_ids / cu_seq_lens_q / seq_idx mark several "
                "documents in one row): a cache continues one sequence per row. Pass use_cache=False and no "
                "past_key_values, or give each document its own row."
            )
        if output_attentions:
            raise ValueError(
                "output_attentions=True with packed rows: attention probabilities are per document. Run the "
                "documents as rows of a padded batch to get them."
            )
        last, per_layer = [], []
        for group in packed.groups:
            context = SequenceContext.build(
                group.num_docs, group.length, 0, None, group.positions, inputs_embeds.device,
            )
            # A keyword with a value per row (RAT+'s RowPatterns) takes its documents' rows' values.
            group_kwargs = {k: v.select_rows(group.rows) if hasattr(v, "select_rows") else v for k, v in mixer_kwargs.items()}
            hidden, all_hidden, _ = self._run_layers(
                packed.unpack(inputs_embeds, group), context, None, group_kwargs, output_hidden_states, False
            )
            last.append(hidden)
            per_layer.append(all_hidden)
        all_hidden_states = None
        if output_hidden_states:
            all_hidden_states = tuple(packed.repack([group[i] for group in per_layer]) for i in range(len(per_layer[0])))
        return BaseModelOutputWithPast(last_hidden_state=packed.repack(last), hidden_states=all_hidden_states)


class HybridForCausalLM(SlicedPrefillMixin, DecodeGraphMixin, HybridPreTrainedModel, GenerationMixin):
    """Language-model head over a :class:`HybridModel`; subclasses set ``base_model_class``.

    On CUDA, generate() decodes through a CUDA graph of the whole step where the cache supports
    it (DecodeGraphMixin, hf_hybrid/generation/graph_decode.py; opt out: decode_cuda_graph=False),
    and prefills in slices of the prompt when the whole batch's activations would not fit beside the
    decode cache (SlicedPrefillMixin, hf_hybrid/generation/sliced_prefill.py; opt out:
    prefill_slicing=False; a prefill_chunk_size of the user's wins)."""

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
        check_input_shapes(input_ids, inputs_embeds, self.config.hidden_size)
        static = self._static_decode_step(input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, labels, kwargs)
        if static is not None:  # generate()'s decode step on static buffers / a CUDA graph
            return static
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        # LM head + ForCausalLMLoss; in training on CUDA with Liger the two run fused and logits is
        # None unless skip_logits=False is passed (hf_hybrid/layers/loss.py).
        logits, loss = lm_head_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **cache_field(cache_of(outputs)),
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    def _prepare_model_inputs(self, *args, **kwargs):
        """generate()'s prompt, checked before transformers indexes into it (an empty prompt would
        otherwise fail with an IndexError deep inside generate())."""
        inputs_tensor, input_name, model_kwargs = super()._prepare_model_inputs(*args, **kwargs)
        if input_name == "inputs_embeds":
            check_input_shapes(None, inputs_tensor, self.config.hidden_size, caller="generate()")
        elif input_name == "input_ids":
            check_input_shapes(inputs_tensor, None, self.config.hidden_size, caller="generate()")
        return inputs_tensor, input_name, model_kwargs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() would build a DynamicCache from config.layer_types; build the model's own cache instead."""
        self._note_generation_config(generation_config)  # the static decode step's capacity and eligibility
        self._plan_prefill_slices(generation_config, model_kwargs, args, kwargs)
        if model_kwargs.get(CACHE_NAME) is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache_class = self.base_model_class.cache_class
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} is not supported by "
                f"{type(self).__name__}: it decodes with its own {cache_class.__name__}. Leave cache_implementation unset."
            )
        model_kwargs[CACHE_NAME] = cache_class(self.config)
        self._prepare_cache_for_crops(generation_config, model_kwargs[CACHE_NAME])
        self._reserve_static_buffers(model_kwargs[CACHE_NAME])

    @staticmethod
    def _prepare_cache_for_crops(generation_config, cache) -> None:
        """Assisted decoding crops rejected draft tokens off the cache: let a crop reach back over
        the whole generation (at least the default window), and record the past of an assistant's
        cache, as transformers does for the caches it builds (the target's is switched on by
        generate() itself). Recording keeps only what a crop since the previous one needs."""
        if hasattr(cache, "set_crop_window"):
            new_tokens = generation_config.max_new_tokens or 0
            cache.set_crop_window(max(new_tokens, DEFAULT_CROP_WINDOW))
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()
