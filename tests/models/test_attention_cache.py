"""The softmax-attention cache layers' static decode buffers (hf_hybrid/models/attention_cache.py):
the sliding window's ring and the full layer's preallocated K/V hold what transformers' own layers
hold, and hand it back exactly (token order) to any other operation."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.layers import attention as attention_module
from hf_hybrid.layers.attention import static_decode_attention
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
        assert min(int(ring.static_decode_length()), window) == int(visible.sum())  # what a decode kernel reads
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
        assert int(visible.sum()) == 5 + step == int(layer.static_decode_length()) and keys.shape[2] == 16
    k, v = tokens(2, 9)
    out_k, out_v = layer.update(k, v)  # a multi-token update leaves the buffers
    torch.testing.assert_close(out_k, torch.cat(held_k + [k], dim=2))
    torch.testing.assert_close(out_v, torch.cat(held_v + [v], dim=2))
    assert not layer.static_decode_active


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layer_kind", ["ring", "full"])
def test_static_decode_attention_kernel_matches_sdpa_over_the_buffers(monkeypatch, layer_kind):
    """The static step's attention on CUDA (kernels/window_attention's split-K kernel over the
    filled count) and elsewhere (SDPA with the visible mask) agree over a ring that wraps and over
    preallocated K/V; the kernel runs here in Triton's interpreter."""
    g = torch.Generator().manual_seed(0)
    layer = SlidingWindowCacheLayer(6) if layer_kind == "ring" else FullAttentionCacheLayer()
    layer.update(torch.randn(2, 2, 4, 16, generator=g), torch.randn(2, 2, 4, 16, generator=g))
    assert layer.prepare_static_decode(24, None)
    for step in range(5):  # the ring wraps on the third step
        q = torch.randn(2, 1, 4, 16, generator=g)  # 4 query heads over 2 key heads
        keys, values, visible = layer.static_decode_update(torch.randn(2, 2, 1, 16, generator=g),
                                                           torch.randn(2, 2, 1, 16, generator=g))
        length = layer.static_decode_length()
        monkeypatch.setattr(attention_module, "window_attention_decode_applies", lambda query: False)
        want = static_decode_attention(q, keys, values, visible, length, 0.3)
        monkeypatch.setattr(attention_module, "window_attention_decode_applies", lambda query: True)
        got = static_decode_attention(q, keys, values, visible, length, 0.3)
        assert got.shape == (2, 1, 64)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
