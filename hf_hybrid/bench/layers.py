"""Layer benchmarks (projections included): RAT(L=16) and RAT+ token mixers vs an SDPA attention layer
of the same width (hidden 2048, 16 heads x 128, bf16).

* fwd+bwd: one training step of the mixer (input and every weight get gradients).
* prefill: forward only, no cache (the papers' "prefilling" tables).
* decode step: one new token per row at a fixed position over a filled cache. The SDPA layer keeps
  a preallocated K/V cache (write one slot, attend over the filled prefix, no mask: the strongest
  plain baseline); RAT uses the package's own RatLayerCache (chunk ends + recurrent state).

Extra RAT rows: ``rat_layer_unfused`` is the same layer with ``fused_gates=False`` (gate, both
recurrences and the RoPE of k~ op by op instead of in one kernel, the default);
``rat_layer_atomic_dq`` (fwd+bwd) runs the attention backward with ATOMIC_DQ (dQ from the dK/dV
kernel's atomics, kernels/chunk_attention/triton.py; off by default until it wins); ``rat_gemm_floor``
is its six projections alone (the bound on any layer ratio); ``rat_plus_dense_layer`` (fwd+bwd)
is RAT+'s dense training step (D = 1, the recurrence active). The decode step of ``rat_layer`` is
the one-kernel step (kernels/chunk_attention/rat_decode_triton.py).

The SDPA layer is written here (q/k/v/o projections, RoPE by position, causal SDPA) so that the
baseline is the fastest plain attention layer and does not depend on any model code.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..layers.context import SequenceContext
from ..layers.projections import project_shared_input
from ..layers.rotary import RotaryEmbedding, apply_rotary
from .cases import BenchConfig, Case

HIDDEN, HEADS, HEAD_DIM, CHUNK = 2048, 16, 128, 16
TRAIN_TOKENS = 65536
PREFILL_TOKENS = 131072


class SdpaAttentionLayer(nn.Module):
    """The baseline: q/k/v/o projections (no bias), RoPE by token position, SDPA (flash) attention."""

    def __init__(self, hidden: int, heads: int, head_dim: int, rope_theta: float = 10000.0):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        shape = (batch, seq, self.heads, self.head_dim)
        cos_sin = self.rotary(positions)
        q = apply_rotary(self.q_proj(x).view(shape), cos_sin).transpose(1, 2)
        k = apply_rotary(self.k_proj(x).view(shape), cos_sin).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if kv_cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decode: one query per row sees the whole filled prefix
            k, v = kv_cache.write(k, v)
            out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class StaticKV:
    """Preallocated [batch, heads, length + 1, head_dim] K/V filled up to ``length``; every decode
    call writes slot ``length`` and returns the filled prefix (the position stays fixed across calls)."""

    def __init__(self, batch, heads, length, head_dim, device, dtype):
        self.keys = torch.randn(batch, heads, length + 1, head_dim, device=device, dtype=dtype)
        self.values = torch.randn_like(self.keys)
        self.length = length

    def write(self, k, v):
        self.keys[:, :, self.length : self.length + 1] = k
        self.values[:, :, self.length : self.length + 1] = v
        return self.keys, self.values


def _rat_layer(config: BenchConfig, fused_gates: bool = True):
    from ..layers.rat_attention import RatAttention

    layer = RatAttention(HIDDEN, HEADS, HEAD_DIM, CHUNK, num_qk_groups=2, rope_theta=10000.0, fused_gates=fused_gates)
    layer.reset_extra_parameters()
    return layer.to(config.device, config.dtype)


def _rat_plus_layer(config: BenchConfig):
    from ..layers.rat_plus_attention import RatPlusAttention

    return RatPlusAttention(HIDDEN, HEADS, HEADS, HEAD_DIM, layer_idx=0).to(config.device, config.dtype)


def _context(batch: int, seq: int, past: int, device) -> SequenceContext:
    return SequenceContext.build(batch, seq, past, None, None, device)


def _step(layer: nn.Module, call, x: torch.Tensor, backward: bool):
    params = [p for p in layer.parameters() if p.requires_grad]

    def run():
        if backward:
            out = call(x)
            torch.autograd.grad(out, [x] + params, torch.ones_like(out))
        else:
            with torch.inference_mode():
                call(x)
    return run


def sdpa_layer_builder(config: BenchConfig, batch: int, seq: int, backward: bool):
    def build():
        layer = SdpaAttentionLayer(HIDDEN, HEADS, HEAD_DIM).to(config.device, config.dtype)
        x = torch.randn(batch, seq, HIDDEN, device=config.device, dtype=config.dtype, requires_grad=backward)
        positions = torch.arange(seq, device=config.device).expand(batch, seq)
        return _step(layer, lambda x: layer(x, positions), x, backward)
    return build


def rat_layer_builder(config: BenchConfig, batch: int, seq: int, backward: bool, fused_gates: bool = True):
    def build():
        layer = _rat_layer(config, fused_gates)
        x = torch.randn(batch, seq, HIDDEN, device=config.device, dtype=config.dtype, requires_grad=backward)
        context = _context(batch, seq, 0, config.device)
        return _step(layer, lambda x: layer(x, context), x, backward)
    return build


def with_atomic_dq(builder):
    """The builder's step with the chunk attention's ATOMIC_DQ switched on for its duration."""
    def build():
        from ..kernels.chunk_attention import triton as attention

        step = builder()

        def run():
            previous, attention.ATOMIC_DQ = attention.ATOMIC_DQ, True
            try:
                step()
            finally:
                attention.ATOMIC_DQ = previous
        return run
    return build


def rat_gemm_floor_builder(config: BenchConfig, batch: int, seq: int, backward: bool):
    """The RAT layer's six projections alone (q, k, v, forget gate, output gate, o; no recurrence,
    no attention, no element-wise work): a lower bound on the RAT layer's time, so the best
    layer ratio any kernel work could reach is sdpa_layer / this."""
    def build():
        layer = _rat_layer(config)
        x = torch.randn(batch, seq, HIDDEN, device=config.device, dtype=config.dtype, requires_grad=backward)
        inputs = (layer.q_proj, layer.k_proj, layer.v_proj, layer.g_proj, layer.z_proj)
        params = [p for p in layer.parameters() if p.requires_grad and p.dim() == 2]

        def projections(x):  # the five input projections as the layer runs them (one summed dx)
            outs = list(project_shared_input(x, inputs))
            return outs + [layer.o_proj(outs[2])]

        def run():
            if backward:
                outs = projections(x)
                torch.autograd.grad(outs, [x] + params, [torch.ones_like(o) for o in outs])
            else:
                with torch.inference_mode():
                    projections(x)
        return run
    return build


def rat_plus_layer_builder(config: BenchConfig, batch: int, seq: int, dilation: int):
    def build():
        from ..sparse import SparseInferenceConfig

        layer = _rat_plus_layer(config)
        sparse = SparseInferenceConfig(dilation=dilation, local_window=0, num_sink_tokens=0)
        x = torch.randn(batch, seq, HIDDEN, device=config.device, dtype=config.dtype)
        context = _context(batch, seq, 0, config.device)
        return _step(layer, lambda x: layer(x, context, sparse_config=sparse), x, backward=False)
    return build


def rat_plus_train_builder(config: BenchConfig, batch: int, seq: int):
    """RAT+'s dense training step (D = 1, the recurrence active), to compare with the SDPA layer."""
    def build():
        layer = _rat_plus_layer(config)
        x = torch.randn(batch, seq, HIDDEN, device=config.device, dtype=config.dtype, requires_grad=True)
        context = _context(batch, seq, 0, config.device)
        return _step(layer, lambda x: layer(x, context), x, backward=True)
    return build


def sdpa_decode_builder(config: BenchConfig, batch: int, position: int):
    def build():
        layer = SdpaAttentionLayer(HIDDEN, HEADS, HEAD_DIM).to(config.device, config.dtype)
        cache = StaticKV(batch, HEADS, position, HEAD_DIM, config.device, config.dtype)
        x = torch.randn(batch, 1, HIDDEN, device=config.device, dtype=config.dtype)
        positions = torch.full((batch, 1), position, device=config.device)
        return _step(layer, lambda x: layer(x, positions, cache), x, backward=False)
    return build


def random_rat_layer_cache(batch: int, position: int, heads: int, head_dim: int, chunk: int, device, dtype):
    """A RatLayerCache as it stands after ``position`` tokens (random chunk ends and recurrent
    state; the cost of a step does not depend on them), with fixed buffers for a few more chunks
    so that a graph-captured step never reallocates."""
    from ..models.rat.cache_rat import RatLayerCache

    cache = RatLayerCache()
    probe = torch.empty(batch, 0, heads, head_dim, device=device, dtype=dtype)
    cache.lazy_initialization(probe, probe)
    cache.reserve(position + 4 * chunk, chunk)
    cache._key_buffer.normal_()
    cache._value_buffer.normal_()
    cache.num_slots = position // chunk
    cache._refresh_views()
    state = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    cache.state_key, cache.state_value = state, torch.randn_like(state)
    cache.cumulative_length = position
    return cache


def rat_decode_builder(config: BenchConfig, batch: int, position: int):
    """RAT layer decode with its RatLayerCache holding position // L chunk ends and a recurrent state."""
    def build():
        layer = _rat_layer(config)
        cache = random_rat_layer_cache(batch, position, HEADS, HEAD_DIM, CHUNK, config.device, config.dtype)
        x = torch.randn(batch, 1, HIDDEN, device=config.device, dtype=config.dtype)
        context = _context(batch, 1, position, config.device)
        return _step(layer, lambda x: layer(x, context, cache), x, backward=False)
    return build


def graphed(builder):
    """The builder's step captured once in a CUDA graph; the timed call replays it (the same
    kernels without the per-launch host cost, as a graph-captured decode loop runs them)."""
    def build():
        step = builder()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (autotuning, allocations) off the capture
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay
    return build


def cases(config: BenchConfig) -> list[Case]:
    quick = config.quick
    out: list[Case] = []
    train_seqs = config.seqs or ((256,) if quick else (4096, 32768, 131072))
    prefill_seqs = config.seqs or ((256,) if quick else (4096, 32768, 131072, 262144))
    for seq in train_seqs:
        batch = 1 if quick else max(1, TRAIN_TOKENS // seq)
        out.append(Case("layer", "RAT(L=16) layer fwd+bwd", {"seq": seq, "batch": batch}, {
            "sdpa_layer": sdpa_layer_builder(config, batch, seq, backward=True),
            "rat_layer": rat_layer_builder(config, batch, seq, backward=True),
            "rat_layer_unfused": rat_layer_builder(config, batch, seq, backward=True, fused_gates=False),
            "rat_layer_atomic_dq": with_atomic_dq(rat_layer_builder(config, batch, seq, backward=True)),
            "rat_gemm_floor": rat_gemm_floor_builder(config, batch, seq, backward=True),
            "rat_plus_dense_layer": rat_plus_train_builder(config, batch, seq),
        }))
    for seq in prefill_seqs:
        batch = 1 if quick else max(1, PREFILL_TOKENS // seq)
        variants = {
            "sdpa_layer": sdpa_layer_builder(config, batch, seq, backward=False),
            "rat_layer": rat_layer_builder(config, batch, seq, backward=False),
            "rat_layer_unfused": rat_layer_builder(config, batch, seq, backward=False, fused_gates=False),
            "rat_gemm_floor": rat_gemm_floor_builder(config, batch, seq, backward=False),
        }
        if seq >= 32768 or quick:
            variants["rat_plus_layer_D16"] = rat_plus_layer_builder(config, batch, seq, 16)
        out.append(Case("layer", "layer prefill", {"seq": seq, "batch": batch}, variants))
    position, batch = (512, 4) if quick else (4096, 512)
    out.append(Case("layer", "RAT(L=16) layer decode step", {"position": position, "batch": batch}, {
        "sdpa_layer": sdpa_decode_builder(config, batch, position),
        "rat_layer": rat_decode_builder(config, batch, position),
    }, x_key="position"))
    if config.on_cuda:
        out.append(Case("layer", "RAT(L=16) layer decode step, CUDA graph", {"position": position, "batch": batch}, {
            "sdpa_layer": graphed(sdpa_decode_builder(config, batch, position)),
            "rat_layer": graphed(rat_decode_builder(config, batch, position)),
        }, x_key="position"))
    return out
