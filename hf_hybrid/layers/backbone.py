"""The pre-norm decoder block every architecture shares:

    h = x + mixer(RMSNorm(x));  out = h + MLP(RMSNorm(h))

Only the token mixer differs between architectures (the MLP is SwiGLU or the plain two-layer block,
``mlp.build_mlp``); parameter names follow Llama
(input_layernorm, self_attn, post_attention_layernorm, mlp) so dense checkpoints map directly.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..kernels._backend import resolve_backend
from .._compat.glibc_malloc import keep_large_blocks_out_of_the_heap
from ..kernels.residual_norm import add_rms_norm, add_rms_norm_supported
from .backbone_fusion import fused_decode_active
from .context import SequenceContext
from .mlp import build_mlp
from .norm import RMSNorm

# The residual add + RMSNorm kernel of generate()'s static decode step (kernels/residual_norm):
# "auto" runs it on CUDA only; tests set "triton" (Triton's CPU interpreter); "reference" turns it off.
ADD_NORM_BACKEND = "auto"

# From this many tokens per forward, a CPU training step fixes glibc's mmap threshold
# (hf_hybrid/_compat/glibc_malloc.py): its activations are large enough
# that freed ones would otherwise stay resident.
LONG_CPU_STEP_TOKENS = 4096


def _plain(module: nn.Module) -> bool:
    return not (module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))


def deferred_adds_apply(hidden_states: torch.Tensor, layers, final_norm: nn.Module) -> bool:
    """Whether a stack runs :meth:`DecoderLayer.forward_deferred_add`: inside generate()'s static
    decode step with fused decode kernels on (backbone_fusion.fused_decode_active), on the add-norm
    kernel's backend, for plain DecoderLayers and RMSNorms (no hooks: a hook sees what it always saw)."""
    if not fused_decode_active() or torch.is_grad_enabled() or not add_rms_norm_supported(hidden_states):
        return False  # (rows the kernel does not take keep the plain blocks, not a slower add-norm)
    if ADD_NORM_BACKEND == "reference" or resolve_backend(ADD_NORM_BACKEND, hidden_states.device, "add_rms_norm") != "triton":
        return False
    norms = [final_norm] + [n for layer in layers for n in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))]
    return (all(isinstance(layer, DecoderLayer) and _plain(layer) for layer in layers)
            and all(isinstance(n, RMSNorm) and n.weight.dim() == 1 and _plain(n) for n in norms))


def add_norm(x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)) in one kernel (delta None: (x, norm(x)))."""
    return add_rms_norm(x, delta, norm.weight, norm.eps, backend=ADD_NORM_BACKEND)


class DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, hidden_size: int, intermediate_size: int, mixer: nn.Module, rms_norm_eps: float,
                 mlp_type: str = "gated", hidden_act: str = "silu", mlp_bias: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)
        self.mlp = build_mlp(hidden_size, intermediate_size, mlp_type, hidden_act, mlp_bias)

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None, **mixer_kwargs) -> torch.Tensor:
        if (hidden_states.device.type == "cpu" and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and hidden_states.shape[0] * hidden_states.shape[1] >= LONG_CPU_STEP_TOKENS):
            keep_large_blocks_out_of_the_heap()
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), context, cache_layer, **mixer_kwargs)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def training_graph_arguments(self, hidden_states, context, cache_layer=None, **mixer_kwargs) -> tuple[tuple, dict]:
        """The call's arguments with whatever the mixer draws per forward on the host drawn now and
        passed explicitly (hf_hybrid/training/layer_graphs.py keys its captures by them)."""
        settle = getattr(self.self_attn, "training_graph_kwargs", None)
        return (hidden_states, context, cache_layer), (mixer_kwargs if settle is None else settle(**mixer_kwargs))

    def forward_deferred_add(self, residual, delta, context: SequenceContext, cache_layer=None, **mixer_kwargs):
        """forward(residual + delta) returned as (residual', delta'), the last add left to the next
        norm: each residual add then rides on the RMSNorm that reads it (one kernel, add_norm), two
        launches per block fewer in a decode step. residual' + delta' rounds as forward's output.
        ``delta`` None: the input is ``residual`` itself (the first block)."""
        x, normed = add_norm(residual, delta, self.input_layernorm)
        h, normed = add_norm(x, self.self_attn(normed, context, cache_layer, **mixer_kwargs), self.post_attention_layernorm)
        return h, self.mlp(normed)
