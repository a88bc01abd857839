"""FoX token mixer: Forgetting Attention (FoX paper Sec. 3, Appendix A, Appendix D).

For input x (after the block's pre-norm), per query head h:

    q, k~, v~ = W_q x, W_k x, W_v x                       GQA: k, v have num_kv_heads heads
    log f_t   = logsigmoid(w_f^h . x_t + b_f^h)            forget gate, float32, bias init 0
    o_i       = sum_j softmax_j(q_i.k_j / sqrt(d) + c_i - c_j) v_j,   c = cumsum(log f)
    out       = W_o o                                      ("llama" block)

The "pro" block (Appendix A, Eq. 15-23) adds, each part switchable for ablations:
    QK-norm      q = RMSNorm_h(q), k = RMSNorm_h(k)                        (per-head weights)
    KV-shift     k_t = RMSNorm_h(a_t k~_{t-1} + (1 - a_t) k~_t), a_t = sigmoid(w_k^h . x_t)
                 v_t = b_t v~_{t-1} + (1 - b_t) v~_t,               b_t = sigmoid(w_v^h . x_t)
                 (one scalar per key/value head; k~_{-1} = 0, also at a row's first real token)
    output       out = W_o (RMSNorm_h(o) * sigmoid(W_g x))

Forget-gate variants (Sec. 4.5, Appendix D): "data_dependent" (default), "data_independent"
f^h = sigmoid(b^h) learnable, "fixed" (the same, frozen: ALiBi), and "none" (f = 1, plain
softmax attention: the Transformer baselines). The two data-independent kinds initialise b^h so
that T(b) = -1 / log sigmoid(b) runs geometrically from T_min (head 1) to T_max (head H).
No RoPE by default (``rope_theta=None``); optional RoPE rotates q and k after the norms.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from transformers.utils import logging

from ..kernels.forgetting_attention import (
    cumulative_log_forget,
    forgetting_attention,
    forgetting_attention_decode,
    forgetting_attention_with_cache,
)
from ..kernels.kv_shift import kv_shift
from ..kernels.output_gate import sigmoid_gate
from .context import SequenceContext
from .fused_norms import norm_backend, norm_rotary, qk_norm_rotary
from .norm import RMSNorm
from .projections import project_shared_input
from .rotary import apply_rotary, build_rotary, rotary_tables

FORGET_GATE_TYPES = ("data_dependent", "data_independent", "fixed", "none")

logger = logging.get_logger(__name__)


def forget_bias_init(num_heads: int, t_min: float, t_max: float) -> torch.Tensor:
    """Appendix D: b^h with T(b^h) = exp(log T_min + (log T_max - log T_min) (h - 1) / (H - 1)),
    where T(b) = 1 / (-log sigmoid(b)) is the number of steps to decay by 1/e."""
    if num_heads == 1:
        timescales = torch.tensor([float(t_min)], dtype=torch.float64)
    else:
        frac = torch.arange(num_heads, dtype=torch.float64) / (num_heads - 1)
        timescales = torch.exp(math.log(t_min) + (math.log(t_max) - math.log(t_min)) * frac)
    # sigmoid(b) = exp(-1/T)  =>  b = log(p / (1 - p)) with p = exp(-1/T)
    return (-1.0 / timescales - torch.log(-torch.expm1(-1.0 / timescales))).float()


def padded_row_boundaries(query_valid: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens that cut the flattened [batch * seq] columns wherever a row starts and wherever
    its run of real tokens starts or ends, or None when some row's real tokens are not one
    contiguous run (a hole in the mask). Left- and right-padded rows qualify: packed this way,
    the varlen kernel lets no real token see padding or another row, and the cumulative log
    forget restarts at each row's first real token, which is what the row computes alone."""
    batch, seq = query_valid.shape
    valid = query_valid.long()
    run_starts = (valid[:, 1:] > valid[:, :-1]).sum(-1) + valid[:, 0]
    if bool((run_starts > 1).any()):
        return None
    row_start = torch.arange(batch, device=valid.device) * seq
    first = valid.argmax(-1)  # 0 for a row without real tokens: its cuts coincide with the row start
    cuts = torch.cat([row_start, row_start + first, row_start + first + valid.sum(-1), row_start.new_tensor([batch * seq])])
    return torch.unique(cuts).to(torch.int32)  # sorted, duplicates (empty pieces) removed


class ShiftLinear(nn.Module):
    """KV-shift (Eq. 14): x_t -> a_t x~_{t-1} + (1 - a_t) x~_t with a_t = sigmoid(w^h . input_t)
    per head. ``previous`` [batch, heads, head_dim] is x~ of the token before the segment (zeros
    when none)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.proj = nn.Linear(hidden_size, num_heads, bias=False)

    def forward(self, hidden_states: torch.Tensor, x: torch.Tensor, previous: torch.Tensor | None,
                logits: torch.Tensor | None = None, backend: str = "reference") -> torch.Tensor:
        """``logits``: proj(hidden_states) when the caller computed it already (with the layer's other
        projections of hidden_states, in one launch when decoding). ``backend``: the kv_shift op's
        (kernels/kv_shift: one Triton pass forward and backward; float32 math either way)."""
        logits = self.proj(hidden_states) if logits is None else logits
        return kv_shift(x, logits, previous, backend=backend)


class ForgettingAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = False,
        kv_shift: bool = False,
        output_gate: bool = False,
        output_norm: bool = False,
        forget_gate: str = "data_dependent",
        forget_gate_t_min: float = 2.0,
        forget_gate_t_max: float = 256.0,
        rope_theta: float | None = None,
        rms_norm_eps: float = 1e-6,
        qk_norm_eps: float | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        if forget_gate not in FORGET_GATE_TYPES:
            raise ValueError(f"forget_gate must be one of {FORGET_GATE_TYPES}, got {forget_gate!r}.")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads}).")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.forget_gate, self.t_min, self.t_max = forget_gate, forget_gate_t_min, forget_gate_t_max
        self.backend = backend
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        # The only linear layer with a bias (Appendix B.1); bias initialised to 0 (Appendix D).
        self.f_proj = nn.Linear(hidden_size, num_heads, bias=True) if forget_gate == "data_dependent" else None
        if forget_gate in ("data_independent", "fixed"):
            self.forget_bias = nn.Parameter(
                forget_bias_init(num_heads, forget_gate_t_min, forget_gate_t_max),
                requires_grad=forget_gate == "data_independent",
            )
        qk_eps = rms_norm_eps if qk_norm_eps is None else qk_norm_eps
        self.q_norm = RMSNorm((num_heads, head_dim), eps=qk_eps) if qk_norm else None
        self.k_norm = RMSNorm((num_kv_heads, head_dim), eps=qk_eps) if qk_norm else None
        self.k_shift = ShiftLinear(hidden_size, num_kv_heads) if kv_shift else None
        self.v_shift = ShiftLinear(hidden_size, num_kv_heads) if kv_shift else None
        self.g_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False) if output_gate else None
        self.o_norm = RMSNorm((num_heads, head_dim), eps=rms_norm_eps) if output_norm else None
        self.rotary = build_rotary(head_dim, rope_theta)

    @torch.no_grad()
    def reset_extra_parameters(self) -> None:
        """Forget-gate bias 0 for the data-dependent gate, the T_min/T_max schedule otherwise."""
        if self.f_proj is not None:
            self.f_proj.bias.zero_()
        if hasattr(self, "forget_bias"):
            self.forget_bias.copy_(forget_bias_init(self.num_heads, self.t_min, self.t_max))

    def log_forget(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """log f [batch, seq, heads] in float32."""
        batch, seq, _ = hidden_states.shape
        if self.f_proj is not None:
            return F.logsigmoid(self.f_proj(hidden_states).float())
        if self.forget_gate == "none":
            return hidden_states.new_zeros(batch, seq, self.num_heads, dtype=torch.float32)
        return F.logsigmoid(self.forget_bias.float()).expand(batch, seq, self.num_heads)

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v, gate, k_shift_logits, v_shift_logits = self._projections(hidden_states)
        q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv_heads, dim), v.view(batch, seq, kv_heads, dim)
        log_f = self.log_forget(hidden_states)
        query_valid = context.query_valid
        if query_valid is not None:
            # Padding contributes nothing: no shift input for the first real token, no decay.
            pad = ~query_valid[:, :, None]
            k, v = k.masked_fill(pad[..., None], 0.0), v.masked_fill(pad[..., None], 0.0)
            log_f = log_f.masked_fill(pad, 0.0)

        raw_k, raw_v = k, v
        # The per-head norms, the KV-shift and the output gate through fused kernels (one launch forward
        # and backward each where PyTorch takes several and keeps float32 intermediates) in training,
        # prefill and generate()'s static decode step; PyTorch's math for a few eager tokens.
        norms = norm_backend(self.backend, batch * seq)
        if self.k_shift is not None:
            prev_k, prev_v = cache_layer.shift_state() if cache_layer is not None else (None, None)
            k = self.k_shift(hidden_states, k, prev_k, k_shift_logits, backend=norms)
            v = self.v_shift(hidden_states, v, prev_v, v_shift_logits, backend=norms)
        if self.q_norm is not None:
            q, k = qk_norm_rotary(q, k, self.q_norm, self.k_norm, None, norms)
        if self.rotary is not None:
            cos_sin = rotary_tables(self.rotary, context)
            q, k = apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)

        # generate()'s static decode step (hf_hybrid/generation): fixed buffers, device-side length.
        static = seq == 1 and context.key_valid is None and getattr(cache_layer, "static_decode_active", False)
        if cache_layer is not None and not static:
            cache_layer.record_token_states(raw_k, raw_v)  # kept only while a crop may need them
            keys, values, c_keys = cache_layer.update(k, v, log_f, raw_k[:, -1], raw_v[:, -1])
        if static:
            o = self._attend_static_decode(q, k, v, log_f, raw_k, raw_v, cache_layer)
        elif context.past_length == 0:
            # Whole sequences from the start (training, prefill): the keys are the segment's own.
            o = self._attend_segment(q, k, v, log_f, query_valid)
        elif cache_layer is None:
            raise ValueError(
                f"ForgettingAttention: the context says {context.past_length} tokens are cached, but no cache layer was "
                "passed; pass the FoxCache layer that holds them (or a context with past_length=0)."
            )
        else:
            # Queries at the end of cached keys.
            o = forgetting_attention_with_cache(
                q, keys, values, c_keys[:, -seq:], c_keys, context.key_valid, backend=self.backend
            )

        return self.output(o, gate, norms)

    def output(self, o: torch.Tensor, gate: torch.Tensor | None, norms: str) -> torch.Tensor:
        """o_proj(gate * norm(o)) of the attention output o [batch, seq, heads, dim] (Pro's output
        norm and gate where the block has them)."""
        batch, seq, heads, dim = o.shape
        if self.o_norm is not None:
            o = norm_rotary(o, self.o_norm, None, norms)
        o = o.reshape(batch, seq, heads * dim)
        if gate is not None:
            o = sigmoid_gate(gate, o, backend=norms)
        return self.o_proj(o)

    def _projections(self, hidden_states: torch.Tensor):
        """q, k, v, the output gate's logits and the KV-shift logits (None for parts the block lacks):
        the bias-free projections of hidden_states, in one few-row launch when decoding and with the
        input gradients summed inside the GEMMs when training (layers/projections.py)."""
        shifts = [s.proj if s is not None else None for s in (self.k_shift, self.v_shift)]
        optional = [self.g_proj, *shifts]
        present = [m for m in optional if m is not None]
        outs = iter(project_shared_input(hidden_states, (self.q_proj, self.k_proj, self.v_proj, *present)))
        q, k, v = next(outs), next(outs), next(outs)
        return (q, k, v, *(next(outs) if m is not None else None for m in optional))

    def _attend_segment(self, q, k, v, log_f, query_valid: torch.Tensor | None) -> torch.Tensor:
        """Attention of a segment that starts at index 0 over its own keys (nothing cached before it);
        padded positions already carry k = v = 0 and log f = 0."""
        if query_valid is None:
            return forgetting_attention(q, k, v, log_f, backend=self.backend)
        # The Triton kernel takes padded rows as packed varlen pieces (linear memory, fused backward).
        # The reference would build a [batch * seq]^2 mask that way: it takes the per-row path below.
        kernel = self.backend == "triton" or (self.backend == "auto" and q.is_cuda)
        # The boundaries are a host-side decision on the mask's data: torch.compile takes the exact
        # masked path below instead (drop an all-ones attention_mask to keep the kernel compiled).
        kernel = kernel and not torch.compiler.is_compiling()
        boundaries = padded_row_boundaries(query_valid) if kernel else None
        if boundaries is not None:
            batch, seq = q.shape[:2]
            packed = forgetting_attention(
                q.reshape(1, batch * seq, *q.shape[2:]), k.reshape(1, batch * seq, *k.shape[2:]),
                v.reshape(1, batch * seq, *v.shape[2:]), log_f.reshape(1, batch * seq, -1),
                cu_seqlens=boundaries, backend=self.backend,
            )
            return packed.view(q.shape)
        if kernel:
            logger.warning_once(
                "ForgettingAttention: attention_mask has padding inside a row (not only at its start or end); "
                "this forward takes the exact masked path with [batch, heads, seq, seq] scores instead of the kernel."
            )
        # Pads hold log f = 0, so one running sum per row gives every real key its row-alone c.
        c = cumulative_log_forget(log_f)
        return forgetting_attention_with_cache(q, k, v, c, c, query_valid, backend=self.backend)

    def _attend_static_decode(self, q, k, v, log_f, raw_k, raw_v, cache_layer) -> torch.Tensor:
        """One token per row against the cache's fixed-capacity buffers (FoxLayerCache.static_decode_update):
        the filled length is a device counter, so the step has the same shapes and launches at every position."""
        keys, values, c_q, c_keys, length = cache_layer.static_decode_update(k, v, log_f, raw_k[:, -1], raw_v[:, -1])
        return forgetting_attention_decode(q, keys, values, c_q, c_keys, length, backend=self.backend)
