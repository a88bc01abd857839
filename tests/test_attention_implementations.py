"""Softmax layers go through transformers' attention interface and honour
``config._attn_implementation`` (eager, sdpa, flex_attention, flash_attention_2 when installed):

* the masks of every form (dense, flex BlockMask) say the same thing (SequenceContext);
* eager and sdpa give the same logits (fp32, atol 1e-5), with and without left padding and through
  the cache, for every architecture with softmax layers (RAT-SWA, the attention baselines,
  RATTENTION, SE full mode); FoX / RAT / RAT+ accept every implementation;
* ``from_config`` / ``from_pretrained(attn_implementation=...)`` and ``set_attn_implementation``
  reach the layers (they read the config at every call);
* on CUDA no softmax layer hands SDPA a dense T x T mask (GPU tests).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid import FoxConfig, RatConfig, RatPlusConfig, RattentionConfig, SEHybridConfig
from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.layers import attention as attention_module
from hf_hybrid.layers.attention import eager_attention_forward
from hf_hybrid.layers.context import SequenceContext

# Eager flex_attention (the mask checks below) warns that it is unfused: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, pad_token_id=0)


def _config(config_class, **settings):
    """A config factory: COMMON, then the architecture's settings, then per-test overrides."""
    return lambda **overrides: config_class(**(COMMON | settings | overrides))


# Architectures with softmax layers (they must give the same logits under eager and sdpa).
SOFTMAX_CONFIGS = {
    "rat_swa": _config(
        RatConfig, num_hidden_layers=3, num_key_value_heads=2, chunk_size=4, sliding_window=3,
        layer_types=["rat", "sliding_attention", "full_attention"],
    ),
    "attention_baseline": _config(
        RatConfig, num_hidden_layers=2, num_key_value_heads=2, chunk_size=4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "rattention": _config(
        RattentionConfig, num_hidden_layers=2, num_key_value_heads=2, window_size=3, layer_types=["local", "global"]
    ),
    "se_full": _config(
        SEHybridConfig, num_hidden_layers=2, num_key_value_heads=2, layer_types=["mamba", "attention"], mamba_d_head=16,
        mamba_d_state=8, mamba_chunk_size=8, attention_mode="full", se_chunk_sizes=[8], se_eval_chunk_size=8,
        se_block_size=2, se_top_k=2, se_select_every=4, sliding_window=6,
    ),
}
# Mixers without a plain softmax form: attn_implementation is accepted and changes nothing.
OTHER_CONFIGS = {
    "rat": _config(RatConfig, num_hidden_layers=2, chunk_size=4),
    "rat_plus": _config(RatPlusConfig, num_hidden_layers=2, num_key_value_heads=2),
    "fox": _config(FoxConfig, num_hidden_layers=2, num_key_value_heads=2, kernel_backend="reference"),
}


def build(make_config, implementation: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(**overrides), attn_implementation=implementation).eval()


def padded_batch(seq: int = 11, pads: int = 4):
    ids = torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :pads] = 0
    return ids, mask


# ---------------------------------------------------------------- masks: one visibility, every form


CONTEXTS = {
    # name: (batch, seq, past, padded)
    "prefill": (2, 9, 0, False),
    "prefill_padded": (2, 9, 0, True),
    "continuation": (2, 5, 6, False),
    "continuation_padded": (2, 5, 6, True),
    "decode_padded": (2, 1, 10, True),
}


def make_context(batch, seq, past, padded):
    mask = None
    if padded:
        mask = torch.ones(batch, past + seq, dtype=torch.long)
        mask[0, :3] = 0
    return SequenceContext.build(batch, seq, past, mask, None, torch.device("cpu"))


@pytest.mark.parametrize("case", list(CONTEXTS))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dropped", [0, 2], ids=["all_keys", "cache_dropped_2"])
def test_block_mask_and_dense_mask_give_the_same_attention(case, window, dropped):
    batch, seq, past, padded = CONTEXTS[case]
    if dropped > past:
        pytest.skip("a cache only drops keys of earlier segments")
    context = make_context(batch, seq, past, padded)
    num_keys = past + seq - dropped  # a window cache may have dropped the oldest keys
    key_start = dropped
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, seq, 16, generator=generator)
    k, v = (torch.randn(batch, 2, num_keys, 16, generator=generator) for _ in range(2))
    dense, _ = eager_attention_forward(torch.nn.Module(), q, k, v, context.dense_mask(num_keys, key_start, window))
    # flex_attention outside torch.compile evaluates the BlockMask's mask_mod on every score: the
    # same visibility decisions the compiled kernel makes per block.
    flex = flex_attention(q, k, v, block_mask=context.block_mask(num_keys, key_start, window), enable_gqa=True)
    torch.testing.assert_close(flex.transpose(1, 2), dense, atol=1e-5, rtol=1e-5)
    sdpa_mask = context.attention_mask(num_keys, key_start, window)
    if sdpa_mask is not None:
        assert torch.equal(sdpa_mask, context.dense_mask(num_keys, key_start, window))


def test_block_masks_of_small_grids_are_built_without_compiling_the_builder(monkeypatch):
    """On CUDA a BlockMask over up to EAGER_MASK_MAX_CELLS (rows x queries x keys) is built eagerly:
    no torch.compile of the mask builder at a first use; by a compiled builder past it; never on CPU
    or inside an outer torch.compile."""
    from hf_hybrid.layers import context as context_module

    limit = context_module.EAGER_MASK_MAX_CELLS
    assert limit >= 2048 * 2048  # a first training step at 2K tokens (one row) builds it eagerly
    assert not context_module.compiles_mask_builder(limit, "cuda")
    assert context_module.compiles_mask_builder(limit + 1, "cuda")
    assert not context_module.compiles_mask_builder(4 * limit, "cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not context_module.compiles_mask_builder(4 * limit, "cuda")


@pytest.mark.slow  # compiles the builder with Inductor on the CPU
@pytest.mark.parametrize("padded", [False, True])
def test_eager_and_compiled_mask_builders_give_the_same_block_mask(padded, monkeypatch):
    """The context's BlockMask (window, padding, a cache offset) is the same whichever way it is built."""
    from hf_hybrid.layers import context as context_module

    masks = {}
    for compiled in (False, True):
        monkeypatch.setattr(context_module, "compiles_mask_builder", lambda cells, device, c=compiled: c)
        context = make_context(2, 300, 140, padded)
        masks[compiled] = context.block_mask(440, 0, 200)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(masks[False], name), getattr(masks[True], name)), name


def test_no_mask_where_causal_attention_is_exact():
    unpadded = make_context(2, 9, 0, False)
    assert not unpadded.needs_mask(9, 0)  # is_causal
    assert not unpadded.needs_mask(9, 0, window=9)  # the window hides no key
    assert unpadded.needs_mask(9, 0, window=8)
    decode = make_context(2, 1, 10, False)
    assert not decode.needs_mask(11, 0)  # one query sees every key
    assert not decode.needs_mask(4, 7, window=4)  # a window cache holds exactly the visible keys
    assert decode.attention_mask(11, 0) is None
    assert make_context(2, 1, 10, True).attention_mask(11, 0).shape == (2, 1, 1, 11)  # [B, 1, 1, K]
    assert make_context(2, 9, 0, True).needs_mask(9, 0)


# ---------------------------------------------------------------- eager == sdpa, every softmax architecture


@pytest.mark.parametrize("name", list(SOFTMAX_CONFIGS))
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_eager_and_sdpa_give_the_same_logits(name, padded):
    ids, mask = padded_batch()
    mask = mask if padded else None
    logits = {}
    for implementation in ("eager", "sdpa"):
        model = build(SOFTMAX_CONFIGS[name], implementation)
        assert model.config._attn_implementation == implementation
        with torch.no_grad():
            logits[implementation] = model(ids, attention_mask=mask).logits
    real = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(logits["eager"][real], logits["sdpa"][real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(SOFTMAX_CONFIGS))
def test_eager_decode_through_the_cache_matches_the_sdpa_forward(name):
    ids, mask = padded_batch(seq=12)
    sdpa = build(SOFTMAX_CONFIGS[name], "sdpa")
    eager = build(SOFTMAX_CONFIGS[name], "eager")
    with torch.no_grad():
        full = sdpa(ids, attention_mask=mask).logits
        out = eager(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        for start, stop in [(7, 10), (10, 11), (11, 12)]:  # a chunk of 3, then two decode steps
            out = eager(ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
    cached = torch.cat(pieces, dim=1)
    real = mask.bool()
    torch.testing.assert_close(cached[real], full[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(OTHER_CONFIGS))
def test_mixers_without_a_softmax_form_accept_every_implementation(name):
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = build(OTHER_CONFIGS[name], "sdpa")(ids, attention_mask=mask).logits
        for implementation in ("eager", "flex_attention"):
            model = build(OTHER_CONFIGS[name], implementation)
            assert model.config._attn_implementation == implementation
            torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference, atol=0, rtol=0)
            model.set_attn_implementation("sdpa")
            assert model.config._attn_implementation == "sdpa"


def test_config_docstrings_say_which_mixers_have_no_softmax_form():
    for config_class in (RatConfig, RatPlusConfig, FoxConfig):
        assert "attn_implementation" in config_class.__doc__


# ---------------------------------------------------------------- choosing the implementation


def test_set_attn_implementation_reaches_built_layers(monkeypatch):
    calls = []

    def counting_eager(*args, **kwargs):
        calls.append(1)
        return eager_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention_module, "eager_attention_forward", counting_eager)
    model = build(SOFTMAX_CONFIGS["rat_swa"], "sdpa")
    ids, mask = padded_batch()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        assert calls == []
        model.set_attn_implementation("eager")
        after = model(ids, attention_mask=mask).logits
    assert len(calls) == 2  # the sliding and the full layer
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_from_pretrained_takes_attn_implementation(tmp_path):
    model = build(SOFTMAX_CONFIGS["rattention"], "sdpa")
    # transformers' own save (weights + config): what from_pretrained needs.
    PreTrainedModel.save_pretrained(model, tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
    for implementation in ("eager", "sdpa"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation).eval()
        assert loaded.config._attn_implementation == implementation
        global_layer = loaded.model.layers[1].self_attn
        assert global_layer.config is loaded.config  # the layer reads the model's live config
        with torch.no_grad():
            out = loaded(ids, attention_mask=mask, output_attentions=implementation == "eager")
        torch.testing.assert_close(out.logits, reference, atol=1e-5, rtol=0)
        if implementation == "eager":
            assert out.attentions[1] is not None


def test_unknown_implementation_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_implementation"):
        build(SOFTMAX_CONFIGS["rat_swa"], "no_such_attention")


def test_sdpa_routing_on_cuda_never_builds_a_dense_mask_for_several_queries(monkeypatch):
    """The CUDA routing of "sdpa", checked on CPU: with ``_block_sparse`` answering as it does on
    CUDA, every masked call with several queries gets a BlockMask (run here by eager flex, which
    applies its mask_mod to every score), unpadded full attention gets no mask (is_causal), and
    decode steps keep a [B, 1, 1, K] mask. The logits are the eager ones."""
    monkeypatch.setattr(attention_module, "_block_sparse", lambda implementation, query: implementation == "sdpa")
    calls = []
    get_interface = ALL_ATTENTION_FUNCTIONS.get_interface

    def recording_get_interface(name, default):
        function = get_interface(name, default)

        def run(module, query, key, value, mask, scaling=None, **kwargs):
            calls.append((name, query.shape[2], mask))
            if name == "flex_attention":
                out = flex_attention(query, key, value, block_mask=mask, scale=scaling, enable_gqa=True)
                return out.transpose(1, 2), None
            return function(module, query, key, value, mask, scaling=scaling, **kwargs)

        return run

    monkeypatch.setattr(ALL_ATTENTION_FUNCTIONS, "get_interface", recording_get_interface)
    ids, mask = padded_batch(seq=12)
    eager = build(SOFTMAX_CONFIGS["rat_swa"], "eager")
    model = build(SOFTMAX_CONFIGS["rat_swa"], "sdpa")
    for padding in (None, mask):
        with torch.no_grad():
            reference = eager(ids, attention_mask=padding).logits
            out = model(ids[:, :-1], attention_mask=None if padding is None else padding[:, :-1], use_cache=True)
            step = model(ids[:, -1:], attention_mask=padding, past_key_values=out.past_key_values, use_cache=True)
        cached = torch.cat([out.logits, step.logits], dim=1)
        real = slice(None) if padding is None else padding.bool()
        torch.testing.assert_close(cached[real], reference[real], atol=1e-5, rtol=0)
    for name, queries, layer_mask in calls:
        if queries > 1:
            assert layer_mask is None or isinstance(layer_mask, BlockMask), (name, type(layer_mask))
        else:
            assert layer_mask is None or layer_mask.shape[:3] == (2, 1, 1)
    prefill_masks = [m for _, queries, m in calls if queries > 1]
    assert any(m is None for m in prefill_masks) and any(isinstance(m, BlockMask) for m in prefill_masks)


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")
def test_windows_over_unpadded_rows_run_the_window_kernel(monkeypatch):
    """The CUDA routing of "sdpa", checked on CPU with the kernels in Triton's interpreter: a window
    layer over whole unpadded rows (a training step, a prefill from empty) runs kernels/window_attention,
    with the SDPA path's logits and gradients (fp32); left-padded rows and the continuation of a cache
    keep the masked paths."""
    def loss_and_grads(model, ids, mask=None):
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    make = SOFTMAX_CONFIGS["rat_swa"]  # head_dim 16: one the kernels take
    ids, mask = padded_batch(seq=13)
    want_logits, want_grads = loss_and_grads(build(make, "sdpa", hidden_size=64).train(), ids)
    calls = []
    monkeypatch.setattr(attention_module, "window_attention_applies", lambda query: True)
    kernel = attention_module.window_attention
    monkeypatch.setattr(attention_module, "window_attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    model = build(make, "sdpa", hidden_size=64).train()
    logits, grads = loss_and_grads(model, ids)
    assert calls and all(kw["window_size"] == 3 and kw["backend"] == "triton" for kw in calls)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(ids, attention_mask=mask)  # left padding: the BlockMask / masked path
        out = model(ids[:, :-1], use_cache=True)
        model(ids[:, -1:], past_key_values=out.past_key_values)  # a decode step: the cache's path
    assert len(calls) == 1  # only the unpadded prefill


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rat_swa", "rattention", "se_full"])
def test_flex_attention_matches_eager_on_cpu(name):
    """transformers' compiled flex_attention on CPU (slow: Inductor compiles each mask shape)."""
    ids, mask = padded_batch()
    with torch.no_grad():
        eager = build(SOFTMAX_CONFIGS[name], "eager")(ids, attention_mask=mask).logits
        flex = build(SOFTMAX_CONFIGS[name], "flex_attention")(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(flex[real], eager[real], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- GPU: no dense T x T mask


def _record_sdpa_masks(monkeypatch) -> list[tuple[int, ...]]:
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if mask is not None:
            shapes.append(tuple(mask.shape))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return shapes


def _gpu_model(name: str, implementation: str):
    config = SOFTMAX_CONFIGS[name](hidden_size=128, intermediate_size=256, sliding_window=256, chunk_size=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    return model.to("cuda", torch.bfloat16).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rat_swa", "attention_baseline"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_gpu_forward_at_4k_never_hands_sdpa_a_dense_mask(monkeypatch, name, padded):
    seq = 4096
    ids = torch.randint(3, VOCAB, (2, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :1000] = 0
    with torch.no_grad():
        reference = _gpu_model(name, "eager")(ids, attention_mask=mask).logits.float()
        model = _gpu_model(name, "sdpa")
        shapes = _record_sdpa_masks(monkeypatch)
        logits = model(ids, attention_mask=mask).logits.float()
    assert all(torch.Size(shape).numel() < seq * seq for shape in shapes), shapes
    real = slice(None) if mask is None else mask.bool()
    torch.testing.assert_close(logits[real], reference[real], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_gpu_flex_and_flash_match_eager_with_padding_and_decode(implementation):
    if implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed")
    ids = torch.randint(3, VOCAB, (2, 700), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :100] = 0
    with torch.no_grad():
        reference = _gpu_model("rat_swa", "eager")(ids, attention_mask=mask).logits.float()
        model = _gpu_model("rat_swa", implementation)
        logits = model(ids, attention_mask=mask).logits.float()
        out = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        step = model(ids[:, -1:], attention_mask=mask, past_key_values=out.past_key_values, use_cache=True).logits.float()
    real = mask.bool()
    torch.testing.assert_close(logits[real], reference[real], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(step[:, -1], reference[:, -1], atol=2e-2, rtol=2e-2)
