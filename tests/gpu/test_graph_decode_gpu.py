"""generate() through the CUDA-graph decode step (hf_hybrid/generation/graph_decode.py) on the GPU:
token for token equal to the same static step run without a graph, close to the eager path in
bf16 and equal to it in fp32, and faster than the eager path. The CPU tests of the same step are
tests/test_generation_speed_path.py."""
from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_hybrid  # noqa: F401
from hf_hybrid.models.fox import FoxConfig
from hf_hybrid.models.rat import RatConfig
from hf_hybrid.models.rat_plus import RatPlusConfig
from hf_hybrid.models.rattention import RattentionConfig
from hf_hybrid.models.se_hybrid import SEHybridConfig
from hf_hybrid.sparse import SparseInferenceConfig

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             head_dim=64, pad_token_id=0)
CONFIGS = {
    "rat": lambda: RatConfig(**SHAPE, chunk_size=16),
    # RAT and sliding-window layers (the window's ring wraps during the steps), and an
    # Attention-SWA stack with full attention layers (its window fills during the steps). The
    # prefill through eager attention: SDPA's windowed prefill on CUDA is flex_attention, which
    # these small float32 shapes may fail to compile (see "rattention"), outside the decode step.
    "rat_swa": lambda: RatConfig(**SHAPE, chunk_size=16, num_key_value_heads=2, sliding_window=64,
                                 layer_types=RatConfig.hybrid_layer_types(4, "rat"), attn_implementation="eager"),
    "attention_swa": lambda: RatConfig(**SHAPE, num_key_value_heads=2, sliding_window=96, attn_implementation="eager",
                                       layer_types=RatConfig.hybrid_layer_types(4, "full_attention")),
    "fox": lambda: FoxConfig(**SHAPE, num_key_value_heads=2),
    # "chunked": the SWA prefill through SDPA. On an H100 the flex_attention
    # prefill ("auto") fails to compile for these small shapes (InductorError: NoValidChoicesError,
    # float32, 77 tokens), outside the decode step this file checks.
    "rattention": lambda: RattentionConfig(**SHAPE, num_key_value_heads=2, window_size=32, kernel_backend="chunked"),
    "rat_plus_dense": lambda: RatPlusConfig(**SHAPE, num_key_value_heads=2),
    "se_hybrid": lambda: SEHybridConfig(**SHAPE, num_key_value_heads=2),
    # `se` mode with chunks of 64 and blocks of 8: a 77-token prompt's steps attend over their own
    # chunk from column 64 plus 4 retrieved blocks per head, gathered (40 new tokens stay in chunk 1).
    "se_hybrid_se": lambda: SEHybridConfig(
        **SHAPE, num_key_value_heads=2, attention_mode="se", se_chunk_sizes=[64], se_eval_chunk_size=64,
        se_select_every=16, se_block_size=8, se_top_k=4,
    ),
    # two head groups per layer (a dense head beside dilated ones): one store per group in the graph.
    "rat_plus_head_groups": lambda: RatPlusConfig(
        **SHAPE, num_key_value_heads=2,
        sparse_config=SparseInferenceConfig(dilation=16, local_window=8, num_sink_tokens=2, head_overrides={0: "dense"}),
    ),
    # top-k blocks of 16 (Quest scoring): the block choice and the summaries inside the graph.
    "rat_plus_topk": lambda: RatPlusConfig(
        **SHAPE, num_key_value_heads=2,
        sparse_config=SparseInferenceConfig(top_k=4, block_size=16, local_window=8, num_sink_tokens=2),
    ),
    "rat_plus_d16": lambda: RatPlusConfig(
        **SHAPE, num_key_value_heads=2,
        sparse_config=SparseInferenceConfig(dilation=16, local_window=8, num_sink_tokens=2),
    ),
}


def build(name, dtype):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config.eos_token_id = None
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def run(model, ids, mode, new, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), decode_cuda_graph=mode, max_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1), model.last_decode_report


def first_mismatch(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    """Index (from ``start``) of the first generated column where any row differs; len when none."""
    same = (a[:, start:] == b[:, start:]).all(0)
    return int(same.long().cumprod(0).sum())


def assert_same_tokens_up_to_a_tie(graph_ids, eager_ids, graph_logits, eager_logits, prompt: int, same: int):
    """fp32: the two paths choose the same tokens, and the same logits, until a step where a row's two
    best logits were tied within float32 rounding (random weights make such ties; the paths' kernels
    sum in other orders), after which the sequences differ and are not compared."""
    scale = float(eager_logits.abs().max())
    torch.testing.assert_close(graph_logits[:, :same], eager_logits[:, :same], atol=1e-5 * scale, rtol=0)
    if same == graph_logits.shape[1]:
        return
    rows = (graph_ids[:, prompt + same] != eager_ids[:, prompt + same]).nonzero().flatten().tolist()
    for row in rows:
        step = eager_logits[row, same].float()
        gap = float(step[eager_ids[row, prompt + same]] - step[graph_ids[row, prompt + same]])
        assert 0 <= gap <= 1e-5 * scale, f"row {row}, new token {same}: the paths chose tokens {gap:.3g} apart (not a tie)"


def uncached_error(model, sequences, logits, prompt: int) -> float:
    """Max |logits - uncached forward on the same tokens| relative to the largest logit."""
    with torch.no_grad():
        full = model(sequences, use_cache=False).logits[:, prompt - 1 : -1].float()
    return float((logits.float() - full).abs().max() / full.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_graphed_generate_equals_eager(name, dtype):
    model = build(name, dtype)
    prompt, new = 77, 40  # odd length, crosses chunk ends and fills the window
    ids = torch.randint(1, 512, (3, prompt), device="cuda")
    graph_ids, graph_logits, report = run(model, ids, True, new)
    assert report["graph_captured"] and report["static_steps"] == new - 1 and not report["eager_decode_steps"], report
    static_ids, static_logits, _ = run(model, ids, "eager", new)
    eager_ids, eager_logits, _ = run(model, ids, False, new)
    same_static, same_eager = first_mismatch(graph_ids, static_ids, prompt), first_mismatch(graph_ids, eager_ids, prompt)
    diff_static = float((graph_logits - static_logits).abs().max())
    err_graph = uncached_error(model, graph_ids, graph_logits, prompt)
    err_eager = uncached_error(model, eager_ids, eager_logits, prompt)
    print(f"{name} {dtype}: graph==static-step tokens for {same_static}/{new}, max logit diff {diff_static:.3g}; "
          f"graph==eager tokens for {same_eager}/{new}; error vs uncached forward: graph {err_graph:.3g}, eager {err_eager:.3g}")
    # The replayed graph runs the static step's kernels on the same buffers: the same tokens and logits.
    assert same_static == new and diff_static == 0.0
    # As exact as the eager step against the uncached forward.
    assert err_graph <= 1.5 * err_eager + (1e-4 if dtype == torch.float32 else 5e-3)
    if dtype == torch.float32:
        assert_same_tokens_up_to_a_tie(graph_ids, eager_ids, graph_logits, eager_logits, prompt, same_eager)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sampling_with_a_seed_equals_static_eager_step(name):
    model = build(name, torch.bfloat16)
    ids = torch.randint(1, 512, (2, 40), device="cuda")
    outs = []
    for mode in (True, "eager"):
        torch.manual_seed(11)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), decode_cuda_graph=mode,
                                       max_new_tokens=20, do_sample=True, top_k=50))
    assert torch.equal(*outs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deferred_stop_and_prewarmed_capture_keep_the_tokens(name):
    """EOS part-way through: the stop check one step late (hf_hybrid/generation/deferred_stop.py)
    gives the tokens of the synchronous loop; a second generate() of the same shape captures at
    its first step (no eager warm-up) and gives them again."""
    model = build(name, torch.float32)
    prompt, new = 77, 24
    ids = torch.randint(1, 512, (2, prompt), device="cuda")

    def generate(mode, **kwargs):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), decode_cuda_graph=mode, max_new_tokens=new,
                                 do_sample=False, pad_token_id=0, **kwargs)
        return out, model.last_decode_report

    free, _ = generate(False)
    eos = [int(free[0, prompt + 6]), int(free[1, prompt + 9])]
    synchronous, none = generate(False, eos_token_id=eos)
    first, report_first = generate(True, eos_token_id=eos)
    second, report_second = generate(True, eos_token_id=eos)
    assert none is None and synchronous.shape[1] < prompt + new  # EOS stopped it early
    assert report_first["deferred_stop_check"] and report_first["graph_captured"], report_first
    assert report_first["setup_ms"]["warmup_step"] > 0
    assert report_second["graph_captured"] and report_second["setup_ms"]["warmup_step"] == 0, report_second
    assert torch.equal(first, synchronous) and torch.equal(second, synchronous)


def test_left_padding_and_beams_stay_exact_on_cuda():
    model = build("rat", torch.float32)
    ids = torch.randint(1, 512, (2, 30), device="cuda")
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0
    with torch.no_grad():
        for kwargs in (dict(attention_mask=mask), dict(attention_mask=mask, num_beams=3)):
            graph = model.generate(ids, max_new_tokens=12, do_sample=False, **kwargs)
            eager = model.generate(ids, max_new_tokens=12, do_sample=False, decode_cuda_graph=False, **kwargs)
            assert model.last_decode_report is None
            assert torch.equal(graph, eager)


def _ms_per_token(model, ids, mode):
    def timed(new):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           decode_cuda_graph=mode)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(8)
    return 1000 * (min(timed(72) for _ in range(2)) - min(timed(8) for _ in range(2))) / 64


@pytest.mark.parametrize("name", ["rat", "rat_swa", "se_hybrid_se"])
def test_graphed_decode_is_faster_than_eager(name):
    model = build(name, torch.bfloat16)
    ids = torch.randint(1, 512, (4, 256), device="cuda")
    graph, eager = _ms_per_token(model, ids, None), _ms_per_token(model, ids, False)
    print(f"{name} tiny decode: graph {graph:.3f} ms/token, eager {eager:.3f} ms/token")
    assert graph < 0.7 * eager, (graph, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["fox", "rat", "rattention"])
def test_fused_backbone_in_the_graphed_step(name, dtype):
    """With fused_decode on (Liger's norm and SwiGLU, and the per-head norm kernels, inside the static
    step): the graph still replays the static step exactly, and stays as exact as the eager path
    against the uncached forward."""
    pytest.importorskip("liger_kernel")
    from hf_hybrid.layers import backbone_fusion

    model = build(name, dtype)
    prompt, new = 77, 40
    ids = torch.randint(1, 512, (3, prompt), device="cuda")
    eager_ids, eager_logits, _ = run(model, ids, False, new)
    previous = backbone_fusion._fused_decode
    backbone_fusion.set_backbone_fusion(True, fused_decode=True)
    try:
        graph_ids, graph_logits, report = run(model, ids, True, new)
        static_ids, static_logits, _ = run(model, ids, "eager", new)
    finally:
        backbone_fusion._fused_decode = previous
    assert report["graph_captured"] and report["static_steps"] == new - 1, report
    assert first_mismatch(graph_ids, static_ids, prompt) == new and float((graph_logits - static_logits).abs().max()) == 0.0
    err_graph = uncached_error(model, graph_ids, graph_logits, prompt)
    err_eager = uncached_error(model, eager_ids, eager_logits, prompt)
    assert err_graph <= 1.5 * err_eager + (1e-4 if dtype == torch.float32 else 5e-3), (err_graph, err_eager)
