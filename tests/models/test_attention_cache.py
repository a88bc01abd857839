"""The softmax-attention cache layers' static decode buffers (hf_hybrid/models/attention_cache.py):
the sliding window's ring and the full layer's preallocated K/V hold what transformers' own layers
hold, and hand it back exactly (token order) to any other operation."""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_hybrid.models.attention_cache import FullAttentionCacheLayer, SlidingWindowCacheLayer


def tokens(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, count, 4, generator=g), torch.randn(3, 2, count, 4, generator=g)


def by_first_feature(x: torch.Tensor) -> torch.Tensor:
    """[batch, heads, tokens, dim] with the tokens sorted by their first feature."""
    order = x[..., 0].argsort(dim=-1)
    return x.gather(2, order[..., None].expand_as(x))


def test_ring_steps_then_eager_update_equal_transformers_sliding_layer():
    window, prompt = 5, 3  # the ring fills during the steps, then wraps
    ring, plain = SlidingWindowCacheLayer(window), DynamicSlidingWindowLayer(window)
    k, v = tokens(prompt, 0)
    ring.update(k, v)
    plain.update(k, v)
    assert ring.prepare_static_decode(32, None) and ring.static_decode_active
    for step in range(9):
        k, v = tokens(1, step + 1)
        keys, values, visible = ring.static_decode_update(k, v)
        full_k, full_v = plain.update(k, v)  # the token's window, oldest first
        assert int(visible.sum()) == full_k.shape[2] == min(prompt + step + 1, window)
        # the same keys and values (the ring holds them in slot order, attention does not mind)
        torch.testing.assert_close(by_first_feature(keys[:, :, visible[0, 0, 0]]), by_first_feature(full_k))
        torch.testing.assert_close(by_first_feature(values[:, :, visible[0, 0, 0]]), by_first_feature(full_v))
        assert ring.get_seq_length() == plain.get_seq_length()
    batch_order = torch.tensor([2, 0, 1])
    ring.reorder_cache(batch_order)  # leaves the ring for transformers' layout
    plain.reorder_cache(batch_order)
    assert not ring.static_decode_active
    torch.testing.assert_close(ring.keys, plain.keys)
    torch.testing.assert_close(ring.values, plain.values)
    k, v = tokens(2, 99)
    for a, b in zip(ring.update(k, v), plain.update(k, v)):
        torch.testing.assert_close(a, b)


def test_full_layer_static_columns_then_eager_update():
    layer = FullAttentionCacheLayer()
    k, v = tokens(4, 0)
    layer.update(k, v)
    assert layer.prepare_static_decode(16, None)
    held_k, held_v = [k], [v]
    for step in range(3):
        k, v = tokens(1, step + 1)
        keys, values, visible = layer.static_decode_update(k, v)
        held_k.append(k)
        held_v.append(v)
        assert int(visible.sum()) == 5 + step and keys.shape[2] == 16
    k, v = tokens(2, 9)
    out_k, out_v = layer.update(k, v)  # a multi-token update leaves the buffers
    torch.testing.assert_close(out_k, torch.cat(held_k + [k], dim=2))
    torch.testing.assert_close(out_v, torch.cat(held_v + [v], dim=2))
    assert not layer.static_decode_active
