"""RAT+ token mixer (RAT+ paper Sec. 4, Appendix A.1; notes/official_code_facts.md "RAT+ layer").

For input x (after the block's pre-norm), with H query heads and H_kv key/value heads (GQA):

    q = W_q x   [H, d]        k = W_k x, v = W_v x   [H_kv, d]
    g = sigmoid(W_g x (+ b_g))  [H_kv, d], float32   recurrence gate, per head and dimension
    k~_t = g_t * k~_{t-1} + (1 - g_t) * k_t          full-sequence recurrence (no chunk restarts),
    v~_t = g_t * v~_{t-1} + (1 - g_t) * v_t          accumulated in float32, then the model dtype
    q, k~ rotated by token position (RoPE after the recurrence; NoPE when rope_theta is None)
    y    = softmax attention of q over (k~, v~) under the call's sparse pattern, scale d^-0.5
    out  = W_o (sigmoid(W_z x) * y)                   output gate

Sparse pattern per head (``hf_hybrid.sparse``): dense causal (D = 1), dilated (key j visible to
query i iff j <= i and ((j + 1) % D == 0 or i - j <= W or j < I)), or top-k blocks (|| dilation).
Head groups with different patterns (layer/head hybrids) are computed separately. A
``RowPatterns`` call (a pattern per row group: RAT+'s joint objective as one forward over the
patterns' stacked rows) runs projections, recurrence, RoPE and the output gate once over every row
and only the attention of each row group under its own pattern.

Differences from the official code, on purpose: the projections are separate Linear layers with
Llama's names (q/k/v/o_proj) plus g_proj (recurrence gate) and z_proj (output gate), so dense
Llama checkpoints convert one to one; k/v may have fewer heads than q (GQA), so the gate has the
k/v width; ``recurrence_gate_bias`` adds a bias to g_proj (off by default, as in the official
code; the dense-to-RAT+ conversion uses it to start with the gate closed). ``use_recurrence=False``
drops g_proj and uses k~ = k, v~ = v: the paper's attention baseline with output gate (D-dagger).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels._backend import resolve_backend
from ..kernels._query_blocks import sdpa_in_query_blocks
from ..kernels.chunk_attention import block_end_attention, block_end_mask, rat_plus_decode_step
from ..kernels.chunk_attention.rat_decode import decode_head_dim_supported
from ..kernels.fused_norm import rotary
from ..kernels.gated_recurrence import gated_recurrence
from ..kernels.output_gate import sigmoid_gate
from ..kernels.topk_block_attention import (
    block_scores,
    block_summaries,
    dilated_mask,
    masked_attention_reference,
    select_blocks,
    topk_block_mask,
)
from ..sparse import AttentionPattern, RowPatterns, SparseInferenceConfig
from .context import SequenceContext
from .projections import project_few_rows
from .rotary import build_rotary, rotary_tables

# A cache's store returns this in place of a block summary when every key position >= 0 it returns
# is visible to the decoded token (RAT+'s static dilated store): the layer then builds no pattern mask.
STORED_ARE_VISIBLE = "stored positions are the visible keys"


def select_kv_heads(x: torch.Tensor, kv_heads, index_tensor=None) -> torch.Tensor:
    """x[:, :, kv_heads] for [batch, seq, kv, dim]; x itself when that is every kv head in order
    (no copy of a long prefill). ``index_tensor(index, device)``: a memo of device index tensors."""
    if list(kv_heads) == list(range(x.shape[2])):
        return x
    index = index_tensor(tuple(kv_heads), x.device) if index_tensor else torch.tensor(kv_heads, device=x.device)
    return x.index_select(2, index)

DENSE = SparseInferenceConfig(dilation=1, num_sink_tokens=0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, reference: bool) -> torch.Tensor:
    """Softmax attention, q/k/v [batch, seq, heads, head_dim] (equal heads), bool mask [batch, 1|heads, q, k].

    mask None means plain causal attention with queries and keys aligned. ``reference`` computes in
    float32 from the definition (``masked_attention_reference``), else SDPA. Queries that see no key
    (padding only) get a finite output (zero in the reference, all keys with SDPA); it is ignored.
    """
    if reference:
        if mask is None:
            causal = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - q.shape[1])
            mask = causal[None, None]
        return masked_attention_reference(q, k, v, mask)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
    else:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


class RatPlusAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        rope_theta: float | None = 10000.0,
        use_recurrence: bool = True,
        recurrence_gate_bias: bool = False,
        backend: str = "auto",
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads}).")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx, self.backend, self.use_recurrence = layer_idx, backend, use_recurrence
        kv_dim = num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        if use_recurrence:
            self.g_proj = nn.Linear(hidden_size, kv_dim, bias=recurrence_gate_bias)
        self.z_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = build_rotary(head_dim, rope_theta)

    # ------------------------------------------------------------------ recurrence
    def recurrence(self, x, k, v, context: SequenceContext, cache_layer):
        """float32 k~, v~ [batch, seq, kv_heads, head_dim] (see the module docstring)."""
        if not self.use_recurrence:
            return k.float(), v.float()
        batch, seq = x.shape[:2]
        gate = torch.sigmoid(self.g_proj(x).float()).view(batch, seq, self.num_kv_heads, self.head_dim)
        if context.query_valid is not None:
            # Padding must not touch the state: a gate of 1 keeps it and ignores the input.
            gate = gate.masked_fill(~context.query_valid[:, :, None, None], 1.0)
        state_k, state_v = cache_layer.recurrent_state() if cache_layer is not None else (None, None)
        start = context.past_length
        # float32 states from the 16-bit k, v without float32 copies of them (the kernel reads x as is)
        k_tilde = gated_recurrence(k, gate, 0, start, state_k, backend=self.backend, out_dtype=torch.float32)
        v_tilde = gated_recurrence(v, gate, 0, start, state_v, backend=self.backend, out_dtype=torch.float32)
        return k_tilde, v_tilde

    # ------------------------------------------------------------------ attention per head group
    def _expand(self, x: torch.Tensor, kv_heads: list[int], heads: tuple[int, ...]) -> torch.Tensor:
        """[.., len(kv_heads), d] -> one slice per query head of the group (head h reads kv h // rep)."""
        rep = self.num_heads // self.num_kv_heads
        return select_kv_heads(x, [kv_heads.index(h // rep) for h in heads], self._index_tensor)

    def _index_tensor(self, index: tuple[int, ...], device) -> torch.Tensor:
        """A device copy of ``index``, made once: a decode step captured in a CUDA graph cannot copy from the host.
        Under torch.compile the index is a constant of the graph instead (Dynamo cannot trace the memo)."""
        if torch.compiler.is_compiling():
            return torch.tensor(index, device=device)
        tensors = self.__dict__.setdefault("_index_tensors", {})
        key = (index, str(device))
        if key not in tensors:
            tensors[key] = torch.tensor(index, device=device)
        return tensors[key]

    def _group_attention(self, pattern: AttentionPattern, heads, kv_heads, q, keys, values, q_pos, k_pos, summary, fresh):
        """Attention of one head group. ``fresh``: keys are exactly this call's tokens, unpadded, from position 0."""
        reference = self.backend == "reference"
        k, v = self._expand(keys, kv_heads, heads), self._expand(values, kv_heads, heads)
        if pattern.kind == "dense":
            mask = None if fresh else dilated_mask(q_pos, k_pos, 1)[:, None]
            return attend(q, k, v, mask, reference)
        if pattern.kind == "dilated":
            if (
                fresh
                and self.backend in ("auto", "triton")
                and resolve_backend(self.backend, q.device, "block_end_attention") == "triton"
            ):
                return block_end_attention(q, k, v, pattern.dilation, pattern.local_window, pattern.num_sink_tokens, backend=self.backend)
            if fresh and not reference and q.device.type == "cpu" and not torch.compiler.is_compiling():
                # SDPA over blocks of queries with their rows of the pattern: no [T, T] mask.
                def rows(start, end, lo, hi):
                    return block_end_mask(end - start, hi, pattern.dilation, pattern.local_window,
                                          pattern.num_sink_tokens, query_start=start, device=q.device)[:, lo:]

                return sdpa_in_query_blocks(q, k, v, rows)
            if summary is STORED_ARE_VISIBLE:  # the static decode store: no pattern mask to build
                return attend(q, k, v, (k_pos >= 0)[:, None, None, :], reference)
            mask = dilated_mask(q_pos, k_pos, pattern.dilation, pattern.local_window, pattern.num_sink_tokens)
            return attend(q, k, v, mask[:, None], reference)
        size = pattern.block_size
        if summary is None:
            num_blocks = int(k_pos.max() + 1) // size
            summary = block_summaries(keys, k_pos, size, pattern.block_scoring, num_blocks)
        stats, complete = summary
        scores = block_scores(q, self._expand(stats, kv_heads, heads), pattern.block_scoring)
        selected = select_blocks(scores, q_pos, complete, size, pattern.top_k)
        mask = topk_block_mask(
            selected, q_pos, k_pos, size, pattern.dilation, pattern.local_window, pattern.num_sink_tokens
        )
        return attend(q, k, v, mask, reference)

    # ------------------------------------------------------------------ generate()'s static decode step
    def _fused_step_store(self, x, context: SequenceContext, cache_layer, groups):
        """The fixed store of generate()'s static decode step when that step runs fused
        (kernels/chunk_attention/rat_plus_decode.py: two Triton launches instead of ~30): one
        unpadded token per row, no gradient, the Triton backend, a head_dim the kernels take. None
        otherwise, and the op-by-op step below (the reference it is tested against) runs."""
        if (cache_layer is None or x.shape[1] != 1 or context.key_valid is not None
                or torch.is_grad_enabled() or self.backend not in ("auto", "triton")
                or not decode_head_dim_supported(self.head_dim) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32)
                or resolve_backend(self.backend, x.device, "rat_plus_decode_step") != "triton"):
            return None
        static_step_store = getattr(cache_layer, "static_step_store", None)
        return static_step_store(groups) if static_step_store is not None else None

    def _fused_static_step(self, x, context: SequenceContext, cache_layer, store) -> torch.Tensor:
        batch = x.shape[0]
        projections = (self.q_proj, self.k_proj, self.v_proj, self.z_proj)
        separate_gate = self.use_recurrence and self.g_proj.bias is not None  # the few-row kernel takes no bias
        if self.use_recurrence and not separate_gate:
            projections += (self.g_proj,)
        q, k, v, gate_z, *gate = project_few_rows(x, projections)  # one launch for all (layers/projections.py)
        gate_logits = self.g_proj(x) if separate_gate else (gate[0] if gate else None)
        kv_shape = (batch, 1, self.num_kv_heads, self.head_dim)
        state_key, state_value = cache_layer.recurrent_state() if self.use_recurrence else (None, None)
        keys, values, stored, sink_valid = store.step_buffers()
        y = rat_plus_decode_step(
            q.view(batch, 1, self.num_heads, self.head_dim), k.view(kv_shape), v.view(kv_shape),
            gate_logits.view(kv_shape) if gate_logits is not None else None, state_key, state_value,
            context.positions[0], rotary_tables(self.rotary, context), keys, values, stored, store.layout, sink_valid,
            output_gate=gate_z.view(batch, 1, self.num_heads, self.head_dim), backend=self.backend,
        )
        cache_layer.static_decode_advance()
        return self.o_proj(y.reshape(gate_z.shape))

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: SequenceContext,
        cache_layer=None,
        sparse_config: SparseInferenceConfig | RowPatterns | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        heads, kv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        row_patterns = sparse_config if isinstance(sparse_config, RowPatterns) else None
        if row_patterns is not None:
            self._check_row_patterns(row_patterns, batch, cache_layer)
            groups = group_kv = None
        else:
            groups = (sparse_config or DENSE).layer_groups(self.layer_idx, heads)
            store = self._fused_step_store(hidden_states, context, cache_layer, groups)
            if store is not None:
                return self._fused_static_step(hidden_states, context, cache_layer, store)
            group_kv = self._group_kv(groups)

        # One launch for the four projections when decoding (layers/projections.py).
        q, k, v, gate_z = project_few_rows(hidden_states, (self.q_proj, self.k_proj, self.v_proj, self.z_proj))
        q, k, v = q.view(batch, seq, heads, dim), k.view(batch, seq, kv, dim), v.view(batch, seq, kv, dim)
        k_tilde, v_tilde = self.recurrence(hidden_states, k, v, context, cache_layer)
        cos_sin = rotary_tables(self.rotary, context)
        # One Triton pass per tensor on CUDA (the PyTorch statement makes ~7 float32 passes); the same
        # float32 math and single rounding.
        rope_backend = self.backend if self.backend in ("reference", "triton") else "auto"
        q = rotary(q, cos_sin, backend=rope_backend)
        k_rot = rotary(k_tilde.to(q.dtype), cos_sin, backend=rope_backend)
        v_tilde_model = v_tilde.to(q.dtype)

        q_pos = context.positions
        k_pos_new = q_pos if context.query_valid is None else q_pos.masked_fill(~context.query_valid, -1)
        # A segment from position 0 without padding (training, or a prefill into an empty cache):
        # its own keys are all the keys, so dense and dilated groups run the block-end kernels on
        # them instead of a mask over the cache's layout (a dense T x T mask at a long prefill).
        fresh = context.key_valid is None and context.past_length == 0
        if row_patterns is not None:
            y = self._row_group_attention(row_patterns, q, k_rot, v_tilde_model, q_pos, k_pos_new, fresh)
            return self.o_proj(sigmoid_gate(gate_z, y.reshape(gate_z.shape), backend=self.backend))
        own = None
        if cache_layer is None or fresh:
            own = self._own_keys(group_kv, k_rot, v_tilde_model, k_pos_new)
        if cache_layer is not None:
            cache_layer.record_token_states(k_tilde, v_tilde)  # kept only while a crop may need them
            per_group = cache_layer.update(
                k_rot, v_tilde_model, k_pos_new, groups, group_kv, k_tilde[:, -1], v_tilde[:, -1],
                static=seq == 1 and context.key_valid is None,  # fixed buffers in generate()'s static step
                need_keys=[not fresh or pattern.kind == "topk" for pattern, _ in groups],
                first_position=context.uniform_start,  # unpadded rows: no nonzero() host reads
            )
            if fresh:  # top-k groups keep the cache's block summaries
                per_group = [c if pattern.kind == "topk" else o for (pattern, _), o, c in zip(groups, own, per_group)]
        else:
            per_group = own
        y = self._attention(groups, group_kv, q, per_group, q_pos, fresh)
        return self.o_proj(sigmoid_gate(gate_z, y.reshape(gate_z.shape), backend=self.backend))

    def _group_kv(self, groups) -> list[list[int]]:
        """The kv heads each head group reads."""
        rep = self.num_heads // self.num_kv_heads
        return [sorted({h // rep for h in group_heads}) for _, group_heads in groups]

    def _own_keys(self, group_kv, k_rot, v_tilde, k_pos):
        """Per head group, the call's own keys and values (no cache): (keys, values, positions, None)."""
        return [(select_kv_heads(k_rot, kv_heads, self._index_tensor), select_kv_heads(v_tilde, kv_heads, self._index_tensor), k_pos, None)
                for kv_heads in group_kv]

    def _attention(self, groups, group_kv, q, per_group, q_pos, fresh) -> torch.Tensor:
        """y [batch, seq, heads, dim]: each head group's attention under its pattern."""
        y = q.new_empty(q.shape) if len(groups) > 1 else None
        for (pattern, group_heads), kv_heads, (keys, values, k_pos, summary) in zip(groups, group_kv, per_group):
            # Device index tensors made once (a captured decode step cannot copy an index from the host).
            heads_index = None if len(groups) == 1 else self._index_tensor(tuple(group_heads), q.device)
            q_group = q if heads_index is None else q.index_select(2, heads_index)
            out = self._group_attention(pattern, group_heads, kv_heads, q_group, keys, values, q_pos, k_pos, summary, fresh)
            if y is None:
                y = out
            else:
                y.index_copy_(2, heads_index, out.to(y.dtype))
        return y

    # ------------------------------------------------------------------ a pattern per row group
    def _check_row_patterns(self, row_patterns: RowPatterns, batch: int, cache_layer) -> None:
        if cache_layer is not None:
            raise ValueError(
                "RowPatterns (a sparse pattern per row group, RAT+'s joint training forward) runs without a cache: "
                "pass use_cache=False and no past_key_values."
            )
        if len(row_patterns.row_pattern) != batch:
            raise ValueError(
                f"RowPatterns assigns a pattern to {len(row_patterns.row_pattern)} rows but the batch has {batch} rows."
            )

    def _row_group_attention(self, row_patterns: RowPatterns, q, k_rot, v_tilde, q_pos, k_pos, fresh) -> torch.Tensor:
        """y [batch, seq, heads, dim] when row groups attend under different patterns: everything
        before and after attention ran once over all rows; here each group's rows attend alone."""
        row_groups = row_patterns.row_groups()
        y = q.new_empty(q.shape) if len(row_groups) > 1 else None
        for config, rows in row_groups:
            take = (lambda x: x) if y is None else (lambda x: self._take_rows(x, rows))  # noqa: E731
            groups = config.layer_groups(self.layer_idx, self.num_heads)
            group_kv = self._group_kv(groups)
            own = self._own_keys(group_kv, take(k_rot), take(v_tilde), take(k_pos))
            out = self._attention(groups, group_kv, take(q), own, take(q_pos), fresh)
            if y is None:
                return out
            y.index_copy_(0, self._index_tensor(rows, q.device), out.to(y.dtype))
        return y

    def _take_rows(self, x: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
        """x[rows] along the batch: a view for consecutive rows, a gather otherwise."""
        if rows == tuple(range(rows[0], rows[0] + len(rows))):
            return x.narrow(0, rows[0], len(rows))
        return x.index_select(0, self._index_tensor(rows, x.device))
