"""RAT token mixer (RAT paper Sec. 2.3, Eq. 3; Appendix A Listings 1-2).

For input x (after the block's pre-norm):

    q, k    = W_q x, W_k x                      one q/k per group of heads (num_qk_groups; head h
                                                uses group h % num_qk_groups), then broadcast to heads
    v       = W_v x                             per head
    g       = sigmoid(W_g x + gate_bias)        forget gate, per dimension, float32
    z       = sigmoid(W_z x)                    output gate, per dimension
    k~, v~  = gated recurrence of k, v with g   h_t = g_t h_{t-1} + (1 - g_t) x_t, restarting at
                                                every chunk of L = chunk_size positions
    q, k~   rotated by their chunk index        inter-chunk RoPE (position // L), unless NoPE
    y_t     = softmax over {k~ at the end of every earlier chunk} + {own k~_t}, applied to v~
    out     = W_o (z * y)

L = 1 gives attention-like behaviour (every token is its own chunk), L >= T a gated RNN.
Facts from the official code (notes/official_code_facts.md): q/k sharing in 2 groups by default,
gate_bias = log(u), u ~ U(1, L - 1) (zero for L <= 2), softmax scale head_dim^-0.5.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels._backend import resolve_backend
from ..kernels.chunk_attention import block_end_attention, chunk_end_attention, chunk_ends
from ..kernels.chunk_attention.rat_decode import rat_decode_inputs_reference, rat_decode_supported
from ..kernels.fused_norm import rotary as rotate
from ..kernels.gated_recurrence import gated_recurrence, rat_keys_values
from ..kernels._common import expand_groups
from ..kernels.output_gate import sigmoid_gate
from .context import SequenceContext
from .projections import project_shared_input, shared_input_applies
from .recompute import RecomputedActivations, recompute_applies
from .rotary import build_rotary, rotary_tables

# The gate logits and z are rebuilt in the backward (_rebuilt_gates) only from this many tokens per
# forward (batch x length): the rebuild saves 8 KB per token and layer for two more GEMMs per layer.
# That pays at 32K (GBs off the step's peak) but not at 8K, where the GEMMs cost more than the memory
# is worth (`hf-hybrid bench --suites models --only train --variants RAT`).
GATE_REBUILD_MIN_TOKENS = 16384


def scatter_chunk_ends(x: torch.Tensor, chunk_index: torch.Tensor, closes_chunk: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Slot-indexed chunk ends: out[b, c] = x[b, t] for the token t that closes chunk c in row b.

    x [batch, seq, heads, head_dim]; chunk_index / closes_chunk [batch, seq]. Slots of chunks that
    no token in this segment closes stay zero (they are never visible, see chunk_end_attention).
    """
    # Tokens that close no chunk write to a spare slot num_chunks, dropped at the end: a scatter of
    # fixed shape (no nonzero(), so torch.compile traces it without a graph break).
    slot = torch.where(closes_chunk, chunk_index, num_chunks)
    index = slot.view(*slot.shape, *(1,) * (x.dim() - 2)).expand_as(x)
    out = x.new_zeros(x.shape[0], num_chunks + 1, *x.shape[2:]).scatter(1, index, x)
    return out[:, :num_chunks]


class _RebuiltPair:
    """Both outputs of one kernel run for two rebuilt activations (k_rot and v~): the kernel runs
    once for whichever is asked for first, and its outputs are let go once both are taken."""

    def __init__(self, rebuild):
        self.rebuild, self.outputs = rebuild, None

    def take(self, index: int) -> torch.Tensor:
        if self.outputs is None:
            self.outputs = list(self.rebuild())
        out, self.outputs[index] = self.outputs[index], None
        if all(o is None for o in self.outputs):
            self.outputs = None
        return out


class RatAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        chunk_size: int,
        num_qk_groups: int = 2,
        rope_theta: float | None = 10000.0,
        backend: str = "auto",
        fused_gates: bool = True,
    ):
        super().__init__()
        if num_heads % num_qk_groups:
            raise ValueError(f"num_qk_groups ({num_qk_groups}) must divide num_attention_heads ({num_heads}).")
        self.num_heads, self.head_dim, self.chunk_size = num_heads, head_dim, chunk_size
        self.num_qk_groups, self.backend = num_qk_groups, backend
        # Whole sequences (training, cache-less prefill) through one kernel for the gate, both
        # recurrences and the RoPE of k~ (kernels/gated_recurrence/rat_keys_values.py): faster than op
        # by op (`hf-hybrid bench --suites layers`, rows rat_layer against rat_layer_unfused).
        self.fused_gates = fused_gates
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, num_qk_groups * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_qk_groups * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.g_proj = nn.Linear(hidden_size, inner, bias=False)
        self.z_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(inner))
        self.rotary = build_rotary(head_dim, rope_theta)

    @torch.no_grad()
    def reset_extra_parameters(self) -> None:
        """gate_bias = log(u), u ~ U(1, L - 1): forget gates start with a spread of time scales up to L."""
        if self.chunk_size > 2:
            self.gate_bias.uniform_(1.0, float(self.chunk_size - 1)).log_()
        else:
            self.gate_bias.zero_()

    def _expand_groups(self, x: torch.Tensor) -> torch.Tensor:
        return expand_groups(x, self.num_heads)

    def _recurrences(self, k, v, gate_logits, start, positions, cache_layer):
        """k~, v~ (un-rotated) op by op: the float32 gate, then the chunk recurrences from the cache's state."""
        L = self.chunk_size
        k = self._expand_groups(k)
        gate = torch.sigmoid(gate_logits.float() + self.gate_bias.float().view(self.num_heads, self.head_dim))
        state_k, state_v = cache_layer.recurrent_state() if cache_layer is not None else (None, None)
        if start is not None:
            return (gated_recurrence(k, gate, L, start, state_k, backend=self.backend),
                    gated_recurrence(v, gate, L, start, state_v, backend=self.backend))
        # Rows start at different positions (left padding): restart each row where its own
        # position opens a chunk. A restart means h_t = (1 - g_t) x_t, which the plain recurrence
        # computes when the gate there is 0 and the input is (1 - g_t) x_t.
        restart = (positions % L == 0)[:, :, None, None]
        gate_rows = gate.masked_fill(restart, 0.0)
        k_in, v_in = torch.where(restart, (1 - gate) * k, k), torch.where(restart, (1 - gate) * v, v)
        return (gated_recurrence(k_in, gate_rows, 0, 0, state_k, backend=self.backend).to(k.dtype),
                gated_recurrence(v_in, gate_rows, 0, 0, state_v, backend=self.backend).to(v.dtype))

    def _output(self, gate_z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """W_o (sigmoid(gate_z) * y), the gate and product in one pass (kernels/output_gate)."""
        return self.o_proj(sigmoid_gate(gate_z, y.reshape(gate_z.shape), backend=self.backend))

    def _chunk_rotary(self, context: SequenceContext, chunk_index: torch.Tensor):
        """cos/sin of the chunk indices (None for NoPE), built once per forward for every RAT
        layer of the stack with this chunk size (they all rotate by the same chunk indices)."""
        return rotary_tables(self.rotary, context, chunk_index, tag=("chunk", self.chunk_size))

    def _fused_decode(self, v: torch.Tensor) -> bool:
        """One kernel for the whole decode step: decoding without gradients (it writes the cache in
        place), on the Triton backend, at a head_dim it takes."""
        return (not torch.is_grad_enabled() and rat_decode_supported(v)
                and resolve_backend(self.backend, v.device, "rat_decode_step") == "triton")

    def _decode_step(self, q, k, v, gate_logits, gate_z, positions, chunk_index, cos_sin, cache_layer):
        """One new token per row, no padding. Fixed shapes on the cache's buffers, and the chunk
        restart and slot come from the positions on the device, not from host values, so the
        step can be captured in a CUDA graph and replayed at every position."""
        batch, L = q.shape[0], self.chunk_size
        position = positions.reshape(-1)[:1]
        if self._fused_decode(v):
            from ..kernels.chunk_attention import rat_decode_step  # a torch.library op: one node under torch.compile

            key_buffer, value_buffer, state_k, state_v = cache_layer.fused_decode_buffers(L)
            # The output gate rides on the kernel's last pass (no launch of its own).
            y = rat_decode_step(
                q, k, v, gate_logits, self.gate_bias, state_k, state_v, position, L, cos_sin, key_buffer, value_buffer,
                output_gate=gate_z.view(v.shape),
            )
            return self.o_proj(y.reshape(gate_z.shape))
        state_k, state_v = cache_layer.recurrent_state()
        q_rot, k_rot, v_new, k_tilde, v_tilde = rat_decode_inputs_reference(
            q, k, v, gate_logits, self.gate_bias, state_k, state_v, position, L, cos_sin
        )
        k_ends, v_ends = cache_layer.decode_step(k_rot, v_new, chunk_index.view(-1)[:1], k_tilde, v_tilde, L)
        y = chunk_end_attention(
            q_rot, k_rot, v_new, k_ends, v_ends, query_chunk=chunk_index.expand(batch, 1), backend=self.backend
        )
        return self._output(gate_z, y)

    def _keys_values(self, k, v, gate_logits, cos_sin):
        """(RoPE(k~), v~) of a whole sequence through the fused kernel (rat_keys_values)."""
        return rat_keys_values(k, v, gate_logits, self.gate_bias, self.chunk_size, cos_sin, backend=self.backend)

    def _rebuilt_gates(self, recompute, x, gate_logits, gate_z):
        """With ``x`` (the projections' shared input, kept by them anyway): the gate logits and z
        are rebuilt in the backward by running g_proj / z_proj on x again (8 KB per token less at
        the 1.3B shape, for two more GEMMs per layer), instead of being kept by the kernels that
        read them. Returns a function giving the gate logits to the k~ / v~ rebuild and what it
        reads (the tensors whose in-place change the backward refuses)."""
        if x is not None:
            shape, logits_weight, z_weight = gate_logits.shape, self.g_proj.weight, self.z_proj.weight
            logits_source = recompute.register(gate_logits, lambda: F.linear(x, logits_weight).view(shape), x, logits_weight)
            recompute.register(gate_z, lambda: F.linear(x, z_weight), x, z_weight)
            if logits_source is not None:
                # Not recompute.value: a closure over `recompute` would make a reference cycle
                # (recompute -> its sources -> their rebuilds -> this closure) that keeps k, v, q and
                # x alive after the backward until the garbage collector runs (4.6 GB at T=32K).
                return (lambda: RecomputedActivations.value(logits_source)), (x, logits_weight)
        return (lambda: gate_logits), (gate_logits,)

    def _train_fused(self, q, k, v, gate_logits, gate_z, cos_sin, store=None, x=None):
        """The fused path of a training forward, keeping less for the backward: k_rot and v~
        (saved by the attention and by their own kernel) and the rotated q are rebuilt in the
        backward from k, v, the gate logits and q, which those kernels keep anyway (8.5 KB per
        token less at the 1.3B shape, for one more pass of each kernel; layers/recompute.py),
        and with ``x`` the gate logits and z too (_rebuilt_gates).
        ``store``: (cache_layer, positions, chunk_index, context) of an empty cache to fill (the
        cache copies the chunk ends into its own buffers, so nothing there holds k_rot or v~)."""
        batch, seq, heads, dim = v.shape
        recompute = RecomputedActivations()
        with recompute.active():
            logits, logits_inputs = self._rebuilt_gates(recompute, x, gate_logits, gate_z)
            k_rot, v_tilde = self._keys_values(k, v, gate_logits, cos_sin)
            if store is not None:
                cache_layer, positions, chunk_index, context = store
                self._store_prefill(cache_layer, k, v, gate_logits, k_rot, v_tilde, None, positions, chunk_index, context)
            q_rot = rotate(q, cos_sin, backend=self.backend)
            # The closures read the gate logits through `logits` only: a reference would keep them.
            pair = _RebuiltPair(lambda: self._keys_values(k, v, logits(), cos_sin))
            inputs = (k, v, self.gate_bias, *logits_inputs)
            recompute.register(k_rot, lambda: pair.take(0), *inputs)
            recompute.register(v_tilde, lambda: pair.take(1), *inputs)
            recompute.register(q_rot, lambda: rotate(q, cos_sin, backend=self.backend), q)
            y = block_end_attention(
                q_rot, k_rot, v_tilde, self.chunk_size, backend=self.backend, output_gate=gate_z.view(v_tilde.shape)
            )
        return self.o_proj(y.reshape(batch, seq, heads * dim))

    def _closes_chunk(self, positions: torch.Tensor, context: SequenceContext) -> torch.Tensor:
        """Which (real) tokens end their chunk: the ones whose k~, v~ a cache keeps."""
        closes_chunk = (positions + 1) % self.chunk_size == 0
        return closes_chunk if context.query_valid is None else closes_chunk & context.query_valid

    @staticmethod
    def _fills_empty_cache(cache_layer) -> bool:
        return cache_layer.get_seq_length() == 0 and not getattr(cache_layer, "record_past", False)

    def _store_prefill(self, cache_layer, k, v, gate_logits, k_rot, v_tilde, k_tilde, positions, chunk_index, context) -> None:
        """Chunk ends of a prefill from position 0 and the un-rotated state after its last token. The
        fused kernel returns rotated keys only: the state comes from the recurrence over the last
        (open) chunk alone, which restarts at its first token, so it is the op-by-op value exactly."""
        batch, seq, L = v_tilde.shape[0], v_tilde.shape[1], self.chunk_size
        if k_tilde is None:
            tail = (seq - 1) // L * L  # first position of the last chunk
            k_last, v_last = self._recurrences(
                k[:, tail:], v[:, tail:], gate_logits[:, tail:], tail, positions[:, tail:], None
            )
            k_tilde, v_tilde_last = k_last, v_last
        else:
            v_tilde_last = v_tilde
        cache_layer.update(
            k_rot, v_tilde, chunk_index.expand(batch, seq), self._closes_chunk(positions, context).expand(batch, seq),
            k_tilde[:, -1], v_tilde_last[:, -1], start_position=0, chunk_size=L,
        )

    def forward(self, hidden_states: torch.Tensor, context: SequenceContext, cache_layer=None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        heads, dim, L, groups = self.num_heads, self.head_dim, self.chunk_size, self.num_qk_groups
        projections = (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.z_proj)
        plain_projections = shared_input_applies(hidden_states, projections)
        # gate_z: the output gate, sigmoid(gate_z), is applied in _output
        q, k, v, gate_logits, gate_z = project_shared_input(hidden_states, projections)
        q, k = q.view(batch, seq, groups, dim), k.view(batch, seq, groups, dim)
        v, gate_logits = v.view(batch, seq, heads, dim), gate_logits.view(batch, seq, heads, dim)

        start = context.uniform_start
        # Unpadded rows share their positions: compute per-position tables once, not per row.
        positions = context.positions[:1] if start is not None else context.positions
        # Once per forward for every RAT layer with this chunk size (a decode step's kernel per layer otherwise).
        chunk_index = context.shared_table(("chunk_index", L, start is not None, tuple(positions.shape)),
                                           lambda: torch.div(positions, L, rounding_mode="floor"))
        cos_sin = self._chunk_rotary(context, chunk_index)
        if cache_layer is not None and seq == 1 and start is not None and cache_layer.get_seq_length() > 0:
            return self._decode_step(q, k, v, gate_logits, gate_z, positions, chunk_index, cos_sin, cache_layer)
        # A whole sequence from position 0 (training, a cache-less forward, or a prefill into an empty
        # cache that records nothing for crops) runs the fused kernels below; a cache then stores the
        # segment's chunk ends and the recurrent state after its last token.
        kernel = hidden_states.is_cuda or self.backend == "triton"
        whole = start == 0 and (cache_layer is None or (kernel and self._fills_empty_cache(cache_layer)))
        if self.fused_gates and whole and kernel and recompute_applies():
            store = None if cache_layer is None else (cache_layer, positions, chunk_index, context)
            rebuild = plain_projections and batch * seq >= GATE_REBUILD_MIN_TOKENS
            x = hidden_states if rebuild else None  # gates rebuilt as F.linear(x, W)
            return self._train_fused(q, k, v, gate_logits, gate_z, cos_sin, store, x)
        if self.fused_gates and whole:
            k_rot, v_tilde = self._keys_values(k, v, gate_logits, cos_sin)
            k_tilde = None  # only a cache needs the un-rotated states
        else:
            k_tilde, v_tilde = self._recurrences(k, v, gate_logits, start, positions, cache_layer)
            k_rot = rotate(k_tilde, cos_sin, backend=self.backend)
        q = rotate(q, cos_sin, backend=self.backend)  # per group of heads; expanded where a path needs it

        if whole and kernel:
            if cache_layer is not None:
                self._store_prefill(cache_layer, k, v, gate_logits, k_rot, v_tilde, k_tilde, positions, chunk_index, context)
            # The fused kernels read the chunk ends and the shared q heads in place and apply the
            # output gate (forward epilogue, row-wise backward).
            y = block_end_attention(q, k_rot, v_tilde, L, backend=self.backend, output_gate=gate_z.view(v_tilde.shape))
            return self.o_proj(y.reshape(batch, seq, heads * dim))
        q = self._expand_groups(q)

        closes_chunk = self._closes_chunk(positions, context)
        if cache_layer is not None:
            cache_layer.record_token_states(k_tilde, v_tilde)  # kept only while a crop may need them
            k_ends, v_ends = cache_layer.update(
                k_rot, v_tilde, chunk_index.expand(batch, seq), closes_chunk.expand(batch, seq),
                k_tilde[:, -1], v_tilde[:, -1], start_position=start, chunk_size=L,
            )
        elif start == 0:
            k_ends, v_ends = chunk_ends(k_rot, L), chunk_ends(v_tilde, L)
        else:
            # Under torch.compile a static bound (positions < seq without a cache) instead of a
            # host sync: the extra slots hold no chunk end and no query sees them.
            num_chunks = seq // L if torch.compiler.is_compiling() else int((positions[:, -1].max() + 1) // L)
            k_ends = scatter_chunk_ends(k_rot, chunk_index, closes_chunk, num_chunks)
            v_ends = scatter_chunk_ends(v_tilde, chunk_index, closes_chunk, num_chunks)

        y = chunk_end_attention(q, k_rot, v_tilde, k_ends, v_ends, query_chunk=chunk_index.expand(batch, seq), backend=self.backend)
        return self._output(gate_z, y)
