"""SE-Attn hybrid (Expansion Span): a Mamba-2 hybrid causal LM whose attention layers run full
attention or Span-Expanded Attention, as transformers models.

Block (shared backbone, ``hf_hybrid.layers.backbone``): x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Mixer per ``config.layer_types``:
  * ``mamba``     -> :class:`SEMambaMixer`: transformers' own Mamba-2 mixer from Bamba
                     (``transformers.models.bamba.modeling_bamba.BambaMixer``: in_proj -> causal
                     depthwise conv1d -> selective SSM scan (chunked, pure PyTorch on CPU; the hub
                     kernels when installed) -> gated RMSNorm -> out_proj). Chosen over Mamba2Mixer
                     because Bamba is already a Mamba-2 + attention hybrid: its mixer reads its state
                     from a hybrid Cache, and Bamba checkpoints convert parameter for parameter.
  * ``attention`` -> :class:`~hf_hybrid.layers.span_expanded_attention.SpanExpandedAttention` with
                     ``config.attention_mode`` (or the forward keyword ``attention_mode``).
Cache: :class:`SEHybridCache` (Mamba conv/SSM states; attention K/V + block summaries).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.bamba.modeling_bamba import BambaMixer

from ...layers.span_expanded_attention import SESettings, SpanExpandedAttention
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel
from .cache_se_hybrid import SEHybridCache, SEMambaLayerCache
from .configuration_se_hybrid import SE_ATTENTION_MODES, SEHybridConfig, canonical_layer_type


class SEMambaMixer(BambaMixer):
    """transformers' Bamba Mamba-2 mixer behind the backbone's mixer signature (parameters unchanged)."""

    def forward(self, hidden_states, context, cache_layer=None, **unused):
        cache = None
        if cache_layer is not None:
            if not isinstance(cache_layer, SEMambaLayerCache) or cache_layer.parent is None:
                raise TypeError("Mamba layers need an SEHybridCache; build it with SEHybridCache(model.config).")
            cache = cache_layer.parent
        # Padding tokens are zeroed before and after the convolution, so they never enter the SSM state.
        return super().forward(hidden_states, cache_params=cache, attention_mask=context.query_valid)

    def reset_extra_parameters(self) -> None:
        """Mamba-2's S4D-real A (A_log = log 1..H), D = 1 and dt_bias = 1, as Bamba initialises them."""
        self.init_bamba_weights()


def se_settings(config: SEHybridConfig) -> SESettings:
    return SESettings(
        mode=config.attention_mode,
        chunk_sizes=tuple(config.se_chunk_sizes),
        eval_chunk_size=config.se_eval_chunk_size,
        block_size=config.se_block_size,
        top_k=config.se_top_k,
        select_every=config.se_select_every,
        window=config.sliding_window,
        seed=config.se_random_seed,
        backend=config.kernel_backend,
    )


class SEHybridPreTrainedModel(HybridPreTrainedModel):
    config_class = SEHybridConfig
    config: SEHybridConfig


class SEHybridModel(SEHybridPreTrainedModel, HybridModel):
    cache_class = SEHybridCache
    mixer_forward_kwargs = ("attention_mode", "se_chunk_size")

    def build_mixer(self, config: SEHybridConfig, layer_idx: int) -> nn.Module:
        if canonical_layer_type(config.layer_types[layer_idx]) == "mamba":
            return SEMambaMixer(config, layer_idx)
        return SpanExpandedAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.rope_theta,
            se_settings(config),
            partial_rotary_factor=config.partial_rotary_factor,
            attention_bias=config.attention_bias,
        )

    def _check_cache(self, cache) -> None:
        if not isinstance(cache, SEHybridCache):
            raise TypeError(
                f"past_key_values must be an SEHybridCache (build it with SEHybridCache(model.config)); got {type(cache).__name__}."
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        attention_mode: str | None = None,
        se_chunk_size: int | None = None,
        **kwargs,
    ):
        """``attention_mode`` (one of full, se, swa, se_nomem, se_random) overrides ``config.attention_mode``
        (read at every call) for this call; ``se_chunk_size`` fixes M for this call (else drawn in training, eval size otherwise)."""
        # Read the config at call time, so that setting model.config.attention_mode takes effect.
        attention_mode = self.config.attention_mode if attention_mode is None else attention_mode
        if attention_mode not in SE_ATTENTION_MODES:
            raise ValueError(f"attention_mode={attention_mode!r} is not one of {list(SE_ATTENTION_MODES)}.")
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            attention_mode=attention_mode, se_chunk_size=se_chunk_size, **kwargs,
        )


class SEHybridForCausalLM(SEHybridPreTrainedModel, HybridForCausalLM):
    base_model_class = SEHybridModel

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
        attention_mode: str | None = None,
        se_chunk_size: int | None = None,
        **kwargs,
    ):
        """As :class:`SEHybridModel`, plus the LM head and loss; explicit keywords so generate() forwards them."""
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
            logits_to_keep=logits_to_keep, attention_mode=attention_mode, se_chunk_size=se_chunk_size, **kwargs,
        )


__all__ = ["SEHybridForCausalLM", "SEHybridModel", "SEHybridPreTrainedModel", "SEMambaMixer"]
