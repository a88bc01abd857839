"""RATTENTION token mixers (RATTENTION paper Sec. 3; notes/rattention_official_facts.md).

Local layer (:class:`RattentionLocalAttention`), for input x after the block's pre-norm:

    q, k, v = W_q x, W_k x, W_v x                        raw projections, GQA (k, v: H_kv heads)
    SWA:  q~, k~ = RoPE(QKNorm(q)), RoPE(QKNorm(k))       RoPE theta 5e5, QK-norm on this branch only
          o_swa_i = softmax attention of q~_i over k~_j, v_j with 0 <= i - j <= w
    RLA:  o_rla_i = phi(q_i)^T S_i,  S_i = sum_{j <= i - w - 1} phi(k_j) v_j^T     raw q, k (no RoPE, no norm)
    out = W_o [ RMSNorm_h(o_swa) + RMSNorm_h(o_rla) ]     per-head norms, eps 1e-8, learned [H, D] scales

w = -1 removes the SWA branch (pure linear attention: out = W_o RMSNorm_h(o_rla)); w = 0 keeps
only the token itself in the window. ``use_rla=False`` gives the SWA-only local layer of the
paper's baselines.

Global layer (:class:`RattentionGlobalAttention`): causal softmax attention over all tokens, GQA,
QK-norm, no RoPE.

Padding: values of padding tokens are zeroed before anything reads them, so a padding token
contributes nothing to the RLA state (now or when it later leaves a cached window); the SWA and
global attention mask padding keys through the sequence context.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels._backend import resolve_backend
from ..kernels.residual_linear_attention import (
    feature_dim,
    residual_linear_attention,
    residual_linear_attention_decode,
    ring_decode,
    ring_decode_supported,
    sliding_window_attention,
)
from .attention import softmax_attention, static_decode_attention
from .context import SequenceContext
from .fused_norms import has_forward_hooks, norm_backend, norm_rotary, qk_norm_rotary, sum_branch_norms
from .norm import RMSNorm
from .projections import project_few_rows
from .recompute import RecomputedActivations, recompute_applies
from .rotary import build_rotary, rotary_tables

BRANCH_NORM_EPS = 1e-8


def _attend(q, k, v, mask, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """SDPA over [B, T, H, D] queries and [B, S, H_kv, D] keys with a [B, 1, T, S] bool mask (or
    None = every key visible to every query). A single query per row with nothing masked folds
    the query heads of a group into the query axis, so the fused kernels serve GQA decoding."""
    batch, seq, _, dim = q.shape
    group = num_heads // num_kv_heads
    if mask is None and seq == 1 and group > 1:
        qg = q.view(batch, num_kv_heads, group, dim)
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2))
        return out.reshape(batch, 1, num_heads, dim)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=mask is None and seq > 1, enable_gqa=group > 1,
    )
    return out.transpose(1, 2)


def _zero_padding(x: torch.Tensor, context: SequenceContext) -> torch.Tensor:
    valid = context.query_valid
    return x if valid is None else x.masked_fill(~valid[:, :, None, None], 0.0)


class _QKVProjections(nn.Module):
    """Llama-named q/k/v/o projections and optional per-head QK-norm, shared by both layer kinds."""

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, qk_norm, rms_norm_eps):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads}).")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = "auto"  # kernel backend; the local layer takes it as an argument
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm((num_heads, head_dim), eps=rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm((num_kv_heads, head_dim), eps=rms_norm_eps) if qk_norm else None

    def project(self, hidden_states: torch.Tensor):
        batch, seq, _ = hidden_states.shape
        q, k, v = project_few_rows(hidden_states, (self.q_proj, self.k_proj, self.v_proj))  # one launch when decoding
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        return q, k.view(batch, seq, self.num_kv_heads, self.head_dim), v.view(batch, seq, self.num_kv_heads, self.head_dim)

    def normed(self, q: torch.Tensor, k: torch.Tensor, cos_sin=None):
        """QK-norm (when configured), then RoPE (when ``cos_sin`` is given): one fused pass per
        tensor on CUDA (kernels/fused_norm), the modules' own math elsewhere."""
        backend = norm_backend(self.backend, q.shape[0] * q.shape[1])
        return qk_norm_rotary(q, k, self.q_norm, self.k_norm, cos_sin, backend)

    @contextlib.contextmanager
    def _normed_rebuilt(self, rebuild: bool, q, k, q_normed, k_normed, cos_sin=None):
        """Around the attention that reads ``normed(q, k, cos_sin)``: its saves of those are rebuilt in
        the backward from q and k (kept anyway by the norm, and by the RLA in a local layer) by the
        same call, instead of being kept (5 KB per token and layer at the 1.3B shape;
        layers/recompute.py). A no-op unless ``rebuild``, and for norms with forward hooks
        (offloading, user hooks): a second call of the module is theirs to allow."""
        norms = [norm for norm in (self.q_norm, self.k_norm) if norm is not None]
        if not rebuild or any(has_forward_hooks(norm) for norm in norms):
            yield
            return
        backend = norm_backend(self.backend, q.shape[0] * q.shape[1])
        tables = tuple(cos_sin) if cos_sin is not None else ()
        recompute = RecomputedActivations()
        with recompute.active():
            for x, out, norm in ((q, q_normed, self.q_norm), (k, k_normed, self.k_norm)):
                if out is not x:  # no norm and no RoPE: the input itself, nothing to rebuild
                    inputs = (x, *tables) + ((norm.weight,) if norm is not None else ())
                    # The lambda reads the inputs only, never ``out``: holding it would keep what is let go.
                    recompute.register(out, lambda x=x, norm=norm: norm_rotary(x, norm, cos_sin, backend), *inputs)
            yield


class RattentionGlobalAttention(_QKVProjections):
    """Full causal softmax attention with QK-norm and no positional embedding (the paper's global layers),
    through transformers' attention interface (``config._attn_implementation``, read per call;
    hf_hybrid/layers/attention.py)."""

    def __init__(
        self, hidden_size, num_heads, num_kv_heads, head_dim, *, qk_norm=True, rms_norm_eps=1e-6, config=None, layer_idx=None
    ):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, qk_norm, rms_norm_eps)
        # Read by transformers' attention functions (config: the implementation, set after build too).
        self.config, self.layer_idx = config, layer_idx
        self.is_causal = True
        self.num_key_value_groups = num_heads // num_kv_heads

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        q, k, v = self.project(hidden_states)
        q_normed, k_normed = self.normed(q, k)
        if seq == 1 and context.key_valid is None and getattr(cache_layer, "static_decode_active", False):
            # generate()'s static step (hf_hybrid/generation)
            return self._static_decode(q_normed, k_normed, v, cache_layer)
        # A training forward from the first token: the attention's saves of the normed q and k are
        # rebuilt in the backward. (With a cache the attention reads the cache's copy of k.)
        whole = cache_layer is None or cache_layer.get_seq_length() == 0
        with self._normed_rebuilt(whole and recompute_applies(), q, k, q_normed, k_normed):
            # transformers' layout for caches and attention functions: [batch, heads, seq, head_dim].
            q, k, v = q_normed.transpose(1, 2), k_normed.transpose(1, 2), v.transpose(1, 2)
            if cache_layer is not None:
                k, v = cache_layer.update(k, v)
            key_start = context.past_length + seq - k.shape[2]
            out = softmax_attention(self, q, k, v, context, key_start=key_start)
        return self.o_proj(out.reshape(batch, seq, -1))

    def _static_decode(self, q, k, v, cache_layer) -> torch.Tensor:
        """One token per row against the cache's fixed-capacity buffers (layers/attention.py's
        static_decode_attention). q, k, v [batch, 1, heads, head_dim]."""
        keys, values, visible = cache_layer.static_decode_update(k.transpose(1, 2), v.transpose(1, 2))
        out = static_decode_attention(q, keys, values, visible, cache_layer.static_decode_length(), None)
        return self.o_proj(out)


class RattentionLocalAttention(_QKVProjections):
    """Sliding-window attention + residual linear attention sharing the raw q/k/v projections."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window_size: int,
        *,
        feature_map: str = "softmax",
        use_rla: bool = True,
        qk_norm: bool = True,
        rope_theta: float | None = 500000.0,
        rms_norm_eps: float = 1e-6,
        branch_norm_eps: float = BRANCH_NORM_EPS,
        backend: str = "auto",
    ):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, qk_norm, rms_norm_eps)
        if not isinstance(window_size, int) or window_size < -1:
            raise ValueError(f"window_size must be an int >= -1 (-1 = pure linear attention), got {window_size!r}.")
        if window_size == -1 and not use_rla:
            raise ValueError("window_size=-1 removes the sliding window; it needs use_rla=True.")
        self.window_size, self.feature_map, self.use_rla, self.backend = window_size, feature_map, use_rla, backend
        self.use_swa = window_size >= 0
        self.swa_norm = RMSNorm((num_heads, head_dim), eps=branch_norm_eps) if self.use_swa else None
        self.rla_norm = RMSNorm((num_heads, head_dim), eps=branch_norm_eps) if use_rla else None
        self.rotary = build_rotary(head_dim, rope_theta) if self.use_swa else None
        # Read by the attention functions softmax_attention dispatches to (no config: "sdpa").
        self.is_causal, self.num_key_value_groups = True, num_heads // num_kv_heads

    @property
    def cache_capacity(self) -> int:
        """Keys/values a cache keeps: the last w + 1 (the window of the next token minus itself,
        plus the token that leaves the window at the next step and enters the RLA state)."""
        return self.window_size + 1

    def state_shape(self, batch: int) -> tuple[int, int, int, int]:
        return batch, self.num_kv_heads, feature_dim(self.feature_map, self.head_dim), self.head_dim

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        q, k, v = self.project(hidden_states)
        v = _zero_padding(v, context)
        q_swa = k_swa = cos_sin = None
        if self.use_swa:
            cos_sin = rotary_tables(self.rotary, context)
            q_swa, k_swa = self.normed(q, k, cos_sin)

        cached = cache_layer is not None and cache_layer.get_seq_length() > 0
        # A training forward over a whole sequence (no cache, or an empty one, which copies what it
        # keeps) with the kernels: q~, k~ and o_proj's input are rebuilt in the backward instead of kept.
        rebuild = not cached and (hidden_states.is_cuda or self.backend == "triton") and recompute_applies()
        if cached:
            o_swa, o_rla = self._with_cache(q, k, v, q_swa, k_swa, context, cache_layer)
        else:
            with self._normed_rebuilt(rebuild and self.use_swa, q, k, q_swa, k_swa, cos_sin):
                o_swa, o_rla, state = self._whole_sequence(q, k, v, q_swa, k_swa, context)
            if cache_layer is not None:
                cache_layer.update(k_swa, v, k if self.use_rla else None, state, capacity=self.cache_capacity)

        backend = norm_backend(self.backend, batch * seq)
        out = sum_branch_norms(o_swa, self.swa_norm, o_rla, self.rla_norm, backend)
        if rebuild:
            return self._o_proj_rebuilt(out, o_swa, o_rla, backend)
        return self.o_proj(out.reshape(batch, seq, -1))

    def _o_proj_rebuilt(self, out, o_swa, o_rla, backend: str) -> torch.Tensor:
        """o_proj(out) with its save of ``out`` = swa_norm(o_swa) + rla_norm(o_rla) rebuilt in the backward
        from the branch outputs, which the norms' backward keeps anyway, by the same call (4 KB per token
        and layer at the 1.3B shape)."""
        batch, seq = out.shape[:2]
        branches = [(o, norm) for o, norm in ((o_swa, self.swa_norm), (o_rla, self.rla_norm)) if o is not None]
        if any(has_forward_hooks(norm) for _, norm in branches):
            return self.o_proj(out.reshape(batch, seq, -1))
        inputs = [t for o, norm in branches for t in (o, norm.weight)]
        recompute = RecomputedActivations()
        with recompute.active():
            rebuild = lambda: sum_branch_norms(o_swa, self.swa_norm, o_rla, self.rla_norm, backend)  # noqa: E731
            recompute.register(out, rebuild, *inputs)
            return self.o_proj(out.reshape(batch, seq, -1))

    def _whole_sequence(self, q, k, v, q_swa, k_swa, context):
        """Prefill / training from the first token: the fast ops over the whole sequence."""
        o_swa = o_rla = state = None
        if self.use_swa:
            if context.key_valid is None:
                o_swa = sliding_window_attention(q_swa, k_swa, v, self.window_size, backend=self._swa_backend())
            else:
                o_swa = self._masked_swa(q_swa, k_swa, v, context, key_start=0)
        if self.use_rla:
            o_rla, state = residual_linear_attention(q, k, v, self.window_size, self.feature_map, backend=self.backend)
        return o_swa, o_rla, state

    def _masked_swa(self, q_swa, keys, values, context, key_start: int) -> torch.Tensor:
        """Windowed attention where padding (or cached keys) needs a mask: through the shared
        softmax_attention, which runs a flex BlockMask on CUDA instead of a dense T x T mask."""
        return softmax_attention(
            self, q_swa.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), context,
            key_start=key_start, window=self.window_size + 1,
        )

    def _decode_in_ring(self, q, k, v, q_swa, k_swa, context, cache_layer):
        """One new token per row, no padding, window full: the token leaving the window (t - w - 1)
        sits in ring slot t % (w + 1); fold it into S, overwrite the slot with token t, then attend
        over the w + 1 slots (tokens t - w .. t; order does not matter to softmax attention)."""
        if self._fused_ring_step(q, cache_layer):
            keys, values, raw_keys, state, next_column = cache_layer.ring_buffers()
            o = ring_decode(q[:, 0], k[:, 0], k_swa[:, 0], v[:, 0], state, keys, values, raw_keys, next_column,
                            self.feature_map, backend=self._decode_backend())
            cache_layer.advance_ring()
            o_swa = _attend(q_swa, cache_layer.keys, cache_layer.values, None, self.num_heads, self.num_kv_heads)
            return o_swa, o[:, None]
        slot = cache_layer.ring_slot()
        o_rla = state = None
        if self.use_rla:
            raw_out, v_out = cache_layer.read_slot(slot)
            o, state = residual_linear_attention_decode(
                q[:, 0], cache_layer.state, raw_out, v_out, feature_map=self.feature_map,
                inplace=not torch.is_grad_enabled(), backend=self._decode_backend(),
            )
            o_rla = o[:, None]
        cache_layer.write_slot(slot, k_swa, v, k if self.use_rla else None, state)
        o_swa = _attend(q_swa, cache_layer.keys, cache_layer.values, None, self.num_heads, self.num_kv_heads)
        return o_swa, o_rla

    def _fused_ring_step(self, q, cache_layer) -> bool:
        """Whether the ring step's RLA half, reads and writes run as one kernel (ring_decode): both
        branches, no gradient, no recording for crops, the Triton backend, a head_dim it takes and
        the cache's own float32 state."""
        state = cache_layer.state
        return (self.use_rla and self.use_swa and not torch.is_grad_enabled() and not cache_layer.record_past
                and ring_decode_supported(q.shape[-1]) and state is not None and state.dtype == torch.float32
                and state.is_contiguous() and self._decode_backend() in ("auto", "triton")
                and resolve_backend(self._decode_backend(), q.device, "ring_decode") == "triton")

    def _with_cache(self, q, k, v, q_swa, k_swa, context, cache_layer):
        """New tokens after cached ones: the cached window (last w + 1 tokens) is prepended."""
        seq = q.shape[1]
        if seq == 1 and context.key_valid is None and self.use_swa and cache_layer.is_full():
            return self._decode_in_ring(q, k, v, q_swa, k_swa, context, cache_layer)
        win_swa, win_v, win_raw, state = cache_layer.window()
        ext_v = torch.cat([win_v, v], dim=1)
        ext_raw = torch.cat([win_raw, k], dim=1) if self.use_rla else None
        ext_swa = torch.cat([win_swa, k_swa], dim=1) if self.use_swa else None
        held = win_v.shape[1]
        o_swa = o_rla = None
        if self.use_swa:
            keys, values = ext_swa, ext_v
            if seq == 1 and context.key_valid is None:
                # Decode without padding: the last w + 1 keys (fewer while the window fills) are all visible.
                visible = min(held + 1, self.window_size + 1)
                keys, values = keys[:, -visible:], values[:, -visible:]
                o_swa = _attend(q_swa, keys, values, None, self.num_heads, self.num_kv_heads)
            else:
                o_swa = self._masked_swa(q_swa, keys, values, context, key_start=context.past_length - held)
        if self.use_rla:
            if seq == 1:
                # Decode: the oldest of the w + 2 keys leaves the window (for w = -1, the token itself).
                leaving = held + 1 > self.cache_capacity
                k_out, v_out = (ext_raw[:, 0], ext_v[:, 0]) if leaving else (None, None)
                # In place when no graph needs the old state (generation): saves a copy of S per step.
                o, state = residual_linear_attention_decode(
                    q[:, 0], state, k_out, v_out, feature_map=self.feature_map,
                    inplace=not torch.is_grad_enabled(), backend=self._decode_backend(),
                )
                o_rla = o[:, None]
            else:
                # Several new tokens: run the op over [window ; new] from the cached state and keep
                # the new tokens' outputs (the window's own queries are placeholders).
                q_ext = torch.cat([q.new_zeros(q.shape[0], held, *q.shape[2:]), q], dim=1)
                o, state = residual_linear_attention(
                    q_ext, ext_raw, ext_v, self.window_size, self.feature_map, state, backend=self.backend
                )
                o_rla = o[:, held:]
        cache_layer.update(ext_swa, ext_v, ext_raw, state, capacity=self.cache_capacity, new_tokens=seq)
        return o_swa, o_rla

    def _decode_backend(self) -> str:
        """The decode step's backend: the fused Triton kernel unless a PyTorch path was chosen."""
        return "reference" if self.backend in ("chunked", "reference") else self.backend

    def _swa_backend(self) -> str:
        """The SWA op's backend for the layer's kernel_backend ("chunked": the SDPA band mask;
        "auto", "triton" (kernels/window_attention) and "reference" as named)."""
        return {"chunked": "sdpa"}.get(self.backend, self.backend)
