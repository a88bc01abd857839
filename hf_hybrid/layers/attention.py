"""Softmax self-attention (full or sliding window), GQA, RoPE by token position, and the one
function every softmax layer of the package attends through.

:class:`SoftmaxAttention` is the `full_attention` / `sliding_attention` layer of hybrid stacks
(RAT-SWA, Attention baselines) and the dense layer other architectures build on. Parameter names
follow Llama (q_proj, k_proj, v_proj, o_proj) so Llama checkpoints and LoRA target lists carry over.

:func:`softmax_attention` goes through transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS``, with :func:`eager_attention_forward` as the eager function, as
transformers' Llama does) and reads ``config._attn_implementation`` at every call, so
``model.set_attn_implementation(...)`` takes effect on a built model. The masks come from the
layer's :class:`~hf_hybrid.layers.context.SequenceContext`, in the form each implementation takes:

==================  =====================================================================
eager               dense boolean mask (eager materialises the scores anyway); the only
                    implementation that returns attention probabilities (output_attentions)
sdpa                no mask for causal attention over unpadded tokens (``is_causal``; aligned to
                    the last key for a slice continuing a cache, or a [1, 1, T, K] mask where a
                    window hides keys: no flex compile per slice shape) and for
                    decode steps that see every key; otherwise a boolean mask ([B,1,1,K] for a
                    decode step). On CUDA, sliding windows and padded batches with more than one
                    query do NOT get a dense T x T mask: a window over unpadded rows from position
                    0 (training, a prefill) runs kernels/window_attention (FlashAttention-2's
                    window for fp16 / bf16, Triton for float32; tiles outside the band skipped,
                    nothing compiled per shape); padded batches and cache
                    continuations run flex_attention with a BlockMask (blocks outside the band /
                    padding skipped), transformers' compiled flex (head_dim < 16, below flex's
                    minimum: the boolean mask, with a warning)
flex_attention      a BlockMask for every call with more than one query (causal included);
                    decode steps (one query) run SDPA with their [B,1,1,K] mask
flash_attention_*   FlashAttention's own causal mask, ``sliding_window`` and varlen padding
                    (a [B, K] padding mask), never a dense mask
==================  =====================================================================

A function registered by the user under another name gets the boolean mask (``None`` = causal).

generate()'s static decode step (hf_hybrid/generation/graph_decode.py) bypasses the interface:
one query per row against the cache's fixed buffers (models/attention_cache.py), the filled slots
given by a device counter, so a CUDA graph can replay it at every position
(:func:`static_decode_attention`: kernels/window_attention's split-K kernel on CUDA, SDPA with a
boolean mask elsewhere).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from ..kernels._query_blocks import query_block_size, sdpa_in_query_blocks
from ..kernels.window_attention import (
    flash_window_applies,
    window_attention,
    window_attention_applies,
    window_attention_decode,
    window_attention_decode_applies,
)
from .context import SequenceContext
from .projections import project_few_rows
from .rotary import apply_rotary, build_rotary, rotary_tables

logger = logging.get_logger(__name__)

# flex_attention's Triton kernels need head_dim >= 16.
_FLEX_MIN_HEAD_DIM = 16


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out: [B, H, T, D] queries, [B, H_kv, S, D] keys and values, a boolean
    (True = visible) or additive float mask broadcastable to [B, H, T, S]. Scores, softmax and the
    weighted sum in float32 whatever the input dtype (eager is the reference the fused paths are
    compared with). Returns the output [B, T, H, D] and the probabilities [B, H, T, S], both in the
    input dtype."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1).float()
    value = value.repeat_interleave(groups, dim=1).float()
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.float(), key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).to(query.dtype)
    return out.transpose(1, 2).contiguous(), weights.to(query.dtype)


def attention_implementation(module: nn.Module) -> str:
    """The layer's current implementation: its config's ``_attn_implementation`` (read per call),
    "sdpa" for a layer built without a config."""
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def _block_sparse(implementation: str, query: torch.Tensor) -> bool:
    """Whether a masked call with several queries runs flex_attention with a BlockMask."""
    if implementation == "flex_attention":
        return True
    if implementation != "sdpa" or query.device.type != "cuda":
        return False
    if query.shape[-1] < _FLEX_MIN_HEAD_DIM:
        logger.warning_once(
            f"head_dim={query.shape[-1]} is below flex_attention's minimum ({_FLEX_MIN_HEAD_DIM}): padded / "
            "sliding-window SDPA attention falls back to a dense boolean mask."
        )
        return False
    return True


def _sdpa_in_blocks(implementation: str, query: torch.Tensor, num_keys: int, key_start: int,
                    context: SequenceContext, window: int | None) -> bool:
    """Whether a masked SDPA call runs over blocks of queries (CPU, a whole sequence from position 0
    that needs a mask, more than one block's worth of scores) instead of with a dense [T, T] mask."""
    seq = query.shape[2]
    return (
        implementation == "sdpa" and query.device.type == "cpu" and not torch.compiler.is_compiling()
        and seq > 1 and key_start == context.past_length == 0 and num_keys == seq
        and context.needs_mask(num_keys, key_start, window)
        and query_block_size(seq, num_keys, query.shape[0] * query.shape[1]) < seq
    )


def _window_kernel_applies(implementation: str, query: torch.Tensor, num_keys: int, key_start: int,
                           context: SequenceContext, window: int | None) -> bool:
    """Whether the call is a window over whole unpadded rows from position 0 (a training step, a
    prefill from empty) that kernels/window_attention runs: SDPA implementation, several queries,
    a window that hides keys, and a kernel of kernels/window_attention built for the query (CUDA)."""
    seq = query.shape[2]
    return (
        implementation == "sdpa" and seq > 1 and key_start == context.past_length == 0 and num_keys == seq
        and context.key_valid is None and context.effective_window(num_keys, key_start, window) is not None
        and window_attention_applies(query)
    )


def _continues_unpadded(implementation: str, seq: int, context: SequenceContext) -> bool:
    """Whether the call is several new tokens after cached ones (a prefill in slices), nothing
    padded: SDPA with no mask (every key from index 0 visible up to the query: causal aligned to
    the last key) or one [1, 1, seq, keys] mask shared by the batch (a window), instead of a
    flex_attention BlockMask, whose compiled kernel would be built again for every slice shape."""
    return implementation == "sdpa" and seq > 1 and context.past_length > 0 and context.key_valid is None


def _sdpa_continuation(query, key, value, context: SequenceContext, key_start: int, window: int | None,
                       scaling) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    seq, num_keys = query.shape[2], key.shape[2]
    if key_start == 0 and num_keys == context.past_length + seq and context.effective_window(num_keys, 0, window) is None:
        mask = causal_lower_right(seq, num_keys)
    else:
        mask = context.dense_mask(num_keys, key_start, window)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    context.record_attention_weights(None)
    return out.transpose(1, 2)


def _masked_sdpa_in_blocks(query, key, value, context: SequenceContext, window: int | None, scaling) -> torch.Tensor:
    """SDPA over blocks of queries with the context's mask rows (and, with a window, only the keys
    in the band): memory and work linear in T where the dense mask would be [T, T]."""
    num_keys = key.shape[2]
    band = context.effective_window(num_keys, 0, window)

    def rows(start, end, lo, hi):
        return context.mask_rows(num_keys, 0, window, start, end, lo, hi)

    out = sdpa_in_query_blocks(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), rows,
        key_start=None if band is None else (lambda start: max(0, start - band + 1)),
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
    )
    context.record_attention_weights(None)
    return out


def softmax_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context: SequenceContext,
    *,
    key_start: int,
    window: int | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention of the new tokens over keys with absolute indices key_start ..
    key_start + S - 1 (a window of ``window`` tokens, the token itself included, when given), in
    the implementation ``module.config._attn_implementation`` names.

    query [B, H, T, D], key / value [B, H_kv, S, D] (transformers' layout); returns [B, T, H, D].
    ``module`` carries what transformers' attention functions read: ``config``, ``is_causal``,
    ``num_key_value_groups``, ``training`` (and ``layer_idx`` when it has one).
    """
    implementation = attention_implementation(module)
    seq, num_keys = query.shape[2], key.shape[2]
    kwargs = {"scaling": scaling, "dropout": 0.0}
    if implementation == "eager":
        interface, mask = eager_attention_forward, context.dense_mask(num_keys, key_start, window)
    elif "flash" in implementation:
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        mask = context.padding_mask(num_keys, key_start)
        kwargs["sliding_window"] = context.effective_window(num_keys, key_start, window)
    elif _window_kernel_applies(implementation, query, num_keys, key_start, context, window):
        out = window_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                               window_size=window, scale=scaling,
                               backend="flash" if flash_window_applies(query) else "triton")
        context.record_attention_weights(None)
        return out
    elif _continues_unpadded(implementation, seq, context):
        return _sdpa_continuation(query, key, value, context, key_start, window, scaling)
    elif seq > 1 and (implementation == "flex_attention" or context.needs_mask(num_keys, key_start, window)) and _block_sparse(
        implementation, query
    ):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface("flex_attention", eager_attention_forward)
        mask = context.block_mask(num_keys, key_start, window)
    elif _sdpa_in_blocks(implementation, query, num_keys, key_start, context, window):
        return _masked_sdpa_in_blocks(query, key, value, context, window, scaling)
    else:
        # SDPA (flex decode steps too) or a user-registered function: a boolean mask, None = causal.
        name = "sdpa" if implementation == "flex_attention" else implementation
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
        mask = context.attention_mask(num_keys, key_start, window)
    out, weights = interface(module, query, key, value, mask, **kwargs)
    # Only the eager function's second output is the probabilities (flex returns its LSE there).
    context.record_attention_weights(weights if interface is eager_attention_forward else None)
    return out


class SoftmaxAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float | None,
        sliding_window: int | None = None,
        attention_bias: bool = False,
        *,
        config=None,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        # Read by transformers' attention functions (config: the implementation, set after build too).
        self.config, self.layer_idx = config, layer_idx
        self.is_causal = True
        self.num_key_value_groups = num_heads // num_kv_heads
        self.scaling = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = build_rotary(head_dim, rope_theta)

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        q, k, v = project_few_rows(hidden_states, (self.q_proj, self.k_proj, self.v_proj))  # one launch when decoding
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k, v = k.view(batch, seq, self.num_kv_heads, self.head_dim), v.view(batch, seq, self.num_kv_heads, self.head_dim)
        cos_sin = rotary_tables(self.rotary, context)
        q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)
        # transformers' cache layers and attention functions take [batch, heads, seq, head_dim].
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache_layer is not None and seq == 1 and context.key_valid is None and getattr(cache_layer, "static_decode_active", False):
            return self.o_proj(self._static_decode(q, k, v, cache_layer))  # generate()'s static step (hf_hybrid/generation)
        if cache_layer is not None:
            k, v = cache_layer.update(k, v)
        key_start = context.past_length + seq - k.shape[2]
        out = softmax_attention(
            self, q, k, v, context, key_start=key_start, window=self.sliding_window, scaling=self.scaling
        )
        return self.o_proj(out.reshape(batch, seq, -1))

    def _static_decode(self, q, k, v, cache_layer) -> torch.Tensor:
        """One token per row against the cache's fixed buffers (models/attention_cache.py: all K/V,
        or the window's ring). q, k, v [batch, heads, 1, head_dim]; returns [batch, 1, heads * head_dim]."""
        keys, values, visible = cache_layer.static_decode_update(k, v)
        return static_decode_attention(q.transpose(1, 2), keys, values, visible, cache_layer.static_decode_length(),
                                       self.scaling)


def static_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                            length: torch.Tensor, scale: float | None) -> torch.Tensor:
    """generate()'s static decode step of a softmax layer: one query per row over a cache's fixed
    buffers, the slots not filled yet unseen by a device counter (no host decision: what a CUDA
    graph replays), whatever the attention implementation. On CUDA the split-K kernel of
    kernels/window_attention reads the buffers once over ``length``; elsewhere SDPA with the
    ``visible`` mask, the query heads of a KV group sharing the query axis (no GQA expansion).
    q [batch, 1, heads, head_dim]; keys, values [batch, kv_heads, slots, head_dim] buffers;
    visible [1, 1, 1, slots] bool; length [1] the filled count (a ring: tokens written);
    returns [batch, 1, heads * head_dim]."""
    batch, _, heads, dim = q.shape
    if window_attention_decode_applies(q):
        out = window_attention_decode(q, keys.transpose(1, 2), values.transpose(1, 2), length, scale=scale,
                                      backend="triton")
        return out.reshape(batch, 1, heads * dim)
    qg = q.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(batch, 1, heads * dim)
