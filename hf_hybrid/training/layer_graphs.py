"""Training steps at device speed: each decoder layer's forward and backward replayed as CUDA graphs.

At moderate lengths (8K tokens, B=1, the 1.3B shape) a training step of these models issues about
4,500 PyTorch calls and 350 Triton launches; the host then takes about as long to issue them as the
GPU takes to run them, and the step time follows the host's speed. Replaying a layer's captured
forward and backward issues each with one call.

    model = AutoModelForCausalLM.from_pretrained(...).cuda()
    hf_hybrid.graph_training_layers(model)   # any transformers decoder stack, Llama's too
    ...                                       # Trainer or a plain loop, unchanged
    hf_hybrid.ungraph_training_layers(model)  # the eager layers back, the graphs' memory freed

How. The first training forward of an argument signature (shapes, dtypes, the non-tensor
arguments) runs each layer twice eagerly on a side stream (Triton compiles, lazy initialisation),
then captures its forward and its backward (``torch.autograd.grad`` over the captured forward,
keeping the captured activations) into a memory pool shared by that signature's layers. Later
calls copy the layer's tensor arguments into the captured buffers and replay; the backward copies
the incoming gradient in, replays, and hands autograd the parameter and input gradients, which it
accumulates into ``.grad`` as it does for any layer (gradient accumulation stays exact). The rest
of the step (embeddings, final norm, LM head and loss, the optimizer) runs as before.

Memory. Everything a captured layer keeps for its backward lives in the pool for as long as the
graphs do (an eager step frees it after the backward), plus one copy of the layer's inputs and
outputs; ``max_shapes`` bounds the signatures (shapes) captured per layer. A layer's output (the
hidden states ``output_hidden_states`` returns) lives in the pool: read it before the backward, since
the backward's replays may write there. The parameters' gradients leave as copies for that reason:
a caller may keep them while other layers replay (RAT+'s joint objective keeps one pass's gradients
through the next pass).

When a call runs eagerly (the same result; a reason that concerns a training call is warned once):
no gradients or eval mode (evaluation, generate()), a cache, inputs off CUDA, gradient
checkpointing or other saved-tensor hooks (offloading), torch.compile, arguments a graph cannot
take (:func:`split_arguments`), padded rows (their masks come from the mask's data on the host),
more than ``max_shapes`` signatures for one layer, a second forward of a layer before the backward of its
first (the first one's activations live in the graph's buffers), or a capture that failed.

A layer that draws something per forward on the host (SE-Attn's chunk size) makes the draw
explicit in ``training_graph_arguments(*args, **kwargs) -> (args, kwargs)``, so the signature
keys by it (one capture per drawn value).

The graphs replay the kernels of the first call: a change of a layer's configuration that its
arguments do not show (the attention implementation, a runtime switch) needs
``ungraph_training_layers`` first. Parameters replaced by new tensors (not updated in place) are
noticed, and that layer is captured again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from ..layers.context import SequenceContext

logger = logging.get_logger(__name__)

WARMUP_PASSES = 2  # eager forward + backward passes before a capture (Triton compiles, lazy init)
DEFAULT_MAX_SHAPES = 4
_ATTRIBUTE = "_hf_hybrid_layer_graphs"
# Tests set this: every model (CPU ones too) takes the wrapper, with the graphs emulated (_EmulatedGraphs).
EMULATE = False


class NotGraphable(Exception):
    """A call a captured graph cannot replay; the message says why (it runs eagerly)."""


# --- arguments: what is copied into the graph, what keys it ------------------------------------------
def split_arguments(value) -> tuple[tuple, list[torch.Tensor], Callable]:
    """(signature, tensors, rebuild) of a layer's arguments: ``signature`` keys a capture (tensor
    shapes, dtypes, strides and requires_grad, every other value as is), ``tensors`` are the values a
    replay copies in, ``rebuild(new_tensors)`` makes the same arguments around other tensors.
    Dataclasses without tensors (per-call options) key by their fields. Raises NotGraphable for what
    a replay cannot take: a cache, attention probabilities recorded into the context, padded rows,
    an unhashable object."""
    tensors: list[torch.Tensor] = []
    signature = _split(value, tensors)

    def rebuild(new_tensors):
        return _rebuild(value, iter(new_tensors))

    return signature, tensors, rebuild


def _split(value, tensors: list) -> object:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_split(v, tensors) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _split(value[k], tensors)) for k in value))
    if isinstance(value, SequenceContext):
        if value.key_valid is not None:
            raise NotGraphable("padded rows (their attention masks are built from the padding mask's data)")
        if value.output_attentions:
            raise NotGraphable("output_attentions=True (the probabilities go to the caller's context)")
        return ("context", value.past_length, _split(value.positions, tensors))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a per-call option (RAT+'s sparse_config)
        inner: list[torch.Tensor] = []
        fields = tuple((f.name, _split(getattr(value, f.name), inner)) for f in dataclasses.fields(value))
        if inner:
            raise NotGraphable(f"tensors inside a {type(value).__name__}")
        return ("dataclass", type(value), fields)
    try:
        hash(value)
    except TypeError:
        raise NotGraphable(f"an argument of type {type(value).__name__} (only tensors, plain values and hashable objects)") from None
    if hasattr(value, "get_seq_length") or hasattr(value, "update"):
        raise NotGraphable(f"a cache ({type(value).__name__})")
    return ("object", type(value), value)


def _rebuild(value, new_tensors):
    if isinstance(value, torch.Tensor):
        return next(new_tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, new_tensors) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, new_tensors) for k, v in value.items()}
    if isinstance(value, SequenceContext):
        return SequenceContext(positions=next(new_tensors), key_valid=None, past_length=value.past_length)
    return value


# --- one layer, one signature ---------------------------------------------------------------------------
@dataclass
class LayerCapture:
    forward_graph: torch.cuda.CUDAGraph
    backward_graph: torch.cuda.CUDAGraph | None  # None: no output needs a gradient
    static_inputs: tuple[torch.Tensor, ...]
    static_outputs: tuple[torch.Tensor, ...]
    output_spec: object
    params: tuple[nn.Parameter, ...]  # the trainable ones: the replay's extra inputs
    param_pointers: tuple[int, ...]
    grad_outputs: tuple[torch.Tensor | None, ...]
    # Per static input, then per parameter: the captured backward's results (None: no gradient).
    # The parameters' ones leave a replay as copies (see _Replay.backward).
    grad_inputs: tuple[torch.Tensor | None, ...]
    differentiable: tuple[bool, ...]  # per output: whether it requires grad
    pending: Callable | None = None  # weakref to the autograd node of a replay whose backward has not run
    replays: int = 0

    def awaits_backward(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def current(self, params: tuple[nn.Parameter, ...]) -> bool:
        return (len(params) == len(self.params) and all(p is q for p, q in zip(params, self.params))
                and all(p.data_ptr() == ptr for p, ptr in zip(params, self.param_pointers)))


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, capture: LayerCapture, *tensors):
        for static, given in zip(capture.static_inputs, tensors):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        capture.forward_graph.replay()
        capture.replays += 1
        capture.pending = weakref.ref(ctx)
        ctx.capture = capture
        outputs = tuple(o.detach() for o in capture.static_outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, capture.differentiable) if not d))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        capture: LayerCapture = ctx.capture
        for static, grad in zip(capture.grad_outputs, grads):
            if static is not None:
                if grad is None:
                    static.zero_()
                elif static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
        if capture.backward_graph is not None:
            capture.backward_graph.replay()
        capture.pending = None
        # A signature's layers share one pool, each captured forward then backward, while the replays
        # run every forward, then the backwards in reverse: a buffer of layer i's backward may sit in
        # memory that an earlier-captured layer's backward uses for temporaries, and that backward
        # replays after it. The parameters' gradients can be read late (autograd.grad callers keep
        # them; as .grad they would stay), so they leave as copies, which autograd takes as .grad
        # without another. The input gradient is consumed at once (by the previous layer's replay).
        inputs = len(capture.static_inputs)
        params = (None if g is None else g.clone() for g in capture.grad_inputs[inputs:])
        return (None, *capture.grad_inputs[:inputs], *params)


@contextlib.contextmanager
def _parameters_as(layer: nn.Module, aliases: dict[str, torch.Tensor]):
    """``layer``'s named parameters replaced by ``aliases`` (same storage) for the block's duration."""
    owners = []
    for name, alias in aliases.items():
        module_name, _, attr = name.rpartition(".")
        owner = layer.get_submodule(module_name) if module_name else layer
        owners.append((owner, attr, owner._parameters[attr]))
        owner._parameters[attr] = alias
    try:
        yield
    finally:
        for owner, attr, param in owners:
            owner._parameters[attr] = param


def capture_layer(layer: nn.Module, forward: Callable, tensors: list[torch.Tensor], rebuild: Callable,
                  params: tuple[nn.Parameter, ...], pool) -> LayerCapture:
    """Warm ``forward`` up on a side stream, then capture its forward and backward into ``pool``
    (``pool`` None: emulate the graphs, see :class:`_EmulatedGraphs`).

    The captured calls see each trainable parameter as an alias (a leaf tensor on the parameter's
    storage, so optimizer updates in place reach the graphs): the parameters' own autograd
    accumulators then belong to the training step's stream alone, not to a capture's graph kept
    alive on the capture stream (autograd would otherwise move their accumulation between streams)."""
    static_inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
    names = {id(p): n for n, p in layer.named_parameters()}
    aliases = {names[id(p)]: p.detach().requires_grad_() for p in params}

    def run():
        a, k = rebuild(static_inputs)
        with _parameters_as(layer, aliases):
            return forward(*a, **k)

    wanted = tuple(t for t in static_inputs if t.requires_grad) + tuple(aliases.values())
    if pool is None:
        return _EmulatedGraphs(run, wanted).capture(static_inputs, params)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_PASSES):
            outputs = [o for o in torch.utils._pytree.tree_leaves(run()) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outputs and wanted:
                torch.autograd.grad(outputs, wanted, [torch.zeros_like(o) for o in outputs], allow_unused=True)
            del outputs
    torch.cuda.current_stream().wait_stream(side)

    forward_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward_graph, pool=pool):
        flat_outputs, spec = _flat_outputs(run())
    differentiable = tuple(o.requires_grad for o in flat_outputs)
    grad_outputs = tuple(torch.zeros_like(o) if d else None for o, d in zip(flat_outputs, differentiable))
    backward_graph, results = None, [None] * len(wanted)
    if any(differentiable) and wanted:
        backward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(backward_graph, pool=pool):
            results = torch.autograd.grad(
                [o for o, d in zip(flat_outputs, differentiable) if d], wanted,
                [g for g in grad_outputs if g is not None], allow_unused=True, retain_graph=True,
            )
    return _layer_capture(forward_graph, backward_graph, static_inputs, flat_outputs, spec, params, grad_outputs, results,
                          differentiable)


def _flat_outputs(outputs) -> tuple[list[torch.Tensor], object]:
    """(the layer's outputs as a flat list of tensors, their structure)."""
    flat, spec = torch.utils._pytree.tree_flatten(outputs)
    if not all(isinstance(o, torch.Tensor) for o in flat):
        raise NotGraphable("a layer output that is not a tensor")
    return flat, spec


def _layer_capture(forward_graph, backward_graph, static_inputs, flat_outputs, spec, params, grad_outputs, results,
                   differentiable):
    by_tensor = iter(results)
    grad_inputs = tuple(
        (next(by_tensor) if t.requires_grad else None) for t in static_inputs
    ) + tuple(next(by_tensor) for _ in params)
    return LayerCapture(
        forward_graph=forward_graph, backward_graph=backward_graph, static_inputs=static_inputs,
        static_outputs=tuple(flat_outputs), output_spec=spec, params=params,
        param_pointers=tuple(p.data_ptr() for p in params), grad_outputs=grad_outputs,
        grad_inputs=tuple(None if g is None else g.detach() for g in grad_inputs),
        differentiable=tuple(differentiable),
    )


class _EmulatedGraphs:
    """A capture's replay semantics without CUDA: the same static buffers, each "replay" running the
    layer eagerly and copying its results into them. The CPU tests check the bookkeeping around the
    graphs with it (gradient accumulation, several signatures, the eager cases); what only a real
    capture can get wrong (memory shared inside the pool) is the GPU tests' part."""

    def __init__(self, run: Callable, wanted: tuple[torch.Tensor, ...]):
        self.run, self.wanted, self.live = run, wanted, None

    def capture(self, static_inputs, params) -> LayerCapture:
        flat_outputs, spec = _flat_outputs(self.run())
        self.differentiable = [o.requires_grad for o in flat_outputs]
        self.static_outputs = [o.detach().clone() for o in flat_outputs]
        self.grad_outputs = tuple(torch.zeros_like(o) if o.requires_grad else None for o in flat_outputs)
        results = torch.autograd.grad([o for o in flat_outputs if o.requires_grad], self.wanted,
                                      [g for g in self.grad_outputs if g is not None], allow_unused=True)
        self.results = [None if g is None else g.clone() for g in results]
        return _layer_capture(SimpleNamespace(replay=self.forward), SimpleNamespace(replay=self.backward), static_inputs,
                              self.static_outputs, spec, params, self.grad_outputs, self.results, self.differentiable)

    def forward(self):
        with torch.enable_grad():
            self.live = torch.utils._pytree.tree_leaves(self.run())
        for static, value in zip(self.static_outputs, self.live):
            static.copy_(value.detach())

    def backward(self):
        grads = torch.autograd.grad([o for o, d in zip(self.live, self.differentiable) if d], self.wanted,
                                    [g for g in self.grad_outputs if g is not None], allow_unused=True)
        for buffer, grad in zip(self.results, grads):
            if buffer is not None:
                buffer.copy_(grad)
        self.live = None



# --- the stack ------------------------------------------------------------------------------------------
@dataclass
class _Signature:
    pool: object
    captures: dict = field(default_factory=dict)  # layer index -> LayerCapture


class LayerGraphs:
    """The captured graphs of one model's decoder layers, by argument signature."""

    def __init__(self, layers: nn.ModuleList, max_shapes: int):
        self.layers = layers
        self.max_shapes = max_shapes
        self.signatures: dict[tuple, _Signature] = {}
        self.failed: dict[tuple, str] = {}  # signature -> why its capture failed
        self.eager_calls: dict[str, int] = {}  # reason -> training calls that ran eagerly
        self.originals: dict[int, object] = {}  # layer index -> its own instance forward, if it had one

    def replays(self) -> int:
        return sum(c.replays for s in self.signatures.values() for c in s.captures.values())

    def report(self) -> dict:
        """What the graphs did so far: signatures captured, layer replays, eager training calls by reason."""
        return {"signatures": len(self.signatures), "replays": self.replays(), "eager_calls": dict(self.eager_calls),
                "failed_captures": dict(self.failed)}

    def _eager(self, reason: str, warn: bool = True):
        self.eager_calls[reason] = self.eager_calls.get(reason, 0) + 1
        if warn and self.eager_calls[reason] == 1:
            logger.warning(f"graph_training_layers: a training call runs its layers eagerly: {reason}.")

    def call(self, index: int, layer: nn.Module, forward: Callable, args: tuple, kwargs: dict):
        reason = self._why_eager(layer, args)
        if reason is not None:
            if reason:  # "" = not a training call: nothing to report
                self._eager(reason)
            return forward(*args, **kwargs)
        settle = getattr(layer, "training_graph_arguments", None)
        if settle is not None:  # per-forward host draws made explicit, so the signature shows them
            args, kwargs = settle(*args, **kwargs)
        try:
            signature, tensors, rebuild = split_arguments((args, kwargs))
        except NotGraphable as exc:
            self._eager(str(exc))
            return forward(*args, **kwargs)
        signature = (signature, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        if signature in self.failed:
            self._eager(f"its capture failed ({self.failed[signature]})", warn=False)
            return forward(*args, **kwargs)
        entry = self.signatures.get(signature)
        capture = None if entry is None else entry.captures.get(index)
        if capture is None and sum(index in s.captures for s in self.signatures.values()) >= self.max_shapes:
            self._eager(f"a layer called with more than max_shapes={self.max_shapes} argument signatures (shapes); "
                        "pass a larger max_shapes to graph_training_layers")
            return forward(*args, **kwargs)
        if entry is None:
            entry = self.signatures[signature] = _Signature(pool=None if EMULATE else torch.cuda.graph_pool_handle())
        params = tuple(p for p in layer.parameters() if p.requires_grad)
        if capture is not None and capture.awaits_backward():
            self._eager("a second forward of a layer before the backward of its first (two forwards, one backward)")
            return forward(*args, **kwargs)
        if capture is None or not capture.current(params):
            entry.captures.pop(index, None)
            try:
                capture = entry.captures[index] = capture_layer(layer, forward, tensors, rebuild, params, entry.pool)
            except Exception as exc:  # noqa: BLE001  (any failure to capture: the layer runs eagerly, said once)
                self.failed[signature] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                logger.warning(f"graph_training_layers: capturing layer {index} failed, so calls of this shape run "
                               f"eagerly: {self.failed[signature]}")
                self.signatures.pop(signature, None)  # with the captures of the other layers: all run eagerly now
                return forward(*args, **kwargs)
        outputs = _Replay.apply(capture, *tensors, *params)
        return torch.utils._pytree.tree_unflatten(list(outputs), capture.output_spec)

    def _why_eager(self, layer: nn.Module, args: tuple) -> str | None:
        """None when the call may replay; "" for a call that is not a training step; else the reason."""
        if not (torch.is_grad_enabled() and layer.training):
            return ""
        if torch.compiler.is_compiling():
            return "inside torch.compile (it captures its own graphs)"
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if hidden is None or (hidden.device.type != "cuda" and not EMULATE):
            return "the hidden states are not a CUDA tensor"
        if getattr(layer, "gradient_checkpointing", False):
            return "gradient checkpointing is on (its recomputation runs the layer again in the backward)"
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return "saved-tensor hooks are active (activation offloading or checkpointing)"
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return "the caller is capturing a CUDA graph already"
        return None


# --- public entry points --------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The longest ModuleList of transformers decoder layers (GradientCheckpointingLayer) in ``model``."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
              and all(isinstance(layer, GradientCheckpointingLayer) for layer in m)]
    if not stacks:
        raise ValueError(f"graph_training_layers: {type(model).__name__} has no ModuleList of transformers decoder layers "
                         "(GradientCheckpointingLayer) to capture.")
    return max(stacks, key=len)


def _check_parameters(model: nn.Module) -> None:
    params = list(model.parameters())
    if not params or (any(p.device.type != "cuda" for p in params) and not EMULATE):
        raise ValueError("graph_training_layers: the model's parameters must all be on a CUDA device (CUDA graphs); "
                         "move it with model.cuda() first.")
    if any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") or type(p.data).__name__ == "DTensor" for p in params):
        raise ValueError("graph_training_layers: the parameters are sharded (FSDP or DeepSpeed ZeRO-3), whose gathers "
                         "replace them on every step; capture the layers of an unsharded model only.")


def graph_training_layers(model: nn.Module, max_shapes: int = DEFAULT_MAX_SHAPES) -> nn.Module:
    """Replay ``model``'s decoder layers as CUDA graphs in training steps (module docstring); returns
    ``model``. ``max_shapes``: argument signatures (shapes) captured per layer at most; further ones
    run eagerly."""
    if not isinstance(max_shapes, int) or max_shapes < 1:
        raise ValueError(f"graph_training_layers: max_shapes must be a positive int, got {max_shapes!r}.")
    _check_parameters(model)
    if getattr(model, _ATTRIBUTE, None) is not None:
        ungraph_training_layers(model)
    layers = decoder_layers(model)
    graphs = LayerGraphs(layers, max_shapes)
    for index, layer in enumerate(layers):
        if "forward" in layer.__dict__:
            graphs.originals[index] = layer.__dict__["forward"]
        forward = layer.forward

        def graphed(*args, _index=index, _layer=layer, _forward=forward, **kwargs):
            return graphs.call(_index, _layer, _forward, args, kwargs)

        layer.forward = graphed
    object.__setattr__(model, _ATTRIBUTE, graphs)
    return model


def ungraph_training_layers(model: nn.Module) -> nn.Module:
    """Undo :func:`graph_training_layers`: the layers' own forward back, the graphs and their memory freed."""
    graphs: LayerGraphs | None = getattr(model, _ATTRIBUTE, None)
    if graphs is None:
        return model
    for index, layer in enumerate(graphs.layers):
        if index in graphs.originals:
            layer.forward = graphs.originals[index]
        else:
            layer.__dict__.pop("forward", None)
    graphs.signatures.clear()
    object.__setattr__(model, _ATTRIBUTE, None)
    return model


def layer_graph_report(model: nn.Module) -> dict | None:
    """What :func:`graph_training_layers` did for ``model`` so far (None when it is not graphed)."""
    graphs = getattr(model, _ATTRIBUTE, None)
    return None if graphs is None else graphs.report()
