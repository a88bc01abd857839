"""Operator benchmarks of RAT and RAT+ against SDPA attention (16 heads x 128 = 2048 wide, bf16).

Cases (baseline first):

* RAT(L=16) attention, fwd+bwd and forward only: causal SDPA vs the Triton chunk-end kernel
  (block_end_attention with block_size 16: chunk ends + own key merged in-kernel), and the paper's
  flex_attention formulation (ends via flex + log-sum-exp merge of the own key) with ``--flex``.
* Gated recurrence (RAT chunked L=16, RAT+ full sequence), fwd+bwd: the log-depth torch scan vs Triton.
* RAT+ operator prefill: dense causal SDPA (the paper's D-dagger = 1) vs recurrence on k and v +
  dilated attention at D = 16, D = 64 and D = 16 with a 256-token window and 4 sinks.
* Decode (one new token per row over a filled cache): SDPA over the full K/V cache vs the
  recurrence step + the chunk-end decode kernel over the compact cache (T / D ends + own key);
  RAT(L=16) at position 4K, batch 512 and RAT+ D=16 at 16K, batch 256.

Operator level means no projections, no RoPE, no cache writes (those are in layers.py).
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ..kernels.chunk_attention import block_end_attention, chunk_end_attention
from ..kernels.gated_recurrence import gated_recurrence
from .cases import BenchConfig, Case

HEADS, HEAD_DIM = 16, 128
TRAIN_TOKENS = 65536  # tokens per fwd+bwd step (batch = tokens // seq, at least 1)
PREFILL_TOKENS = 131072
RAT_CHUNK = 16


def _shape(config: BenchConfig) -> tuple[int, int]:
    return (2, 32) if config.quick and not config.on_cuda else (HEADS, HEAD_DIM)


def _seqs(config: BenchConfig, default: tuple[int, ...], quick: tuple[int, ...] = (256,)) -> tuple[int, ...]:
    if config.seqs:
        return config.seqs
    return quick if config.quick else default


def _randn(config: BenchConfig, *shape, requires_grad=False) -> torch.Tensor:
    return torch.randn(*shape, device=config.device, dtype=config.dtype, requires_grad=requires_grad)


def _fwd_bwd(fn, inputs):
    """A callable running fn(*inputs) forward and backward (autograd.grad: nothing accumulates)."""
    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    return run


def _forward(fn, inputs):
    def run():
        with torch.inference_mode():
            fn(*inputs)
    return run


# ---------------------------------------------------------------------------------------- builders


def sdpa_causal_builder(config: BenchConfig, batch: int, seq: int, backward: bool):
    heads, dim = _shape(config)

    def build():
        q, k, v = (_randn(config, batch, heads, seq, dim, requires_grad=backward) for _ in range(3))
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        return _fwd_bwd(fn, (q, k, v)) if backward else _forward(fn, (q, k, v))
    return build


def rat_attention_builder(config: BenchConfig, batch: int, seq: int, backward: bool, chunk: int = RAT_CHUNK):
    heads, dim = _shape(config)

    def build():
        q, k, v = (_randn(config, batch, seq, heads, dim, requires_grad=backward) for _ in range(3))
        fn = lambda q, k, v: block_end_attention(q, k, v, chunk)  # noqa: E731
        return _fwd_bwd(fn, (q, k, v)) if backward else _forward(fn, (q, k, v))
    return build


def flex_rat_builder(config: BenchConfig, batch: int, seq: int, backward: bool, chunk: int = RAT_CHUNK):
    """The RAT paper's own formulation (its Listing 1): flex_attention over the chunk ends with a
    chunk-causal block mask, returning the log-sum-exp, then an elementwise merge of the own key."""
    heads, dim = _shape(config)

    def build():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        num_chunks = seq // chunk
        mask = create_block_mask(lambda b, h, qi, kv: qi // chunk > kv, None, None, seq, num_chunks, device=config.device)
        scale = dim**-0.5

        def fn(q, k, v):
            ends_k, ends_v = k[:, :, chunk - 1 :: chunk], v[:, :, chunk - 1 :: chunk]
            out, lse = flex(q, ends_k, ends_v, block_mask=mask, scale=scale, return_lse=True)
            own = (q.float() * k.float()).sum(-1) * scale
            top = torch.maximum(lse, own)
            w_ends, w_own = torch.exp(lse - top), torch.exp(own - top)
            merged = (out.float() * w_ends[..., None] + v.float() * w_own[..., None]) / (w_ends + w_own)[..., None]
            return merged.to(q.dtype)

        q, k, v = (_randn(config, batch, heads, seq, dim, requires_grad=backward) for _ in range(3))
        return _fwd_bwd(fn, (q, k, v)) if backward else _forward(fn, (q, k, v))
    return build


def recurrence_builder(config: BenchConfig, batch: int, seq: int, chunk: int, backend: str):
    heads, dim = _shape(config)

    def build():
        x = _randn(config, batch, seq, heads, dim, requires_grad=True)
        g = torch.rand(batch, seq, heads, dim, device=config.device, dtype=torch.float32).requires_grad_()
        return _fwd_bwd(lambda x, g: gated_recurrence(x, g, chunk, backend=backend), (x, g))
    return build


def rat_plus_operator_builder(config: BenchConfig, batch: int, seq: int, dilation: int, window: int, sinks: int):
    """Full-sequence recurrence on k and v (gate per dimension, fp32), then dilated attention."""
    heads, dim = _shape(config)

    def build():
        q, k, v = (_randn(config, batch, seq, heads, dim) for _ in range(3))
        g = torch.rand(batch, seq, heads, dim, device=config.device, dtype=torch.float32)

        def fn(q, k, v, g):
            k_t, v_t = gated_recurrence(k, g), gated_recurrence(v, g)
            return block_end_attention(q, k_t, v_t, dilation, window, sinks)
        return _forward(fn, (q, k, v, g))
    return build


def sdpa_decode_builder(config: BenchConfig, batch: int, position: int):
    heads, dim = _shape(config)

    def build():
        q = _randn(config, batch, heads, 1, dim)
        k_cache, v_cache = (_randn(config, batch, heads, position + 1, dim) for _ in range(2))
        return _forward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (q, k_cache, v_cache))
    return build


def chunk_end_decode_builder(config: BenchConfig, batch: int, position: int, block: int):
    """One step: recurrence update of the open block's k~, v~, then attention over the ends + own key."""
    heads, dim = _shape(config)

    def build():
        q, k, v = (_randn(config, batch, 1, heads, dim) for _ in range(3))
        g = torch.rand(batch, 1, heads, dim, device=config.device, dtype=torch.float32)
        state_k, state_v = (_randn(config, batch, 1, heads, dim) for _ in range(2))
        num_ends = position // block
        ends_k, ends_v = (_randn(config, batch, num_ends, heads, dim) for _ in range(2))
        query_chunk = torch.full((batch, 1), num_ends, device=config.device, dtype=torch.int32)

        def fn(q, k, v, g):
            k_t = (g * state_k + (1 - g) * k).to(k.dtype)
            v_t = (g * state_v + (1 - g) * v).to(v.dtype)
            return chunk_end_attention(q, k_t, v_t, ends_k, ends_v, query_chunk=query_chunk)
        return _forward(fn, (q, k, v, g))
    return build


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------- cases


def cases(config: BenchConfig) -> list[Case]:
    out: list[Case] = []
    use_flex = config.flex and config.on_cuda and _flex_available()
    for backward, label, seqs, tokens in (
        (True, "fwd+bwd", _seqs(config, (4096, 16384, 32768, 131072)), TRAIN_TOKENS),
        (False, "prefill", _seqs(config, (4096, 32768, 131072, 262144)), PREFILL_TOKENS),
    ):
        for seq in seqs:
            batch = max(1, (tokens if not config.quick else seq) // seq)
            variants = {
                "sdpa": sdpa_causal_builder(config, batch, seq, backward),
                "rat_triton": rat_attention_builder(config, batch, seq, backward),
            }
            if use_flex and seq <= 32768:
                variants["rat_flex"] = flex_rat_builder(config, batch, seq, backward)
            out.append(Case("op", f"RAT(L=16) attention {label}", {"seq": seq, "batch": batch}, variants))
    for seq in _seqs(config, (32768,)):
        batch = max(1, TRAIN_TOKENS // seq) if not config.quick else 1
        for chunk, label in ((RAT_CHUNK, "RAT L=16"), (0, "RAT+ full")):
            out.append(Case("op", f"gated recurrence {label} fwd+bwd", {"seq": seq, "batch": batch}, {
                "torch_scan": recurrence_builder(config, batch, seq, chunk, "scan"),
                "triton": recurrence_builder(config, batch, seq, chunk, "auto"),
            }))
    for seq in _seqs(config, (32768, 131072)):
        batch = max(1, PREFILL_TOKENS // seq) if not config.quick else 1
        out.append(Case("op", "RAT+ operator prefill", {"seq": seq, "batch": batch}, {
            "sdpa_dense": sdpa_causal_builder(config, batch, seq, backward=False),
            "D=16": rat_plus_operator_builder(config, batch, seq, 16, 0, 0),
            "D=64": rat_plus_operator_builder(config, batch, seq, 64, 0, 0),
            "D=16,W=256,S=4": rat_plus_operator_builder(config, batch, seq, 16, 256, 4),
        }))
    decode = ((4096, 512, RAT_CHUNK, "RAT(L=16) decode step"), (16384, 256, 16, "RAT+ D=16 decode step"))
    for position, batch, block, name in decode:
        if config.quick:
            position, batch = 512, 4
        out.append(Case("op", name, {"position": position, "batch": batch}, {
            "sdpa": sdpa_decode_builder(config, batch, position),
            "chunk_end_triton": chunk_end_decode_builder(config, batch, position, block),
        }, x_key="position"))
    return out
