"""graph_training_layers (hf_hybrid/training/layer_graphs.py) without a GPU: the argument
signatures that key a capture, what a replay cannot take, the calls that stay eager, and the
errors. The captured graphs themselves: tests/gpu/test_layer_graphs_gpu.py."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_hybrid
from hf_hybrid.layers.context import SequenceContext
from hf_hybrid.models.rat import RatConfig
from hf_hybrid.sparse import SparseInferenceConfig
from hf_hybrid.training import layer_graphs
from hf_hybrid.training.layer_graphs import LayerGraphs, NotGraphable, decoder_layers, split_arguments

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             head_dim=16, pad_token_id=0)


def _context(batch=1, seq=8, past=0):
    return SequenceContext.build(batch, seq, past, None, None, torch.device("cpu"))


def test_signature_keys_shapes_and_plain_values_not_tensor_values():
    x, y = torch.randn(1, 8, 4, requires_grad=True), torch.randn(1, 8, 4, requires_grad=True)
    sig_x, tensors, _ = split_arguments(((x, _context()), {"mode": "full"}))
    sig_y, _, _ = split_arguments(((y, _context()), {"mode": "full"}))
    assert sig_x == sig_y and len(tensors) == 2  # the hidden states and the context's positions
    assert split_arguments(((x.detach(), _context()), {"mode": "full"}))[0] != sig_x  # requires_grad
    assert split_arguments(((torch.randn(1, 9, 4, requires_grad=True), _context(seq=9)), {"mode": "full"}))[0] != sig_x
    assert split_arguments(((x, _context()), {"mode": "se"}))[0] != sig_x
    assert split_arguments(((x, _context(past=4)), {"mode": "full"}))[0] != sig_x
    pattern = SparseInferenceConfig(dilation=4)
    assert split_arguments(((x,), {"sparse_config": pattern}))[0] == split_arguments(((y,), {"sparse_config": SparseInferenceConfig(dilation=4)}))[0]
    assert split_arguments(((x,), {"sparse_config": pattern}))[0] != split_arguments(((x,), {"sparse_config": SparseInferenceConfig(dilation=8)}))[0]


def test_rebuild_puts_new_tensors_in_the_same_places():
    x, cos, sin = torch.randn(1, 8, 4), torch.randn(8, 2), torch.randn(8, 2)
    value = ((x, _context(past=3)), {"position_embeddings": (cos, sin), "flag": True})
    _, tensors, rebuild = split_arguments(value)
    new = [t + 1 for t in tensors]
    (nx, ncontext), kwargs = rebuild(new)
    assert torch.equal(nx, x + 1) and kwargs["flag"] is True
    assert isinstance(ncontext, SequenceContext) and ncontext.past_length == 3 and ncontext.key_valid is None
    assert torch.equal(ncontext.positions, tensors[1] + 1)
    assert torch.equal(kwargs["position_embeddings"][0], cos + 1) and torch.equal(kwargs["position_embeddings"][1], sin + 1)


@pytest.mark.parametrize("value, reason", [
    (SequenceContext.build(2, 4, 0, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), None, torch.device("cpu")), "padded rows"),
    (SequenceContext.build(1, 4, 0, None, None, torch.device("cpu"), output_attentions=True), "output_attentions"),
    (DynamicCache(), "a cache"),
    ({1, 2}, "type set"),
])
def test_what_a_replay_cannot_take_is_named(value, reason):
    with pytest.raises(NotGraphable, match=reason):
        split_arguments(((torch.randn(1, 4, 2), value), {}))


def _tiny_rat():
    return AutoModelForCausalLM.from_config(RatConfig(**SHAPE, chunk_size=4))


def test_decoder_layers_found_in_ours_and_in_llama():
    model = _tiny_rat()
    assert decoder_layers(model) is model.model.layers
    llama = LlamaForCausalLM(LlamaConfig(**SHAPE))
    assert decoder_layers(llama) is llama.model.layers
    with pytest.raises(ValueError, match="no ModuleList of transformers decoder layers"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_cpu_model_and_a_bad_max_shapes_are_refused():
    with pytest.raises(ValueError, match=r"model\.cuda\(\)"):
        hf_hybrid.graph_training_layers(_tiny_rat())
    with pytest.raises(ValueError, match="max_shapes must be a positive int"):
        hf_hybrid.graph_training_layers(_tiny_rat(), max_shapes=0)


def test_off_cuda_calls_run_eagerly_equal_and_ungraph_restores_the_layers(monkeypatch):
    """With the CUDA check lifted, a CPU model's layers take the wrapper: every call runs eagerly
    (training calls say why), the results equal the plain model's, and ungraph puts the layers back."""
    monkeypatch.setattr(layer_graphs, "_check_parameters", lambda model: None)
    torch.manual_seed(0)
    plain, graphed = _tiny_rat(), _tiny_rat()
    graphed.load_state_dict(plain.state_dict())
    hf_hybrid.graph_training_layers(graphed)
    assert all("forward" in layer.__dict__ for layer in graphed.model.layers)
    ids = torch.randint(1, 64, (2, 11))
    for model in (plain, graphed):
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), graphed.parameters()):
        assert torch.equal(p.grad, q.grad), name
    report = layer_graphs.layer_graph_report(graphed)
    assert report["replays"] == 0 and report["eager_calls"] == {"the hidden states are not a CUDA tensor": 2}
    with torch.no_grad():
        graphed.eval()(input_ids=ids)
    assert layer_graphs.layer_graph_report(graphed)["eager_calls"] == report["eager_calls"]  # eval: not counted
    hf_hybrid.ungraph_training_layers(graphed)
    assert not any("forward" in layer.__dict__ for layer in graphed.model.layers)
    assert layer_graphs.layer_graph_report(graphed) is None


def test_a_layers_own_instance_forward_is_restored(monkeypatch):
    monkeypatch.setattr(layer_graphs, "_check_parameters", lambda model: None)
    model = _tiny_rat()
    own = model.model.layers[0].forward
    model.model.layers[0].forward = own  # an instance attribute, as other libraries' patches set
    hf_hybrid.graph_training_layers(model)
    assert model.model.layers[0].__dict__["forward"] is not own
    hf_hybrid.ungraph_training_layers(model)
    assert model.model.layers[0].__dict__["forward"] is own and "forward" not in model.model.layers[1].__dict__


def test_eager_reasons_of_a_training_call():
    model = _tiny_rat().train()
    graphs = LayerGraphs(model.model.layers, max_shapes=1)
    layer = model.model.layers[0]
    assert graphs._why_eager(layer, (torch.randn(1, 4, 32),)) == "the hidden states are not a CUDA tensor"
    with torch.no_grad():
        assert graphs._why_eager(layer, (torch.randn(1, 4, 32),)) == ""
    model.eval()
    assert graphs._why_eager(layer, (torch.randn(1, 4, 32),)) == ""


def test_se_attention_makes_its_chunk_size_draw_explicit():
    """SE-Attn draws a chunk size per training forward on the host; training_graph_arguments draws
    it the same way (the same value from the same generator state) and passes it as se_chunk_size."""
    from hf_hybrid.models.se_hybrid import SEHybridConfig

    config = SEHybridConfig(**SHAPE, num_key_value_heads=1, attention_mode="se", se_chunk_sizes=[8, 16],
                            se_select_every=4, se_block_size=4, se_top_k=2)
    model = AutoModelForCausalLM.from_config(config).train()
    layer = next(layer for layer in model.model.layers if hasattr(layer.self_attn, "training_graph_kwargs"))
    x, context = torch.randn(1, 8, SHAPE["hidden_size"]), _context()
    drawn = set()
    for seed in range(8):
        torch.manual_seed(seed)
        args, kwargs = layer.training_graph_arguments(x, context, None, attention_mode="se")
        torch.manual_seed(seed)
        assert kwargs == {"attention_mode": "se", "se_chunk_size": layer.self_attn._chunk_size(None, "se", cached=False)}
        assert args == (x, context, None)
        drawn.add(kwargs["se_chunk_size"])
    assert drawn == {8, 16}
    assert layer.training_graph_arguments(x, context, se_chunk_size=16)[1] == {"se_chunk_size": 16}
    model.eval()
    assert layer.training_graph_arguments(x, context)[1] == {}  # no draw outside training


EMULATED_CONFIGS = {
    "rat": lambda: RatConfig(**SHAPE, chunk_size=4),
    "rat_plus": lambda: __import__("hf_hybrid.models.rat_plus", fromlist=["RatPlusConfig"]).RatPlusConfig(
        **SHAPE, num_key_value_heads=1, chunk_size=4, training_dilations=[4]),
    "rat_plus_joint": lambda: __import__("hf_hybrid.models.rat_plus", fromlist=["RatPlusConfig"]).RatPlusConfig(
        **SHAPE, num_key_value_heads=1, chunk_size=4, training_dilations=[1, 4]),
    "se_hybrid_se": lambda: __import__("hf_hybrid.models.se_hybrid", fromlist=["SEHybridConfig"]).SEHybridConfig(
        **SHAPE, num_key_value_heads=1, attention_mode="se", se_chunk_sizes=[8, 16], se_select_every=4,
        se_block_size=4, se_top_k=2),
    "llama": lambda: LlamaConfig(**SHAPE),
}


@pytest.mark.parametrize("name", EMULATED_CONFIGS)
def test_emulated_replays_give_the_eager_steps(name, monkeypatch):
    """The bookkeeping around the graphs, with each capture's replays emulated on the CPU (the same
    static buffers, filled by running the layer): losses and accumulated gradients equal the eager
    model's over two micro-batches per step, an optimizer step between, a second shape and back.
    RAT+ runs its joint objective (one backward per pattern inside its forward); the SE hybrid draws
    a chunk size per layer and forward."""
    import copy

    monkeypatch.setattr(layer_graphs, "EMULATE", True)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(EMULATED_CONFIGS[name]()).train()
    graphed = hf_hybrid.graph_training_layers(copy.deepcopy(eager))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, graphed)]
    for step, length in enumerate((16, 16, 13, 16)):
        ids = torch.randint(1, SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(step))
        grads = []
        for model in (eager, graphed):
            torch.manual_seed(step)  # the same host draws for both
            for micro in ids.chunk(2):
                model(input_ids=micro, labels=micro, use_cache=False).loss.backward()
            grads.append([p.grad for p in model.parameters()])
        for (pname, _), a, b in zip(eager.named_parameters(), *grads):
            assert (a is None) == (b is None), pname
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {pname}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    report = layer_graphs.layer_graph_report(graphed)
    calls = SHAPE["num_hidden_layers"] * 2 * 4
    assert report["eager_calls"] == {} and report["failed_captures"] == {}, report
    # RAT+'s joint objective: a forward and a backward per pattern (two) within each forward
    assert report["replays"] == calls * (2 if name == "rat_plus_joint" else 1)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_emulated_replays_accumulate_like_eager_whatever_zero_grad_does(set_to_none, monkeypatch):
    """A parameter's .grad may be the capture's own buffer (autograd took it without a copy): three
    backward passes into it, with zero_grad between steps setting None or zeroing in place, give
    the eager model's .grad."""
    import copy

    monkeypatch.setattr(layer_graphs, "EMULATE", True)
    torch.manual_seed(0)
    eager = _tiny_rat().train()
    graphed = hf_hybrid.graph_training_layers(copy.deepcopy(eager))
    ids = torch.randint(1, SHAPE["vocab_size"], (3, 12))
    for step in range(2):
        for model in (eager, graphed):
            for micro in ids.chunk(3):
                model(input_ids=micro, labels=micro, use_cache=False).loss.backward()
        for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} {name}: {m}")
        for model in (eager, graphed):
            model.zero_grad(set_to_none=set_to_none)
    assert layer_graphs.layer_graph_report(graphed)["replays"] == SHAPE["num_hidden_layers"] * 3 * 2
