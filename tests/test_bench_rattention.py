"""The RATTENTION suite's key / value heads (hf_hybrid/bench/rattention.py, ``--kv-heads``): the layers,
the full layer's static K/V and the local layer's cache all take the count given."""
from __future__ import annotations

import torch

from hf_hybrid.bench import rattention as bench


def test_kv_heads_reach_the_layers_and_both_decode_caches():
    cpu = torch.device("cpu")
    layers = bench.build_layers(cpu, torch.float32, kv_heads=16)
    assert {name: layer.num_kv_heads for name, layer in layers.items()} == {"full": 16, "swa4096": 16, "local512": 16}
    assert layers["full"].k_proj.out_features == 16 * bench.HEAD_DIM

    static = bench.StaticKV(2, 10, cpu, torch.float32, layers["full"].num_kv_heads)
    assert static.keys.shape == (2, 16, 11, bench.HEAD_DIM)

    local = layers["local512"]
    cache = bench.local_cache(local, 2, 600, cpu, torch.float32)
    assert cache.get_seq_length() == 600
    assert cache.keys.shape[2] == 16 and cache.state.shape == local.state_shape(2)


def test_the_default_is_the_papers_four_key_value_heads():
    layers = bench.build_layers(torch.device("cpu"), torch.float32)
    assert all(layer.num_kv_heads == bench.KV_HEADS == 4 for layer in layers.values())
