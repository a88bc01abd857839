"""benchmarks/llama_projections.py: transformers' Llama with its projections through
project_few_rows (the generate() benchmark's ``llama_projections`` baseline), on the CPU: the
few-row kernel in Triton's interpreter (float32), compared with the unpatched model."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from benchmarks import llama_projections
from benchmarks.llama_projections import apply_few_row_projections_to_llama
from hf_hybrid.kernels._backend import triton_interpreting
from hf_hybrid.layers import projections
from hf_hybrid.compat import CACHE_NAME

needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or triton_interpreting()),
                                  reason="needs CUDA or TRITON_INTERPRET=1")
LAYERS, VOCAB, STEPS = 2, 128, 2


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         vocab_size=VOCAB, num_hidden_layers=LAYERS, max_position_embeddings=64, pad_token_id=0,
                         initializer_range=0.2)  # decisive logits: greedy tokens far from ties
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(unpatched, patched): the same weights."""
    plain = tiny_llama()
    return plain, apply_few_row_projections_to_llama(copy.deepcopy(plain))


@pytest.fixture
def kernel_on(monkeypatch) -> None:
    """The few-row kernel forced on (Triton's interpreter on CPU)."""
    monkeypatch.setattr(projections, "FEW_ROW_BACKEND", "triton")


@pytest.fixture
def kernel_calls(monkeypatch, kernel_on) -> list[int]:
    """kernel_on, and the list gets each launch's weight count (eager only: Dynamo would guard on its length)."""
    calls = []
    original = projections.few_row_linear
    monkeypatch.setattr(projections, "few_row_linear", lambda *a: calls.append(len(a[1])) or original(*a))
    return calls


def make_cache(kind: str, model):
    return DynamicCache() if kind == "dynamic" else StaticCache(config=model.config, max_cache_len=16)


def greedy_logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits [batch, steps + 1, vocab] of a prefill and STEPS greedy decode steps into ``cache``."""
    logits = []
    with torch.no_grad():
        for _ in range(STEPS + 1):
            last = model(ids, **{CACHE_NAME: cache}).logits[:, -1]
            logits.append(last)
            ids = last.argmax(-1, keepdim=True)
    return torch.stack(logits, 1)


PROMPT = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


@needs_kernel
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_kernel_decode_matches_unpatched_logits(models, kernel_calls, monkeypatch, cache):
    plain, patched = models
    groups = []
    real = llama_projections.project_few_rows
    monkeypatch.setattr(llama_projections, "project_few_rows", lambda x, p: groups.append(len(p)) or real(x, p))
    expected = greedy_logits(plain, PROMPT, make_cache(cache, plain))
    got = greedy_logits(patched, PROMPT, make_cache(cache, patched))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    forwards = STEPS + 1
    # Per layer and forward: q/k/v together, o_proj, gate/up together, down_proj.
    assert groups == [3, 1, 2, 1] * LAYERS * forwards
    # The prefill's 10 rows and the steps' 2 are few: one launch for q/k/v and one for gate/up each.
    assert kernel_calls.count(3) == kernel_calls.count(2) == LAYERS * forwards, kernel_calls
    # o_proj and down_proj: the kernel's to take or leave (projections.SINGLE_WEIGHT_KERNEL), but both or neither.
    assert kernel_calls.count(1) in (0, 2 * LAYERS * forwards), kernel_calls


def test_kernel_off_is_bit_identical(models):
    """The default backend on CPU tensors: project_few_rows calls the modules, as transformers does."""
    plain, patched = models
    assert projections.FEW_ROW_BACKEND == "auto"
    assert apply_few_row_projections_to_llama(patched) is patched  # patching again changes nothing
    expected = greedy_logits(plain, PROMPT, DynamicCache())
    assert torch.equal(greedy_logits(patched, PROMPT, DynamicCache()), expected)


@needs_kernel
def test_generate_gives_the_unpatched_tokens(models, kernel_calls):
    plain, patched = models
    kwargs = dict(attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = plain.generate(PROMPT, **kwargs)
        got = patched.generate(PROMPT, **kwargs)
    assert kernel_calls and got.sequences.shape == (2, PROMPT.shape[1] + 4)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(expected.logits, 1), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_static_decode_step_compiles_fullgraph_with_the_kernel_op(models, kernel_on):
    """What generate() compiles for a static cache: the decode step, one graph holding the custom op."""
    plain, patched = models
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    expected = greedy_logits(plain, PROMPT, make_cache("static", plain))
    cache = make_cache("static", patched)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend=record)
    with torch.no_grad():
        last = patched(PROMPT, **{CACHE_NAME: cache}).logits[:, -1]  # the prefill stays eager, as in generate()
        steps = []
        for _ in range(2):
            last = compiled(last.argmax(-1, keepdim=True), **{CACHE_NAME: cache}).logits[:, -1]
            steps.append(last)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.stack(steps, 1), expected[:, 1:3], rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1  # the second step reuses the first one's graph
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert sum(t.startswith("hf_hybrid.few_row_linear") for t in targets) >= 2 * LAYERS, targets


def test_rejects_models_that_are_not_llama():
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                               intermediate_size=64, vocab_size=VOCAB, num_hidden_layers=1))
    with pytest.raises(TypeError, match="expected a transformers Llama model"):
        apply_few_row_projections_to_llama(mistral)
    with pytest.raises(TypeError, match="expected a transformers Llama model"):
        apply_few_row_projections_to_llama(torch.nn.Linear(4, 4))
    assert "forward" not in vars(mistral.model.layers[0].self_attn)  # nothing patched


def test_rejects_a_llama_attention_forward_it_does_not_reproduce(monkeypatch):
    from transformers.models.llama import modeling_llama

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        return self.o_proj(hidden_states), None  # not the forward the patch follows

    model = tiny_llama()
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    with pytest.raises(RuntimeError, match="LlamaAttention.forward is not the code this patch reproduces"):
        apply_few_row_projections_to_llama(model)
    assert "forward" not in vars(model.model.layers[0].self_attn)


def test_rejects_a_module_with_a_forward_of_its_own():
    """accelerate's hooks (device_map, offloading) install a per-instance forward: ours would drop them."""
    model = tiny_llama()
    hooked = model.model.layers[1].mlp
    hooked.forward = lambda x: x
    with pytest.raises(RuntimeError, match="already has a per-instance forward"):
        apply_few_row_projections_to_llama(model)
