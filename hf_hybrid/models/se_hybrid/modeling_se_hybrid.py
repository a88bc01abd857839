"""SE-Attn hybrid (Expansion Span): a Mamba-2 hybrid causal LM whose attention layers run full
attention or Span-Expanded Attention, as transformers models.

Block (shared backbone, ``hf_hybrid.layers.backbone``): x + mixer(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)).
Mixer per ``config.layer_types``:
  * ``mamba``     -> :class:`SEMambaMixer`: transformers' Mamba-2 mixer from Bamba (its parameters
                     and math: in_proj -> causal depthwise conv1d -> selective SSM scan -> gated
                     RMSNorm -> out_proj), running on ``hf_hybrid.kernels`` ops (``causal_conv1d``,
                     ``ssd_scan``, ``mamba2_decode_step``: Triton on CUDA, a chunked memory-lean
                     reference on CPU). Bamba because it is already a Mamba-2 + attention hybrid:
                     Bamba checkpoints convert parameter for parameter.
  * ``attention`` -> :class:`~hf_hybrid.layers.span_expanded_attention.SpanExpandedAttention` with
                     ``config.attention_mode`` (or the forward keyword ``attention_mode``).
Cache: :class:`SEHybridCache` (Mamba conv/SSM states; attention K/V + block summaries).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.models.bamba.modeling_bamba import BambaMixer

from ...kernels.causal_conv1d import causal_conv1d
from ...kernels.gated_rms_norm import gated_rms_norm
from ...kernels.mamba2_mixer import mamba2_mixer
from ...kernels.ssd_scan import mamba2_decode_step, ssd_scan
from ...layers.fused_norms import has_forward_hooks
from ...layers.recompute import RecomputedActivations, recompute_applies
from ...layers.span_expanded_attention import SESettings, SpanExpandedAttention
from ..common import HybridForCausalLM, HybridModel, HybridPreTrainedModel
from ..heads import HybridForQuestionAnswering, HybridForSequenceClassification, HybridForTokenClassification
from .cache_se_hybrid import SEHybridCache, SEMambaLayerCache
from .configuration_se_hybrid import SE_ATTENTION_MODES, SEHybridConfig, canonical_layer_type


try:  # fires accelerate's offload hooks of conv1d, whose weight the ops read directly (as Bamba does)
    from transformers.integrations.accelerate import force_accelerate_hooks

    _force_conv1d_hooks = force_accelerate_hooks("conv1d")
except ImportError:  # transformers without it: nothing to fire
    def _force_conv1d_hooks(forward):
        return forward


class SEMambaMixer(BambaMixer):
    """transformers' Bamba Mamba-2 mixer (its parameters and names, so Bamba checkpoints load as they
    are) running on this package's ops: ``causal_conv1d`` and ``ssd_scan`` (Triton on CUDA; on CPU a
    chunked reference that holds one chunk's tile at a time, instead of Bamba's ``torch_forward``
    that builds every chunk's tiles at once), and the fused decode step for single tokens.

    Order of operations (Bamba's): in_proj -> [gate z | xBC | dt]; xBC -> causal depthwise conv1d
    + SiLU -> [x | B | C]; y = SSD(x, dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log), B, C) + D x;
    out_proj(gated RMSNorm(y * silu(z)) per group). Padding tokens (``context.query_valid``) are
    zeroed before in_proj (and after it when in_proj has a bias) and after the conv, so they never
    enter the conv window or the SSM state.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.kernel_backend = getattr(config, "kernel_backend", "auto")
        # Bamba's mixer reads hidden_act, which here is the MLP's: the conv activation has its own field.
        self.activation = getattr(config, "mamba_hidden_act", "silu")
        self.act = ACT2FN[self.activation]

    def forward(self, hidden_states, context, cache_layer=None, **unused):
        if cache_layer is not None and not isinstance(cache_layer, SEMambaLayerCache):
            raise TypeError("Mamba layers need an SEHybridCache; build it with SEHybridCache(model.config).")
        valid = context.query_valid
        rows = self.rows_per_slice(hidden_states) if cache_layer is None and not torch.is_grad_enabled() else None
        if rows is None or rows >= hidden_states.shape[0]:
            return self._mix(hidden_states, valid, cache_layer)
        # Rows are independent: a cache-less inference call runs them in slices, so the temporaries
        # (in_proj's output, the conv's, the chunk states) are one slice's, not the whole batch's.
        out = hidden_states.new_empty(*hidden_states.shape[:-1], self.out_proj.out_features)
        for start in range(0, hidden_states.shape[0], rows):
            part = slice(start, start + rows)
            out[part] = self._mix(hidden_states[part], None if valid is None else valid[part], None)
        return out

    def rows_per_slice(self, hidden_states: torch.Tensor) -> int:
        """How many rows of ``hidden_states`` one call of the mixer takes so that its temporaries stay
        under ROW_SLICE_BYTES (at least one row)."""
        batch, seq, _ = hidden_states.shape
        width = self.in_proj.out_features + self.conv_dim + 2 * self.intermediate_size  # in_proj, conv, y, norm
        chunk_states = 2 * 4 * self.num_heads * self.head_dim * self.ssm_state_size / self.chunk_size  # float32, per token
        per_row = seq * (width * hidden_states.element_size() + chunk_states)
        return max(1, int(ROW_SLICE_BYTES // per_row))

    @_force_conv1d_hooks
    def _mix(self, hidden_states, valid, cache_layer):
        batch, seq, _ = hidden_states.shape
        dtype = hidden_states.dtype
        keep = None if valid is None else valid[..., None].to(dtype)
        if keep is not None:
            hidden_states = hidden_states * keep
        zxbcdt = self.in_proj(hidden_states)
        A = -torch.exp(self.A_log.float())
        conv_weight, conv_bias = self.conv1d.weight[:, 0], self.conv1d.bias
        backend = _mamba_backend(self)
        if self._runs_whole(hidden_states, cache_layer, valid, backend):
            return self._mix_whole(zxbcdt, valid, A, conv_weight, conv_bias, backend, dtype)
        gate, xBC, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        if keep is not None and self.use_bias:
            xBC = xBC * keep  # in_proj's bias would otherwise put padding into the conv window
        states = self._cached_states(cache_layer)
        if states is not None and seq == 1 and not cache_layer.record_past:
            y = mamba2_decode_step(
                xBC[:, 0], dt[:, 0], states[0], states[1], conv_weight, conv_bias, A, D=self.D, dt_bias=self.dt_bias,
                head_dim=self.head_dim, dt_limit=self.time_step_limit, activation=self.activation, backend=backend,
            )
        else:
            triton_path = hidden_states.is_cuda or backend == "triton"
            # Rebuilding needs no carried conv state (the conv then reads only this segment's xBC).
            recompute = RecomputedActivations() if triton_path and states is None and recompute_applies() else None
            with recompute.active() if recompute is not None else contextlib.nullcontext():
                y = self._scan(xBC, dt, A, keep, states, cache_layer, backend, recompute, conv_weight, conv_bias)
                return self._norm_and_project(y, gate, backend, dtype, recompute)
        return self._norm_and_project(y, gate, backend, dtype)

    def _runs_whole(self, hidden_states, cache_layer, valid, backend) -> bool:
        """Whether the mixer between its projections runs as one op (kernels/mamba2_mixer: one
        gradient buffer for in_proj's output): the Triton path without a cache, with the norm's
        module not hooked, and padding masked after the conv only (no in_proj bias)."""
        triton_path = (hidden_states.is_cuda and backend != "reference") or backend == "triton"
        return (
            triton_path and cache_layer is None and not has_forward_hooks(self.norm)
            and (valid is None or not self.use_bias)
        )

    def _mix_whole(self, zxbcdt, valid, A, conv_weight, conv_bias, backend, dtype):
        """out_proj(mamba2_mixer(zxbcdt)); in training the norm's output is rebuilt in the backward
        from the scan's output and the gate instead of kept (layers/recompute.py)."""
        norm = self.norm
        group_size = getattr(norm, "group_size", self.intermediate_size)  # see _gated_norm
        recompute = RecomputedActivations() if recompute_applies() else None
        with recompute.active() if recompute is not None else contextlib.nullcontext():
            normed, y = mamba2_mixer(
                zxbcdt, conv_weight, conv_bias, A, self.D, self.dt_bias, norm.weight, head_dim=self.head_dim,
                state_size=self.ssm_state_size, norm_group_size=group_size, eps=norm.variance_epsilon,
                dt_limit=self.time_step_limit, activation=self.activation, keep=valid, backend=backend,
            )
            if recompute is not None:
                gate = zxbcdt[..., : self.intermediate_size]
                recompute.register(
                    normed, lambda: gated_rms_norm(y, gate, norm.weight, group_size, norm.variance_epsilon, backend=backend),
                    y, gate, norm.weight,
                )
            return self.out_proj(normed.to(dtype))

    def _conv(self, xBC, keep, conv_state, backend, weight, bias):
        """Causal depthwise conv1d + activation, padding zeroed."""
        out = causal_conv1d(xBC, weight, bias, conv_state, self.activation, backend=backend)
        return out if keep is None else out * keep

    def _scan(self, xBC, dt, A, keep, states, cache_layer, backend, recompute, weight, bias):
        """conv1d -> SSD over a segment. With ``recompute`` (training on the Triton path), the conv
        output is rebuilt in the backward instead of kept (layers/recompute.py; with the gated norm's
        output in _norm_and_project, 17 KB per token less at the 1.3B shape)."""
        batch, seq, _ = xBC.shape
        conv_state = None if states is None else states[0][..., -self.conv_kernel_size:]
        xBC_conv = self._conv(xBC, keep, conv_state, backend, weight, bias)
        if recompute is not None:
            conv_inputs = (xBC, weight) if bias is None else (xBC, weight, bias)
            recompute.register(xBC_conv, lambda: self._conv(xBC, keep, None, backend, weight, bias), *conv_inputs)
        if cache_layer is not None:  # after the conv, which read the previous state
            cache_layer.update_conv_state(xBC.transpose(1, 2), conv_kernel_size=self.conv_kernel_size)
        group_width = self.n_groups * self.ssm_state_size
        x, B, C = xBC_conv.split([self.intermediate_size, group_width, group_width], dim=-1)
        x = x.reshape(batch, seq, self.num_heads, self.head_dim)
        B = B.reshape(batch, seq, self.n_groups, self.ssm_state_size)
        y = ssd_scan(
            x, dt, A, B,
            C.reshape(batch, seq, self.n_groups, self.ssm_state_size),
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.time_step_limit,
            initial_state=None if states is None else states[1], return_final_state=cache_layer is not None,
            chunk_size=self.chunk_size, backend=backend,
        )
        if cache_layer is not None:
            y, final_state = y
            cache_layer.update_recurrent_state(final_state)
            cache_layer.record_scan_inputs(  # kept only while a crop may need them (assisted decoding)
                x, dt, B, A=A, dt_bias=self.dt_bias, dt_limit=self.time_step_limit,
            )
        return y

    def _norm_and_project(self, y, gate, backend, dtype, recompute=None):
        """out_proj(gated norm(y, gate)); with ``recompute``, the norm's output is rebuilt in the
        backward instead of kept."""
        y = y.reshape(*gate.shape[:-1], self.intermediate_size)
        normed = self._gated_norm(y, gate, backend)
        if recompute is not None:
            recompute.register(normed, lambda: self._gated_norm(y, gate, backend), y, gate, self.norm.weight)
        return self.out_proj(normed.to(dtype))

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor, backend: str) -> torch.Tensor:
        """BambaRMSNormGated(y, gate): one fused kernel each way on the Triton path (it keeps only y,
        gate and the weight for the backward); else the module, recomputed in the backward so its
        float32 temporaries (~5 per token) are not kept."""
        norm = self.norm
        if (y.is_cuda or backend == "triton") and not has_forward_hooks(norm):
            # transformers releases without BambaRMSNormGated.group_size normalise the whole width.
            group_size = getattr(norm, "group_size", y.shape[-1])
            return gated_rms_norm(y, gate, norm.weight, group_size, norm.variance_epsilon, backend=backend)
        if torch.is_grad_enabled() and (y.requires_grad or gate.requires_grad):
            return checkpoint(norm, y, gate, use_reentrant=False)
        return norm(y, gate)

    @staticmethod
    def _cached_states(cache_layer):
        """(conv state, SSM state) carried from earlier tokens, or None before the first segment."""
        if cache_layer is None or not cache_layer.has_previous_state[0]:
            return None
        return cache_layer.conv_states[0], cache_layer.recurrent_states[0]

    def reset_extra_parameters(self) -> None:
        """Mamba-2's S4D-real A (A_log = log 1..H), D = 1 and dt_bias = 1, as Bamba initialises them."""
        self.init_bamba_weights()


# The largest temporaries one Mamba call makes in a cache-less inference forward: 4 GiB is a
# 32K-token row at the 1.3B shape, so only batches far past the usual run in row slices.
ROW_SLICE_BYTES = 4 * 2**30


def _mamba_backend(mixer: SEMambaMixer) -> str:
    """config.kernel_backend when it names a backend the Mamba ops have, else "auto" (Triton on CUDA)."""
    backend = getattr(mixer, "kernel_backend", "auto")
    return backend if backend in ("reference", "triton") else "auto"


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
            config=config,  # `full` mode reads config._attn_implementation at every call
            layer_idx=layer_idx,
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


class SEHybridForSequenceClassification(HybridForSequenceClassification, SEHybridPreTrainedModel):
    base_model_class = SEHybridModel


class SEHybridForTokenClassification(HybridForTokenClassification, SEHybridPreTrainedModel):
    base_model_class = SEHybridModel


class SEHybridForQuestionAnswering(HybridForQuestionAnswering, SEHybridPreTrainedModel):
    base_model_class = SEHybridModel


__all__ = [
    "SEHybridForCausalLM",
    "SEHybridModel",
    "SEHybridPreTrainedModel",
    "SEMambaMixer",
    "SEHybridForSequenceClassification",
    "SEHybridForTokenClassification",
    "SEHybridForQuestionAnswering",
]
