"""Assisted (speculative) decoding and prompt-lookup decoding for every architecture.

transformers' assisted decoding runs the target over a window of draft tokens and crops the rejected
ones off both caches (Cache.crop). With greedy decoding the result must be exactly plain greedy
generate(): checked with a draft that disagrees often (another random model of the vocabulary,
drafting 5 tokens a round: crops of several tokens) and with the model as its own draft (every
draft accepted: whole windows kept, the draft's cache recorded and cropped alongside).
The unit tests crop a recorded cache by k tokens and feed the cut tokens again: the logits equal
the uncropped run, also when the crop crosses a chunk / block / window boundary.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_hybrid import FoxConfig, RatConfig, RatPlusConfig, RattentionConfig, SEHybridConfig
from hf_hybrid.sparse import SparseInferenceConfig

VOCAB = 61


def _rat(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        chunk_size=4, sliding_window=6, pad_token_id=0,
    )
    return RatConfig(**{**settings, **overrides})


def _rat_swa():
    return _rat(num_hidden_layers=4, layer_types=RatConfig.hybrid_layer_types(4, "rat"))


def _rat_plus(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, training_dilations=[1, 8],
    )
    return RatPlusConfig(**{**settings, **overrides})


def _fox(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, kernel_backend="reference",
    )
    return FoxConfig(**{**settings, **overrides})


def _rattention(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, window_size=3, pad_token_id=0,
    )
    return RattentionConfig(**{**settings, **overrides})


def _se(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, pad_token_id=0,
        se_chunk_sizes=[4, 8], se_eval_chunk_size=8, se_block_size=2, se_top_k=2, se_select_every=4, sliding_window=6,
    )
    return SEHybridConfig(**{**settings, **overrides})


# name -> (config factory, generate() keywords)
ARCHITECTURES = {
    "rat": (_rat, {}),
    "rat_swa": (_rat_swa, {}),
    "rat_plus": (_rat_plus, {}),
    "rat_plus_sparse": (_rat_plus, {"sparse_config": SparseInferenceConfig(dilation=4, local_window=3, num_sink_tokens=2)}),
    "rat_plus_topk": (_rat_plus, {"sparse_config": SparseInferenceConfig(
        top_k=1, block_size=4, local_window=2, num_sink_tokens=1, head_overrides={0: "dense"})}),
    "fox_llama": (lambda: _fox(block_type="llama"), {}),
    "fox_pro": (lambda: _fox(block_type="pro"), {}),
    "rattention": (_rattention, {}),
    "rattention_linear": (lambda: _rattention(window_size=-1), {}),
    "se_hybrid_se": (lambda: _se(attention_mode="se"), {}),
    "se_hybrid_full": (lambda: _se(attention_mode="full"), {}),
}

# The Triton decode steps (CUDA, or Triton's interpreter on CPU) write the recurrent state in place.
TRITON_ARCHITECTURES = {
    "rat_triton": (lambda: _rat(kernel_backend="triton", num_attention_heads=2), {}),
    "rattention_triton": (lambda: _rattention(kernel_backend="triton", head_dim=16, num_attention_heads=2, num_key_value_heads=1), {}),
}


def spec(name: str):
    return {**ARCHITECTURES, **TRITON_ARCHITECTURES}[name]


def build(name: str, seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec(name)[0]()).eval().to(device)
    with torch.no_grad():  # spread-out gates and norms, so that states and positions matter
        for param_name, param in model.named_parameters():
            if param.dim() == 1 or "bias" in param_name:
                param.add_(torch.randn_like(param) * 0.5)
    return model


def prompt(length: int = 7, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (1, length), generator=generator).to(device)


def greedy(model, ids, max_new_tokens: int = 12, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens, **kwargs
        )


def count_crops(monkeypatch, cache_class) -> list[int]:
    """Tokens each crop of ``cache_class`` removed (generate() crops the draft's and the target's caches)."""
    removed, crop = [], cache_class.crop

    def counting_crop(self, max_length):
        before = self.get_seq_length()
        crop(self, max_length)
        removed.append(before - self.get_seq_length())

    monkeypatch.setattr(cache_class, "crop", counting_crop)
    return removed


def drafting(model, tokens: int):
    """Let ``model`` draft ``tokens`` tokens per round however unsure it is (random tiny models are,
    and the default confidence threshold would stop every draft after one token)."""
    model.generation_config.num_assistant_tokens = tokens
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def check_assisted_greedy(name, monkeypatch, device):
    model, draft = build(name, 0, device), drafting(build(name, 123, device), 5)
    extra = ARCHITECTURES[name][1]
    ids = prompt(device=device)
    plain = greedy(model, ids, **extra)
    # the disagreeing draft must actually disagree, or the crops would not be exercised
    draft_alone = greedy(draft, ids, **extra)
    assert not torch.equal(draft_alone, plain)
    removed = count_crops(monkeypatch, model.model.cache_class)
    with_draft = greedy(model, ids, assistant_model=draft, **extra)
    assert max(removed) > 1, "no crop removed rejected draft tokens"
    with_itself = greedy(model, ids, assistant_model=drafting(model, 6), **extra)
    assert torch.equal(with_draft, plain), f"{name}: assisted {with_draft.tolist()} != plain {plain.tolist()}"
    assert torch.equal(with_itself, plain), f"{name}: self-assisted {with_itself.tolist()} != plain {plain.tolist()}"


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_assisted_greedy_equals_plain_greedy(name, monkeypatch):
    check_assisted_greedy(name, monkeypatch, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_assisted_greedy_equals_plain_greedy_on_gpu(name, monkeypatch):
    """The same on CUDA (fp32): the Triton decode steps and scans record and restore the states."""
    check_assisted_greedy(name, monkeypatch, "cuda")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_prompt_lookup_greedy_equals_plain_greedy(name, monkeypatch):
    model = build(name, 0)
    extra = ARCHITECTURES[name][1]
    # a repetitive prompt, so that n-gram lookups propose (partly wrong) continuations
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    plain = greedy(model, ids, **extra)
    removed = count_crops(monkeypatch, model.model.cache_class)
    looked_up = greedy(model, ids, prompt_lookup_num_tokens=4, **extra)
    assert max(removed) > 0, "no crop removed rejected candidates"
    assert torch.equal(looked_up, plain), f"{name}: prompt lookup {looked_up.tolist()} != plain {plain.tolist()}"


def _forward(model, ids, cache, extra):
    return model(ids, past_key_values=cache, use_cache=True, **extra).logits


CROPS = [(5, 6, 3), (9, 1, 1), (6, 7, 7), (3, 9, 6)]


@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("prefill, segment, removed", CROPS)
def test_crop_then_refeed_equals_uncropped(name, prefill, segment, removed):
    check_crop_then_refeed(name, prefill, segment, removed, "cpu", atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ARCHITECTURES))
@pytest.mark.parametrize("prefill, segment, removed", CROPS)
def test_crop_then_refeed_equals_uncropped_on_gpu(name, prefill, segment, removed):
    check_crop_then_refeed(name, prefill, segment, removed, "cuda", atol=5e-3)  # TF32 in the fp32 kernels



@pytest.mark.parametrize("name", list(TRITON_ARCHITECTURES))
@pytest.mark.parametrize("prefill, segment, removed", [(9, 1, 1), (6, 7, 7)])
def test_crop_after_triton_decode_steps(name, prefill, segment, removed):
    on_gpu = torch.cuda.is_available()  # else Triton's interpreter
    check_crop_then_refeed(name, prefill, segment, removed, "cuda" if on_gpu else "cpu", atol=5e-3 if on_gpu else 1e-4)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_crop_by_a_tensor_count_keeps_host_lengths(name):
    """transformers' assisted decoding crops by ``-(candidate_length - n_matches)``, a 0-d tensor (on
    the GPU a CUDA tensor). Cache lengths stay host ints, so the next segment's positions and chunk
    slots are not computed from a device counter (regression: RAT's assisted greedy on CUDA repeated
    accepted tokens when its length had become a CUDA tensor)."""
    check_crop_then_refeed(name, 6, 7, 3, "cpu", atol=1e-5, crop_by=torch.tensor)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_draft_length_given_to_past_recording_widens_a_narrower_crop_window(name):
    """transformers >= 5.25 starts past recording with its draft length
    (``activate_past_recording(recurrent_states_to_keep=n)``): a crop of n tokens then works where
    the crop window was narrower, and is refused without it."""
    check_crop_then_refeed(name, 4, 6, 5, "cpu", atol=1e-5, window=(2, 5))
    with pytest.raises(ValueError, match="crop"):
        check_crop_then_refeed(name, 4, 6, 5, "cpu", atol=1e-5, window=(2, None))


def test_se_mamba_layers_drop_transformers_state_copies_at_a_crop():
    """transformers >= 5.25's linear-attention layer keeps a copy of the SSM state per update while
    recording, for its own crop; the SE hybrid's Mamba layers rebuild the state by a scan, so a crop
    drops the copies (they would otherwise grow with every verified draft)."""
    from hf_hybrid.models.se_hybrid.cache_se_hybrid import SEMambaLayerCache

    model = build("se_hybrid_full", 0)
    cache = model.model.cache_class(model.config)
    cache.activate_past_recording()
    with torch.no_grad():
        _forward(model, prompt(6, seed=3), cache, {})
    mamba = [layer for layer in cache.layers if isinstance(layer, SEMambaLayerCache)]
    for layer in mamba:
        layer.recurrent_states_history = {0: [layer.recurrent_states[0].clone()]}
    cache.crop(-1)
    assert mamba and all(layer.recurrent_states_history == {0: []} for layer in mamba)
    assert cache.get_seq_length() == 5 and all(layer.get_seq_length() == 5 for layer in mamba)


def check_crop_then_refeed(name, prefill, segment, removed, device, atol, crop_by=int, window=None):
    """Prefill, one more segment (several tokens or a decode step), crop ``removed`` tokens, feed
    them again, then decode two more tokens: the logits equal the uncropped run throughout.
    ``crop_by`` makes the crop's argument (int, or torch.tensor as transformers passes it);
    ``window``: (the cache's crop window, the draft length past recording starts with)."""
    model = build(name, 0, device)
    extra = spec(name)[1]
    ids = prompt(prefill + segment + 2, seed=3, device=device)
    cache_class = model.model.cache_class
    with torch.no_grad():
        reference = model(ids, use_cache=False, **extra).logits
        cache = cache_class(model.config)
        if window is None:
            cache.activate_past_recording()
        else:
            cache.set_crop_window(window[0])
            cache.activate_past_recording(**({} if window[1] is None else {"recurrent_states_to_keep": window[1]}))
        _forward(model, ids[:, :prefill], cache, extra)
        _forward(model, ids[:, prefill : prefill + segment], cache, extra)  # segment 1: a decode step
        total = prefill + segment
        assert cache.get_seq_length() == total
        cache.crop(crop_by(-removed))
        assert cache.get_seq_length() == total - removed
        lengths = [cache.get_seq_length()] + [l.get_seq_length() for l in cache.layers if hasattr(l, "get_seq_length")]
        assert all(type(length) is int for length in lengths), lengths
        again = _forward(model, ids[:, total - removed : total], cache, extra)
        torch.testing.assert_close(again, reference[:, total - removed : total], atol=atol, rtol=1e-4)
        for t in range(total, total + 2):
            step = _forward(model, ids[:, t : t + 1], cache, extra)
            torch.testing.assert_close(step, reference[:, t : t + 1], atol=atol, rtol=1e-4)


def recorded_tokens(layer) -> int:
    """Tokens whose crop data a layer holds now (0 for layers that keep none)."""
    counts = [0]
    for name in ("state_history", "_left_window", "_queries", "_scan_inputs"):
        history = getattr(layer, name, None)
        if history is not None:
            counts.append(len(history))
    for store in getattr(layer, "stores", []):
        if getattr(store, "window_keys", None) is not None:
            counts.append(store.window_keys.shape[1] - store.pattern.local_window)
    return max(counts)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_recording_is_bounded_and_crops_stay_exact(name):
    """With a crop window of 3, twenty decode steps and a 4-token segment without a crop keep at
    most 3 (+1) tokens of crop data per layer; older ones are folded into checkpoints, and a crop
    of 3 tokens after that is still exact. A crop beyond the window raises and changes nothing."""
    model = build(name, 0)
    extra = ARCHITECTURES[name][1]
    ids = prompt(34, seed=5)
    with torch.no_grad():
        reference = model(ids, use_cache=False, **extra).logits
        cache = model.model.cache_class(model.config)
        cache.set_crop_window(3)
        cache.activate_past_recording()
        _forward(model, ids[:, :6], cache, extra)
        for t in range(6, 26):
            _forward(model, ids[:, t : t + 1], cache, extra)
        _forward(model, ids[:, 26:30], cache, extra)
        assert max(recorded_tokens(layer) for layer in cache.layers) <= 4
        with pytest.raises(ValueError, match="set_crop_window"):
            cache.crop(-5)
        assert cache.get_seq_length() == 30
        cache.crop(-3)
        again = _forward(model, ids[:, 27:31], cache, extra)
        torch.testing.assert_close(again, reference[:, 27:31], atol=1e-5, rtol=1e-4)
        with pytest.raises(ValueError, match="set_crop_window"):
            cache.crop(-5)  # only the 4 tokens since the last crop can be removed
        cache.crop(31)  # older callers pass the length to keep
        assert cache.get_seq_length() == 31
        step = _forward(model, ids[:, 31:32], cache, extra)
        torch.testing.assert_close(step, reference[:, 31:32], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["rat", "rat_plus", "fox_pro", "rattention", "se_hybrid_se"])
def test_crop_without_recording_raises(name):
    model = build(name, 0)
    extra = ARCHITECTURES[name][1]
    ids = prompt(8)
    with torch.no_grad():
        cache = model.model.cache_class(model.config)
        _forward(model, ids[:, :7], cache, extra)
        _forward(model, ids[:, 7:8], cache, extra)
        cache.crop(0)  # removing nothing is always fine
        with pytest.raises(ValueError, match="activate_past_recording"):
            cache.crop(-1)
        assert cache.get_seq_length() == 8


def test_caches_report_croppable():
    for name in ARCHITECTURES:
        model = build(name, 0)
        cache = model.model.cache_class(model.config)
        assert cache.is_croppable, name


@pytest.mark.parametrize("name", ["rat", "rat_swa", "rat_plus", "rat_plus_sparse", "fox_pro", "rattention"])
def test_crop_of_left_padded_batch(name):
    """Crops cut the same columns of every row (transformers' DeferredStopCheck crops batches): a
    left-padded batch cropped by 4 and fed the cut tokens again gives the logits of the uncropped
    cache, for the refed tokens and the next decode step."""
    model = build(name, 0)
    extra = ARCHITECTURES[name][1]
    ids = prompt(15, seed=7).repeat(2, 1)
    ids[1, :3] = 0
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1: three pads, then its tokens
    with torch.no_grad():
        caches = []
        for _ in range(2):
            cache = model.model.cache_class(model.config)
            cache.activate_past_recording()
            model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, **extra)
            logits = model(ids[:, 6:12], attention_mask=mask[:, :12], past_key_values=cache, **extra).logits
            caches.append(cache)
        cropped = caches[1]
        cropped.crop(-4)
        again = model(ids[:, 8:12], attention_mask=mask[:, :12], past_key_values=cropped, **extra).logits
        torch.testing.assert_close(again, logits[:, 2:], atol=1e-5, rtol=1e-4)
        expected, step = (
            model(ids[:, 12:13], attention_mask=mask[:, :13], past_key_values=cache, **extra).logits for cache in caches
        )
        torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-4)
