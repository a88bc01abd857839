"""RAT+'s dilated cache store: with unpadded rows at known positions (``first_position``) it keeps
exactly what the general scatter keeps, without reading the device (no nonzero() in a prefill)."""
import pytest
import torch

from hf_hybrid.models.rat_plus.cache_rat_plus import DilatedStore
from hf_hybrid.sparse import AttentionPattern


@pytest.mark.parametrize("dilation,window,sinks", [(4, 0, 0), (4, 3, 2), (5, 2, 7)])
@pytest.mark.parametrize("segments", [(13,), (6, 1, 1, 9), (3, 17)])
def test_aligned_store_equals_scattered(dilation, window, sinks, segments):
    pattern = AttentionPattern(dilation=dilation, local_window=window, num_sink_tokens=sinks)
    aligned, scattered = DilatedStore(pattern), DilatedStore(pattern)
    start = 0
    for i, seq in enumerate(segments):
        keys, values = torch.randn(2, seq, 3, 8), torch.randn(2, seq, 3, 8)
        positions = torch.arange(start, start + seq).expand(2, seq)
        need = i > 0  # the first segment: a prefill attending over its own keys (the store returns None)
        got = aligned.update(keys, values, positions, need_keys=need, first_position=start)
        want = scattered.update(keys, values, positions, need_keys=need)
        start += seq
        if not need:
            assert got is None and want is None
            continue
        for a, b in zip(got[:3], want[:3]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name in DilatedStore.tensor_names:
        torch.testing.assert_close(getattr(aligned, name), getattr(scattered, name), rtol=0, atol=0, msg=name)
