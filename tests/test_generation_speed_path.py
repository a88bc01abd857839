"""The static decode step generate() takes on CUDA (hf_hybrid/generation/graph_decode.py), run on
the CPU without capturing a graph (``decode_cuda_graph="eager"``): the same forward on the
preallocated buffers, device-side positions and split host bookkeeping a CUDA graph replays.

Each covered architecture: static generate() == eager generate() (greedy and sampling with a fixed
seed), its per-step logits == the uncached full forward, left-padded prompts and beam search
take the eager path and stay exact, and ``static_decode_advance`` does exactly the host part of a
decode step (what a replayed graph relies on). The GPU tests (graph == eager token for token,
speed) are in tests/gpu/test_graph_decode_gpu.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid.generation.graph_decode import resolve_decode_mode
from hf_hybrid.sparse import SparseInferenceConfig
from hf_hybrid.models.fox import FoxConfig
from hf_hybrid.models.rat import RatConfig
from hf_hybrid.models.rat_plus import RatPlusConfig
from hf_hybrid.models.rattention import RattentionConfig
from hf_hybrid.models.se_hybrid import SEHybridConfig

VOCAB = 61


def rat_model(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        chunk_size=4, pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(RatConfig(**settings)).eval()


def fox_model(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, kernel_backend="reference",
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FoxConfig(**settings)).eval()
    with torch.no_grad():  # spread-out forget gates (bias 0 makes every f about 0.5)
        for layer in model.model.layers:
            if layer.self_attn.f_proj is not None:
                layer.self_attn.f_proj.bias.uniform_(-1.0, 3.0)
    return model


def rattention_model(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, window_size=3, pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(RattentionConfig(**settings)).eval()


def rat_plus_model(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, training_dilations=[1, 8],
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(RatPlusConfig(**settings)).eval()


def se_hybrid_model(**overrides):
    """A tiny SE hybrid (Mamba-2, attention, Mamba-2), `full` mode unless told: blocks of 4, chunks of
    16 (prompts of 9 and 11 new tokens cross block ends and a chunk start, after which `se` retrieves)."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"], mamba_d_head=8, mamba_d_state=8,
        mamba_n_heads=8, mamba_chunk_size=8, se_chunk_sizes=[16], se_eval_chunk_size=16, se_block_size=4,
        se_top_k=2, se_select_every=8, pad_token_id=0, eos_token_id=None,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(SEHybridConfig(**settings)).eval()


def dilated(dilation, window, sinks):
    return SparseInferenceConfig(dilation=dilation, local_window=window, num_sink_tokens=sinks)


MODELS = {
    "rat": rat_model,
    "rat_nope_one_group": lambda: rat_model(use_rope=False, num_qk_groups=1),
    # RAT-SWA with a window the prompts overrun (the ring wraps during the steps), and an
    # Attention-SWA stack whose window fills during decoding (full attention layers too).
    "rat_swa": lambda: rat_model(layer_types=["rat", "sliding_attention"], sliding_window=5, num_key_value_heads=2),
    "attention_swa": lambda: rat_model(
        layer_types=["full_attention", "sliding_attention", "rat"], num_hidden_layers=3, sliding_window=12, num_key_value_heads=2
    ),
    "fox_pro": fox_model,
    "fox_llama_rope": lambda: fox_model(block_type="llama", use_rope=True),
    "rattention": rattention_model,
    "rattention_swa_only": lambda: rattention_model(use_residual_linear_attention=False),
    "rat_plus_dense": rat_plus_model,
    "rat_plus_d4_w2_i2": lambda: rat_plus_model(sparse_config=dilated(4, 2, 2)),
    "rat_plus_d3_w0_i0": lambda: rat_plus_model(sparse_config=dilated(3, 0, 0)),
    "rat_plus_d4_w5_i3": lambda: rat_plus_model(sparse_config=dilated(4, 5, 3)),
    # top-k blocks (Quest, and MoBA united with dilation): prompts of 9 and 11 new tokens close
    # several blocks of 4 during the static steps, so the choice has candidates to rank.
    "rat_plus_topk_quest": lambda: rat_plus_model(
        sparse_config=SparseInferenceConfig(top_k=2, block_size=4, local_window=2, num_sink_tokens=1)),
    "rat_plus_topk_moba_d3": lambda: rat_plus_model(sparse_config=SparseInferenceConfig(
        top_k=3, block_size=4, block_scoring="moba", dilation=3, local_window=1, num_sink_tokens=1)),
    # several head groups per layer: a dense head beside dilated ones (a group reading one kv head
    # and one reading both), and a top-k head beside a dense one.
    "rat_plus_head_groups": lambda: rat_plus_model(sparse_config=SparseInferenceConfig(
        dilation=4, local_window=1, num_sink_tokens=1, head_overrides={0: "dense"})),
    "rat_plus_head_groups_topk": lambda: rat_plus_model(sparse_config=SparseInferenceConfig(
        top_k=2, block_size=4, local_window=1, num_sink_tokens=1, head_overrides={3: "dense"})),
    "se_hybrid_full": se_hybrid_model,
    "se_hybrid_se": lambda: se_hybrid_model(attention_mode="se"),
    "se_hybrid_se_random": lambda: se_hybrid_model(attention_mode="se_random"),
    "se_hybrid_se_nomem": lambda: se_hybrid_model(attention_mode="se_nomem"),
    "se_hybrid_swa": lambda: se_hybrid_model(attention_mode="swa", sliding_window=6),
}


def generate(model, ids, mode, seed=0, **kwargs):
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids, decode_cuda_graph=mode, return_dict_in_generate=True, output_logits=True, **kwargs
        )
    return out, model.last_decode_report


@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_greedy_equals_eager_and_uncached_forward(name):
    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    new = 11  # crosses several chunk boundaries
    eager, eager_report = generate(model, ids, False, max_new_tokens=new, do_sample=False)
    static, report = generate(model, ids, "eager", max_new_tokens=new, do_sample=False)
    assert eager_report is None
    assert report["static_steps"] == new - 1 and not report["eager_decode_steps"], report
    setup = report["setup_ms"]  # host time of the one-off work; no capture without a graph
    assert setup["prepare"] > 0 and setup["warmup_step"] > 0 and setup["capture"] == 0, setup
    assert torch.equal(static.sequences, eager.sequences)
    static_logits, eager_logits = torch.stack(static.logits, 1), torch.stack(eager.logits, 1)
    torch.testing.assert_close(static_logits, eager_logits, atol=1e-5, rtol=0)
    with torch.no_grad():
        full = model(static.sequences, use_cache=False).logits[:, ids.shape[1] - 1 : -1].float()
    torch.testing.assert_close(static_logits, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_sampling_with_a_seed_equals_eager(name):
    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=9, do_sample=True, top_k=20, temperature=0.9)
    eager, _ = generate(model, ids, False, seed=5, **kwargs)
    static, report = generate(model, ids, "eager", seed=5, **kwargs)
    assert report["static_steps"] == 8
    assert torch.equal(static.sequences, eager.sequences)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_left_padded_prompts_decode_eagerly_and_exactly(name):
    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    eager, _ = generate(model, ids, False, attention_mask=mask, max_new_tokens=6, do_sample=False)
    static, report = generate(model, ids, "eager", attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert report["static_steps"] == 0 and "left padding" in next(iter(report["eager_decode_steps"]))
    assert torch.equal(static.sequences, eager.sequences)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_beam_search_decodes_eagerly_and_exactly(name):
    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False)
    with torch.no_grad():
        eager = model.generate(ids, decode_cuda_graph=False, **kwargs)
        static = model.generate(ids, decode_cuda_graph="eager", **kwargs)
        report = model.last_decode_report
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert report["static_steps"] == 0 and "beam search" in next(iter(report["eager_decode_steps"]))
    assert torch.equal(static, eager) and torch.equal(static, uncached)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_advance_does_the_host_part_of_a_decode_step(name):
    """A replayed graph runs no Python: static_decode_advance() must leave every cache layer's host
    state (token count, slot counts, view shapes) exactly where a real decode step leaves it."""
    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        for layer in cache.layers:
            assert layer.prepare_static_decode(32, model.config)
        stepped, advanced = copy.deepcopy(cache), copy.deepcopy(cache)
        for _ in range(6):  # through a chunk boundary
            position = stepped.get_seq_length()
            model(ids[:, :1], past_key_values=stepped, position_ids=torch.full((2, 1), position), use_cache=True)
            for layer in advanced.layers:
                layer.static_decode_advance()
            for a, b in zip(stepped.layers, advanced.layers):
                assert host_state(a) == host_state(b)


def host_state(layer) -> dict:
    """Python-side attributes of a cache layer: ints, bools and the shapes of held tensors."""
    out = {}
    for name, value in vars(layer).items():
        if isinstance(value, (int, bool)):
            out[name] = value
        elif isinstance(value, torch.Tensor):
            out[name] = (tuple(value.shape), value.stride())
    return out


def test_opt_out_and_mode_errors():
    model = rat_model()
    ids = torch.randint(1, VOCAB, (1, 5))
    model.config.decode_cuda_graph = False
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert model.last_decode_report is None
    with pytest.raises(ValueError, match="decode_cuda_graph"):
        resolve_decode_mode("yes", torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_decode_mode(True, torch.device("cpu"))
    assert resolve_decode_mode(None, torch.device("cpu")) is None  # auto: no graphs off CUDA


def test_rattention_window_filling_during_decode_goes_static_once_full():
    """A prompt shorter than the window: the ring is not full yet, so the first steps are eager,
    then the static step takes over; the tokens equal the eager generation throughout."""
    model = rattention_model(window_size=5)
    ids = torch.randint(1, VOCAB, (2, 2), generator=torch.Generator().manual_seed(7))
    eager, _ = generate(model, ids, False, max_new_tokens=10, do_sample=False)
    static, report = generate(model, ids, "eager", max_new_tokens=10, do_sample=False)
    assert torch.equal(static.sequences, eager.sequences)
    assert 0 < report["static_steps"] < 9 and sum(report["eager_decode_steps"].values()) == 9 - report["static_steps"]


def test_rat_plus_cache_continues_eagerly_after_static_steps():
    """A multi-token update on a cache left in static mode converts the stores back exactly."""
    model = rat_plus_model(sparse_config=dilated(4, 2, 2))
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = model(ids[:, :7], use_cache=True).past_key_values
        for layer in cache.layers:
            assert layer.prepare_static_decode(32, model.config)
        pieces = []
        for t in range(7, 12):  # static steps
            pieces.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
        assert all(layer.static_decode_active for layer in cache.layers)
        pieces.append(model(ids[:, 12:17], past_key_values=cache, use_cache=True).logits)  # leaves static mode
        pieces.append(model(ids[:, 17:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full[:, 7:], atol=1e-4, rtol=0)


def test_fox_bf16_static_step_is_close_to_the_float32_cached_attention():
    """In bf16 the static FoX step attends in bf16 (no float32 copy of the cache per step); its
    logits stay within bf16 noise of the eager step, which upcasts the cache."""
    model = fox_model(kernel_backend="auto").to(torch.bfloat16)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10))
    eager, _ = generate(model, ids, False, max_new_tokens=6, do_sample=False)
    static, report = generate(model, ids, "eager", max_new_tokens=6, do_sample=False)
    assert report["static_steps"] == 5
    with torch.no_grad():
        full = model(static.sequences, use_cache=False).logits[:, ids.shape[1] - 1 : -1].float()
    static_logits = torch.stack(static.logits, 1)
    scale = full.abs().max()
    assert (static_logits - full).abs().max() / scale < 0.03
    steps = int((static.sequences == eager.sequences).all(0).long().cumprod(0).sum()) - ids.shape[1]
    common = torch.stack(eager.logits, 1)[:, : steps + 1]  # logits of the steps whose inputs agree
    assert (static_logits[:, : steps + 1] - common).abs().max() / scale < 0.03


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cache_keeps_decoding_exactly_past_its_static_capacity(name):
    """After generate() the cache is still in static mode with buffers for max_length (rounded
    up to 16); decoding on by hand past them switches to the eager update, exactly."""
    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(12))
    out, report = generate(model, ids, "eager", max_new_tokens=4, do_sample=False)
    assert report["static_steps"] == 3
    sequence, cache = out.sequences, out.past_key_values
    extra = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(13))
    sequence = torch.cat([sequence, extra], dim=1)  # capacity 16: the buffers fill up on the way
    with torch.no_grad():
        full = model(sequence, use_cache=False).logits
        start = cache.get_seq_length()
        pieces = [model(sequence[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                  for t in range(start, sequence.shape[1])]
    torch.testing.assert_close(torch.cat(pieces, 1), full[:, start:], atol=1e-4, rtol=0)


def test_static_decode_step_is_marked_for_the_fused_backbone():
    """The static step runs its forward inside backbone_fusion.static_decode_step(), where the fused
    norm / SwiGLU kernels apply at any token count once fused_decode is on; eager steps are outside it."""
    from hf_hybrid.layers import backbone_fusion

    model = fox_model()
    seen = []
    model.model.layers[0].input_layernorm.register_forward_hook(
        lambda module, args, out: seen.append((args[0].shape[1], backbone_fusion._static_decode_depth)))
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, decode_cuda_graph="eager")
    assert seen[0] == (9, 0)  # the prefill: outside the static step
    assert [depth for _, depth in seen[1:]] == [1, 1, 1] and backbone_fusion._static_decode_depth == 0
    decode_sized = torch.zeros(2, 1, 32)
    previous = backbone_fusion._enabled, backbone_fusion._allow_cpu, backbone_fusion._fused_decode
    try:
        backbone_fusion.set_backbone_fusion(True, allow_cpu=True, fused_decode=False)
        with backbone_fusion.static_decode_step():
            off = backbone_fusion.fused_layer_applies(decode_sized)
        backbone_fusion.set_backbone_fusion(True, fused_decode=True)
        with backbone_fusion.static_decode_step():
            on = backbone_fusion.fused_layer_applies(decode_sized)
        outside = backbone_fusion.fused_layer_applies(decode_sized)
    finally:
        backbone_fusion._enabled, backbone_fusion._allow_cpu, backbone_fusion._fused_decode = previous
    assert (off, on, outside) == (False, True, False)
    # The per-head norm kernels (layers/fused_norms.py) follow the same switch.
    from hf_hybrid.layers.fused_norms import norm_backend

    assert norm_backend("auto", tokens=2) == "reference"
    try:
        backbone_fusion.set_backbone_fusion(backbone_fusion._enabled, fused_decode=True)
        with backbone_fusion.static_decode_step():
            assert norm_backend("auto", tokens=2) == "auto"
    finally:
        backbone_fusion._fused_decode = previous[2]


@pytest.mark.parametrize("first,then", [("full", "se"), ("se", "se"), ("se", "full"), ("se_random", "se")])
def test_se_hybrid_retrieval_state_continues_after_static_steps(first, then):
    """The SE retrieval state advances on the device in every mode's static step: after a generate()
    on the static step in one mode, the cache continues in another mode (several tokens, then one)
    exactly as after the same generate() on the eager path."""
    from hf_hybrid.compat import cache_of

    model = se_hybrid_model()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    more = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(8))
    logits = []
    for mode in ("eager", False):
        out, report = generate(model, ids, mode, max_new_tokens=6, do_sample=False, attention_mode=first)
        assert report is None if mode is False else report["static_steps"] == 5
        cache, sequence = cache_of(out), torch.cat([out.sequences, more], dim=1)
        with torch.no_grad():  # the last generated token (not cached yet) and 5 more, then one at a time
            pieces = [model(sequence[:, 14:20], past_key_values=cache, use_cache=True, attention_mode=then).logits]
            pieces += [model(sequence[:, t : t + 1], past_key_values=cache, use_cache=True, attention_mode=then).logits
                       for t in range(20, sequence.shape[1])]
        logits.append(torch.cat(pieces, 1))
        assert cache.get_seq_length() == sequence.shape[1]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["se", "se_random", "se_nomem", "swa"])
def test_se_hybrid_long_prompt_static_steps_read_from_the_own_chunk(monkeypatch, mode):
    """A prompt past the first chunk: the static steps attend over the columns from the own chunk's
    start (fixed when the state was stacked, while the steps cross into the next chunk) plus, in
    the retrieval modes, the gathered retrieved blocks; equal to the eager steps and the uncached forward."""
    from hf_hybrid.layers import se_static_decode

    gathered = []
    real = se_static_decode.gather_retrieved
    monkeypatch.setattr(se_static_decode, "gather_retrieved", lambda *a: gathered.append(1) or real(*a))
    model = se_hybrid_model(attention_mode=mode, sliding_window=6)
    ids = torch.randint(1, VOCAB, (3, 21), generator=torch.Generator().manual_seed(11))
    new = 16  # positions 21..36: chunk 1 from column 16, then chunk 2 from column 32
    eager, _ = generate(model, ids, False, max_new_tokens=new, do_sample=False)
    static, report = generate(model, ids, "eager", max_new_tokens=new, do_sample=False)
    assert report["static_steps"] == new - 1 and not report["eager_decode_steps"], report
    assert len(gathered) == (new - 1 if mode in ("se", "se_random") else 0)
    assert torch.equal(static.sequences, eager.sequences)
    static_logits = torch.stack(static.logits, 1)
    torch.testing.assert_close(static_logits, torch.stack(eager.logits, 1), atol=1e-5, rtol=0)
    with torch.no_grad():
        full = model(static.sequences, use_cache=False).logits[:, ids.shape[1] - 1 : -1].float()
    torch.testing.assert_close(static_logits, full, atol=1e-5, rtol=0)  # float32


def test_se_hybrid_static_se_step_follows_the_retrieved_blocks(monkeypatch):
    """The static `se` step attends over the blocks its top-k picks: with the ranking reversed
    (the least relevant blocks retrieved), its logits move away from the eager step's."""
    from hf_hybrid.layers import se_static_decode

    model = se_hybrid_model(attention_mode="se")
    ids = torch.randint(1, VOCAB, (2, 15), generator=torch.Generator().manual_seed(9))
    eager, _ = generate(model, ids, False, max_new_tokens=6, do_sample=False)
    static, _ = generate(model, ids, "eager", max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(torch.stack(static.logits, 1), torch.stack(eager.logits, 1), atol=1e-5, rtol=0)
    real = se_static_decode.select_blocks
    monkeypatch.setattr(se_static_decode, "select_blocks", lambda r, *a, **kw: real(None if r is None else -r, *a, **kw))
    reversed_, _ = generate(model, ids, "eager", max_new_tokens=6, do_sample=False)
    assert (torch.stack(reversed_.logits, 1) - torch.stack(eager.logits, 1)).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["fox_pro", "se_hybrid_full"])
def test_prompt_goes_straight_into_the_static_buffers(name, monkeypatch):
    """generate() reserves the static step's capacity before the prefill, so FoX's and the SE
    attention layers' caches put the prompt's K/V straight into buffers of that capacity (the first
    decode step then copies nothing); without the static path, or with beams, nothing is reserved."""
    from hf_hybrid.models.cache_layer import ReservedColumnsMixin, StaticColumns
    from hf_hybrid.compat import cache_of

    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    built = []
    original = StaticColumns.__init__

    def record(self, tensors, capacity):
        built.append((tensors[0].shape[1], capacity))
        original(self, tensors, capacity)

    monkeypatch.setattr(StaticColumns, "__init__", record)
    out, report = generate(model, ids, "eager", max_new_tokens=5, do_sample=False)
    layers = [layer for layer in cache_of(out).layers if isinstance(layer, ReservedColumnsMixin)]
    assert layers and report["static_steps"] == 4
    # once per layer, at the prefill (9 columns), at generate()'s capacity (14 aligned to 16)
    assert built == [(9, 16)] * len(layers)
    eager, _ = generate(model, ids, False, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(eager.logits, 1), atol=1e-5, rtol=0)
    built.clear()
    generate(model, ids, False, max_new_tokens=5, do_sample=False)
    generate(model, ids, "eager", max_new_tokens=5, do_sample=False, num_beams=2)
    assert built == []


FEW_ROW_MODELS = ("rat", "fox_pro", "rattention", "rat_plus_d4_w2_i2", "se_hybrid_full")


@pytest.mark.parametrize("name", FEW_ROW_MODELS)
def test_few_row_projections_decode_like_the_modules(monkeypatch, name):
    """The decode steps' projections and MLPs through the few-row kernel (kernels/few_row_linear, run
    in Triton's interpreter here; on CUDA by default): the same tokens as the modules' own F.linear,
    logits within float32 rounding, and the kernel really ran (once per layer's projection group)."""
    from hf_hybrid.layers import projections

    model = MODELS[name]()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    plain, _ = generate(model, ids, "eager", max_new_tokens=4, do_sample=False)
    calls = []
    original = projections.few_row_linear
    monkeypatch.setattr(projections, "few_row_linear", lambda *a: calls.append(len(a[1])) or original(*a))
    monkeypatch.setattr(projections, "FEW_ROW_BACKEND", "triton")
    fast, report = generate(model, ids, "eager", max_new_tokens=4, do_sample=False)
    assert report["static_steps"] == 3 and calls, (report, calls)
    assert torch.equal(fast.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(fast.logits, 1), torch.stack(plain.logits, 1), atol=1e-4, rtol=1e-4)


FUSED_RAT_PLUS = {
    "dense": {},
    "d4_w2_i2": dict(sparse_config=dilated(4, 2, 2)),
    "d3_w0_i0": dict(sparse_config=dilated(3, 0, 0)),
    "d4_w5_i3_gate_bias": dict(sparse_config=dilated(4, 5, 3), recurrence_gate_bias=True),
    "d4_w2_i2_no_recurrence": dict(sparse_config=dilated(4, 2, 2), use_recurrence=False),
}
@pytest.mark.parametrize("name", sorted(FUSED_RAT_PLUS))
def test_rat_plus_fused_static_step_equals_op_by_op_step(monkeypatch, name):
    """kernel_backend='triton' (Triton's interpreter on CPU): every static decode step of every RAT+
    layer runs the fused rat_plus_decode_step (two launches), and its logits equal those of the
    op-by-op static step after the same prefill, and the uncached forward's."""
    from hf_hybrid.layers import rat_plus_attention

    calls = []
    real = rat_plus_attention.rat_plus_decode_step
    monkeypatch.setattr(rat_plus_attention, "rat_plus_decode_step", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest sets it)
    model = rat_plus_model(hidden_size=64, num_attention_heads=4, kernel_backend="triton", **FUSED_RAT_PLUS[name]).to(device)
    with torch.no_grad():
        for layer in model.model.layers:
            if getattr(layer.self_attn, "g_proj", None) is not None and layer.self_attn.g_proj.bias is not None:
                layer.self_attn.g_proj.bias.uniform_(-2.0, 2.0)
    # The same model and prefill, then the op-by-op static step.
    switch_off = lambda: monkeypatch.setattr(rat_plus_attention.RatPlusAttention, "_fused_step_store", lambda *args: None)  # noqa: E731
    check_fused_static_step(model, calls, model.config.num_hidden_layers, switch_off)


def check_fused_static_step(model, calls: list, layers: int, switch_off) -> None:
    """generate() on the static step, whose fused op appends to ``calls`` in each of ``layers``
    layers per step, then again with it switched off (``switch_off()``: the op-by-op step) after the
    same prefill: the same tokens and logits, and the logits of the uncached forward."""
    device = next(model.parameters()).device
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    new = 7  # past a block end / the oldest token leaving every ring
    # Prefills (and the uncached forward) on the reference ops, the fused run's decode steps on the
    # kernels, the op-by-op run's on the reference ops too: both runs start from the same prefill,
    # and Triton's CPU interpreter runs only what is tested here.
    decode_backend = ["triton"]
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda module, args: setattr(module, "backend", "reference" if args[0].shape[1] > 1 else decode_backend[0])
        )
    fused, report = generate(model, ids, "eager", max_new_tokens=new, do_sample=False)
    assert report["static_steps"] == new - 1 and len(calls) == (new - 1) * layers, (report, len(calls))
    switch_off()
    decode_backend[0] = "reference"
    plain, report = generate(model, ids, "eager", max_new_tokens=new, do_sample=False)
    assert report["static_steps"] == new - 1 and len(calls) == (new - 1) * layers
    fused_logits, plain_logits = torch.stack(fused.logits, 1), torch.stack(plain.logits, 1)
    assert torch.equal(fused.sequences, plain.sequences)
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-5, rtol=0)
    with torch.no_grad():
        full = model(fused.sequences, use_cache=False).logits[:, ids.shape[1] - 1 : -1].float()
    torch.testing.assert_close(fused_logits, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
def test_rattention_fused_ring_step_equals_op_by_op_step(monkeypatch, feature_map):
    """kernel_backend='triton' (Triton's interpreter on CPU): every static decode step of every local
    RATTENTION layer runs the ring's RLA half, reads and writes as one ring_decode launch, and the
    logits equal those of the op-by-op ring step after the same prefill, and the uncached forward's."""
    from hf_hybrid.layers import residual_linear_attention as rla_layer

    calls = []
    real = rla_layer.ring_decode
    monkeypatch.setattr(rla_layer, "ring_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = rattention_model(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, layer_types=["local", "global"],
                             kernel_backend="triton", feature_map=feature_map).to(device)
    # The SWA prefill through SDPA: flex_attention (the triton backend's) is not what this test is about
    # (on the CPU it is slow; tests/gpu/test_graph_decode_gpu.py notes an Inductor failure at such shapes).
    for layer in model.model.layers:
        if isinstance(layer.self_attn, rla_layer.RattentionLocalAttention):
            layer.self_attn._swa_backend = lambda: "sdpa"
    local_layers = sum(t == "local" for t in model.config.layer_types)
    switch_off = lambda: monkeypatch.setattr(rla_layer.RattentionLocalAttention, "_fused_ring_step", lambda *args: False)  # noqa: E731
    check_fused_static_step(model, calls, local_layers, switch_off)


@pytest.mark.parametrize("name", ["rat", "fox_pro", "rattention", "rat_plus_d4_w2_i2", "se_hybrid_full"])
def test_deferred_residual_adds_equal_the_block_by_block_step(monkeypatch, name):
    """In the static decode step every residual add rides on the RMSNorm after it (add_rms_norm,
    Triton's interpreter here): each block runs forward_deferred_add, and the logits equal those of
    the plain blocks (ADD_NORM_BACKEND='reference' keeps them)."""
    from hf_hybrid.layers import backbone

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    model = MODELS[name]().to(device)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7)).to(device)
    calls = []
    real = backbone.DecoderLayer.forward_deferred_add
    monkeypatch.setattr(backbone.DecoderLayer, "forward_deferred_add", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    monkeypatch.setattr(backbone, "ADD_NORM_BACKEND", "triton")
    fused, report = generate(model, ids, "eager", max_new_tokens=6, do_sample=False)
    assert report["static_steps"] == 5 and len(calls) == 5 * model.config.num_hidden_layers, (report, len(calls))
    monkeypatch.setattr(backbone, "ADD_NORM_BACKEND", "reference")
    plain, _ = generate(model, ids, "eager", max_new_tokens=6, do_sample=False)
    assert len(calls) == 5 * model.config.num_hidden_layers
    assert torch.equal(fused.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(fused.logits, 1), torch.stack(plain.logits, 1), atol=1e-5, rtol=1e-5)
