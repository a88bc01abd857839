"""Whole-model decode throughput: a 1.3B-shaped RAT(L=16) model vs the same model with attention.

Shape (RAT paper, 1.3B): 24 layers, hidden 2048, 16 heads x 128, SwiGLU 5632, vocab 32000,
random weights, bf16. The workload is "generate 1024 tokens after a 3072-token prompt" at the
largest batch whose 4096-token cache fits on the device next to the weights (the papers' maximum
throughput). Decode cost grows linearly with the position, so the mean over the 1024 steps equals
the cost of a step at the midpoint, position 3584: each variant fills its cache to 3584 tokens
(random contents: the cost does not depend on them) and times greedy decode steps there
(RatForCausalLM forward with logits for the new token, then argmax). Throughput = batch / step time.
Prefill of the prompt is not included.

Caches: RAT uses the package's RatCache as generate() builds it. The attention model gets
preallocated K/V (one slot written per step) instead of transformers' DynamicLayer, whose
torch.cat per step would copy the whole cache and flatter the ratio.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .cases import BenchConfig, Case
from .layers import graphed, random_rat_layer_cache

PROMPT, GENERATE = 3072, 1024
MIDPOINT = PROMPT + GENERATE // 2
RESERVE_BYTES = 6 * 2**30  # activations, logits, allocator slack


class StaticKVLayer(CacheLayerMixin):
    """K/V [batch, heads, length + 1, head_dim] filled to ``length``; update() writes slot ``length``
    and returns the filled prefix, so every timed step decodes at the same position."""

    is_sliding = False
    is_compileable = False

    def __init__(self, batch, heads, length, head_dim, device, dtype):
        super().__init__()
        self.keys = torch.randn(batch, heads, length + 1, head_dim, device=device, dtype=dtype)
        self.values = torch.randn_like(self.keys)
        self.length, self.is_initialized = length, True

    def lazy_initialization(self, key_states, value_states):  # already allocated
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys[:, :, self.length : self.length + 1] = key_states
        self.values[:, :, self.length : self.length + 1] = value_states
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.length + 1


def _model_config(layer_type: str, quick: bool):
    from ..models.rat import RatConfig

    if quick:
        shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
    else:
        shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16)
    layers = shape["num_hidden_layers"]
    return RatConfig(**shape, chunk_size=16, layer_types=[layer_type] * layers, max_position_embeddings=PROMPT + GENERATE)


def _cache_bytes_per_row(config, layer_type: str, tokens: int, element_size: int) -> int:
    width = config.num_attention_heads * config.head_dim
    entries = tokens // config.chunk_size + 1 if layer_type == "rat" else tokens  # ends + recurrent state
    return config.num_hidden_layers * 2 * entries * width * element_size


def _fill_cache(model, config, layer_type: str, batch: int, position: int, device, dtype):
    from ..models.rat import RatCache

    cache = RatCache(config)
    heads, dim = config.num_attention_heads, config.head_dim
    for i in range(config.num_hidden_layers):
        if layer_type == "rat":
            cache.layers[i] = random_rat_layer_cache(batch, position, heads, dim, config.chunk_size, device, dtype)
        else:
            cache.layers[i] = StaticKVLayer(batch, heads, position, dim, device, dtype)
    return cache


def decode_throughput_builder(config: BenchConfig, layer_type: str, max_batch: int | None = None):
    def build():
        from ..models.rat import RatForCausalLM

        model_config = _model_config(layer_type, config.quick)
        with torch.device(config.device):
            model = RatForCausalLM(model_config)
        model = model.to(config.dtype).eval()
        if config.on_cuda:
            torch.cuda.empty_cache()  # the fp32 weights of the init are gone: size the batch on what is free
        position = 64 if config.quick else MIDPOINT
        per_row = _cache_bytes_per_row(model_config, layer_type, PROMPT + GENERATE, torch.finfo(config.dtype).bits // 8)
        if config.on_cuda:
            free, _ = torch.cuda.mem_get_info(config.device)
            batch = max(1, int((free - RESERVE_BYTES) // per_row))
        else:
            batch = 2
        if max_batch is not None:
            batch = min(batch, max_batch)
        cache = _fill_cache(model, model_config, layer_type, batch, position, config.device, config.dtype)
        tokens = torch.randint(0, model_config.vocab_size, (batch, 1), device=config.device)

        def step():
            with torch.inference_mode():
                logits = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                logits.argmax(-1)

        info = {"tokens": batch, "batch": batch, "position": position,
                "cache_gb_per_row_at_4096": round(per_row / 2**30, 4)}
        return step, info
    return build


def graphed_throughput(builder):
    """The decode step captured once in a CUDA graph (both caches write fixed slots of fixed
    buffers); the timed call replays it: the per-step cost of a graph-captured decode loop."""
    def build():
        step, info = builder()
        replay = graphed(lambda: step)()
        return replay, dict(info, cuda_graph=True)
    return build


def cases(config: BenchConfig) -> list[Case]:
    shape = {"layers": 2, "hidden": 64} if config.quick else {"layers": 24, "hidden": 2048}
    graph_cases = [Case(
        "model", "1.3B decode throughput (1024 after 3072), CUDA graph", shape,
        {
            "attention_model": graphed_throughput(decode_throughput_builder(config, "full_attention")),
            "rat_model": graphed_throughput(decode_throughput_builder(config, "rat")),
        },
        unit="tokens/s", x_key="layers",
        notes="as the eager case, each model's step captured once in a CUDA graph and replayed",
    )] if config.on_cuda else []
    return [Case(
        "model", "1.3B decode throughput (1024 after 3072)", shape,
        {
            "attention_model": decode_throughput_builder(config, "full_attention"),
            "rat_model": decode_throughput_builder(config, "rat"),
        },
        unit="tokens/s", x_key="layers",
        notes="batch = largest that fits a 4096-token cache; steps timed at position 3584 (the midpoint)",
    )] + graph_cases
