"""SparseInferenceConfig: defaults, override precedence, JSON round trip, validation, and masks."""
import json

import pytest
import torch

from hf_hybrid.kernels.chunk_attention import block_end_mask
from hf_hybrid.kernels.topk_block_attention import dilated_mask
from hf_hybrid.sparse import AttentionPattern, SparseInferenceConfig


def brute_force_dilated_mask(num_queries, num_keys, dilation, window, sinks, query_start=0):
    """Built from the definition as a union of key sets: block ends, the window and the sinks."""
    mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for t in range(num_queries):
        i = query_start + t
        block_ends = set(range(dilation - 1, i + 1, dilation))
        local = set(range(max(0, i - window), i + 1))
        sink = set(range(min(sinks, i + 1)))
        for j in block_ends | local | sink:
            if j < num_keys:
                mask[t, j] = True
    return mask


@pytest.mark.parametrize("dilation", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("window,sinks", [(0, 0), (0, 4), (3, 0), (5, 4), (256, 4)])
def test_dilated_mask_equals_brute_force(dilation, window, sinks):
    seq = 70
    expected = brute_force_dilated_mask(seq, seq, dilation, window, sinks)
    torch.testing.assert_close(block_end_mask(seq, seq, dilation, window, sinks), expected)
    positions = torch.arange(seq)[None]
    torch.testing.assert_close(dilated_mask(positions, positions, dilation, window, sinks)[0], expected)


@pytest.mark.parametrize("start", [1, 17, 63])
def test_dilated_mask_for_cached_queries_equals_brute_force(start):
    expected = brute_force_dilated_mask(5, start + 5, 8, 2, 4, query_start=start)
    q_pos = torch.arange(start, start + 5)[None]
    k_pos = torch.arange(start + 5)[None]
    torch.testing.assert_close(dilated_mask(q_pos, k_pos, 8, 2, 4)[0], expected)


def test_defaults_are_dense_with_four_sinks():
    cfg = SparseInferenceConfig()
    assert (cfg.dilation, cfg.local_window, cfg.num_sink_tokens, cfg.top_k) == (1, 0, 4, None)
    assert cfg.is_dense and cfg.pattern().kind == "dense"
    assert not SparseInferenceConfig(dilation=16).is_dense
    assert not SparseInferenceConfig(layer_overrides={3: {"dilation": 4}}).is_dense
    assert SparseInferenceConfig(dilation=16, layer_overrides={0: "dense"}).pattern_for(0, 0).kind == "dense"


def test_layer_overrides_dense_layers_0_and_12():
    cfg = SparseInferenceConfig(dilation=16, local_window=256, layer_overrides={0: "dense", 12: "dense"})
    for layer in range(24):
        pattern = cfg.pattern_for(layer, head=3)
        if layer in (0, 12):
            assert pattern.kind == "dense"
        else:
            assert (pattern.dilation, pattern.local_window, pattern.num_sink_tokens) == (16, 256, 4)


def test_head_overrides_dense_first_two_heads():
    cfg = SparseInferenceConfig(dilation=16, head_overrides={0: "dense", 1: "dense"})
    groups = cfg.layer_groups(5, num_heads=8)
    assert [(p.kind, heads) for p, heads in groups] == [("dense", (0, 1)), ("dilated", (2, 3, 4, 5, 6, 7))]
    assert groups[1][0].dilation == 16


def test_layer_override_wins_over_head_overrides_and_can_carry_its_own():
    cfg = SparseInferenceConfig(
        dilation=16,
        head_overrides={0: "dense"},
        layer_overrides={2: {"dilation": 4, "head_overrides": {1: {"top_k": 2, "block_size": 8}}}},
    )
    assert cfg.pattern_for(0, 0).kind == "dense"
    assert cfg.pattern_for(2, 0).dilation == 4  # the layer override ignores the top-level head override
    topk = cfg.pattern_for(2, 1)
    assert (topk.kind, topk.dilation, topk.top_k, topk.block_size) == ("topk", 4, 2, 8)


def test_topk_and_dilation_union():
    cfg = SparseInferenceConfig(dilation=64, top_k=8, block_size=64, block_scoring="moba")
    pattern = cfg.pattern()
    assert (pattern.kind, pattern.dilation, pattern.top_k, pattern.block_scoring) == ("topk", 64, 8, "moba")


def test_json_round_trip_with_overrides():
    cfg = SparseInferenceConfig(
        dilation=16, local_window=256, num_sink_tokens=2, top_k=None,
        layer_overrides={12: "dense", 3: {"dilation": 4, "head_overrides": {0: "dense"}}},
        head_overrides={1: {"top_k": 4, "block_size": 16, "block_scoring": "moba"}},
    )
    text = json.dumps(cfg.to_dict())
    back = SparseInferenceConfig.from_dict(json.loads(text))  # int keys came back as strings
    assert back == cfg
    assert back.to_json_string() == cfg.to_json_string()
    assert back.pattern_for(3, 0).kind == "dense" and back.pattern_for(7, 1).kind == "topk"
    assert SparseInferenceConfig.coerce(cfg.to_dict()) == cfg
    assert SparseInferenceConfig.coerce(None) == SparseInferenceConfig()


def test_cache_entries_follow_the_pattern():
    assert AttentionPattern(dilation=16, local_window=256).cache_entries(4096) == 4096 // 16 + 256 + 4
    assert AttentionPattern().cache_entries(100) == 100
    assert AttentionPattern(top_k=4, block_size=16).cache_entries(100) == 100
    assert AttentionPattern(dilation=64, local_window=0, num_sink_tokens=4).cache_entries(3) == 0 + 0 + 3


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"dilation": 0}, "dilation"),
        ({"dilation": 2.5}, "dilation"),
        ({"local_window": -1}, "local_window"),
        ({"num_sink_tokens": -2}, "num_sink_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"block_size": 0, "top_k": 2}, "block_size"),
        ({"block_scoring": "max"}, "block_scoring"),
        ({"layer_overrides": {1: {"dilation": 0}}}, r"layer_overrides\[1\].dilation"),
        ({"layer_overrides": {1: {"dilaton": 4}}}, r"layer_overrides\[1\] has unknown field 'dilaton'"),
        ({"layer_overrides": {-1: "dense"}}, "layer_overrides keys"),
        ({"head_overrides": {0: {"top_k": -1}}}, r"head_overrides\[0\].top_k"),
        ({"head_overrides": {0: {"head_overrides": {}}}}, r"head_overrides\[0\] has unknown field"),
        ({"layer_overrides": {2: {"head_overrides": {1: {"local_window": -3}}}}}, r"layer_overrides\[2\].head_overrides\[1\].local_window"),
        ({"layer_overrides": {2: "sparse"}}, r"layer_overrides\[2\] must be a dict"),
    ],
)
def test_invalid_patterns_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SparseInferenceConfig(**kwargs)


def test_validate_for_model_names_the_field():
    with pytest.raises(ValueError, match=r"layer_overrides\[24\].*24 layers"):
        SparseInferenceConfig(dilation=16, layer_overrides={24: "dense"}).validate_for_model(24, 16, 4096)
    with pytest.raises(ValueError, match=r"head_overrides\[16\].*16 attention heads"):
        SparseInferenceConfig(dilation=16, head_overrides={16: "dense"}).validate_for_model(24, 16, 4096)
    with pytest.raises(ValueError, match=r"layer_overrides\[1\].head_overrides\[4\]"):
        SparseInferenceConfig(layer_overrides={1: {"head_overrides": {4: "dense"}}}).validate_for_model(2, 4)
    with pytest.raises(ValueError, match=r"top_k=65.*64 blocks"):
        SparseInferenceConfig(top_k=65, block_size=64).validate_for_model(24, 16, 4096)
    with pytest.raises(ValueError, match="top_k=3"):
        SparseInferenceConfig(head_overrides={1: {"top_k": 3, "block_size": 32}}).validate_for_model(2, 4, 64)
    SparseInferenceConfig(top_k=64, block_size=64, layer_overrides={23: "dense"}).validate_for_model(24, 16, 4096)
