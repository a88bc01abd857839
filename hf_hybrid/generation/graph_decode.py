"""generate() at device speed: the whole decode step (embedding -> layers -> lm_head) captured once
in a CUDA graph and replayed for every later token.

A decode step of these models is launch-bound: a few hundred small kernels per token, each with
its Python and launch cost, which on the GPU takes longer than the kernels themselves. Replaying
a CUDA graph launches them all with one call.

What a replay can and cannot change:

* Everything that moves per token lives in device tensors: the input ids and positions (static
  buffers this module fills before each replay), slot indices, ring columns and cache lengths
  (device counters the captured kernels read and advance themselves).
* Whatever Python bookkeeping a cache layer does per token (its host token count, the views of
  its used slots) runs *outside* the graph: during capture the forward runs it once, and before
  every replay :meth:`StaticDecodeStep.run` calls each layer's ``static_decode_advance()``, which
  must do exactly the host part of one decode step.
* Buffers are preallocated at the first decode step for the whole generation
  (``prepare_static_decode(capacity, config)``, capacity = generate()'s max_length), so no step
  reallocates and the captured kernels keep reading the right memory.

A cache layer opts in by implementing ``prepare_static_decode(capacity, config) -> bool`` (True
once it can decode on fixed buffers; RATTENTION's ring, for one, only after its window filled),
``static_decode_advance()`` and ``static_decode_tensors()`` (the tensors a captured step reads or
writes; if any of them is replaced, e.g. by ``reorder_cache``, the graph is captured again).
Stacks with any other layer (transformers' DynamicLayer, say) keep the eager path.

When the path is taken (``decode_graph_reason`` says why not otherwise): inside generate() on
CUDA, one new token per row, no gradients, no left padding in the prompt (rows at different
positions take the eager path), greedy or sampling (beam search and assisted decoding stay
eager: they reorder or crop the cache every step). Opt out with
``model.generate(..., decode_cuda_graph=False)`` or ``model.config.decode_cuda_graph = False``;
``decode_cuda_graph="eager"`` runs the same static-buffer step without capturing it (debugging,
and the CPU tests of this path). ``model.last_decode_report`` says what the last generate() did.

Covered (every layer of the stack has the protocol): RAT stacks (``rat`` layers, and the
sliding-window and full attention layers of RAT-SWA / Attention-SWA: a ring of the window, K/V
preallocated with a device length, models/attention_cache.py), FoX, RATTENTION (local ring once
the window is full, global layers on preallocated K/V), RAT+ dense, dilated and top-k patterns,
one store per head group (top-k: block summaries in fixed slots, the block choice on the
device), and the SE hybrid in every attention mode (Mamba-2 states in place, attention K/V
preallocated, the SE-Attn retrieval state stacked in fixed buffers with block summaries, top-k
and masks on the device: layers/se_static_decode.py). A model vetoes a call through
``static_decode_reason``. Eager: left-padded prompts, beam search, assisted decoding.

The caches keep ``is_compileable = False`` on purpose: transformers would then wrap the forward in
torch.compile, whose own CUDA graphs would replace this module's (and trace the Triton kernels
and the host bookkeeping this design keeps outside the graph).

Around the graph, generate()'s stop check runs one step late on CUDA (deferred_stop.py), and a
step of a shape that already ran in the process is captured at once (StaticDecodeStep.prewarmed).

Timed by `python -m benchmarks.generation` against transformers' Llama with a compiled
static cache; current figures: docs/benchmarks/models.md.
"""
from __future__ import annotations

import contextlib
import time

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..compat import CACHE_NAME, cache_field, rename_cache_kwarg
from ..layers.backbone_fusion import static_decode_step
from .deferred_stop import allow_deferred_stop, stop_was_deferred, withdraw_deferred_stop

DECODE_GRAPH_MODES = (None, True, False, "eager")
# Buffers are allocated in multiples of this many tokens: keeps attention masks and key counts
# at sizes the fused SDPA kernels take without padding.
CAPACITY_ALIGN = 16


def _aligned(tokens: int) -> int:
    return -(-tokens // CAPACITY_ALIGN) * CAPACITY_ALIGN


def resolve_decode_mode(setting, device: torch.device) -> str | None:
    """The session mode for a ``decode_cuda_graph`` setting: "graph", "eager" or None (off)."""
    if setting not in DECODE_GRAPH_MODES:
        raise ValueError(f"decode_cuda_graph must be one of {DECODE_GRAPH_MODES}, got {setting!r}.")
    if setting is False:
        return None
    if setting == "eager":
        return "eager"
    if device.type != "cuda":
        if setting is True:
            raise ValueError(
                f"decode_cuda_graph=True needs the model on a CUDA device (it is on {device}); leave it unset "
                "(auto: graphs on CUDA only) or pass decode_cuda_graph='eager' for the same step without a graph."
            )
        return None
    return "graph"


def static_decode_supported(cache) -> bool:
    """True when every layer of ``cache`` implements the static decode protocol (module docstring)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(
        hasattr(layer, "prepare_static_decode") and hasattr(layer, "static_decode_advance") for layer in layers
    )


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_graph(graph: torch.cuda.CUDAGraph, fn):
    """Record ``fn()`` into ``graph`` on a side stream and return its outputs: what
    ``torch.cuda.graph`` does, without its ``torch.cuda.empty_cache()``, which handed the cached
    blocks of the prefill (gigabytes at long prompts) back to the driver once per generate(), for
    the next prefill to allocate again, and without its ``torch.cuda.synchronize()``: a capture
    launches nothing, so it can be recorded while the prefill still runs on the device (the side
    stream waits for the current one; replays run on the current stream after both). With the sync,
    the device would sit idle through every generate()'s capture."""
    device = torch.cuda.current_device()
    stream = _capture_streams.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # thread_local: CUDA work of other threads (a streamer, a data loader) does not break the capture.
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class StaticDecodeStep:
    """The decode step of one (model, cache, batch, capacity, mixer options) on static buffers,
    captured into a CUDA graph at its second use (the first, eager, warms up the kernels: Triton
    compilation and autotuning, cuBLAS handles), at its first when ``prewarmed``, or never
    (``use_graph=False``)."""

    def __init__(self, model, cache, batch: int, device: torch.device, mixer_kwargs: dict, use_graph: bool,
                 warm_key=None, warmed: set | None = None):
        self.model, self.cache, self.mixer_kwargs, self.use_graph = model, cache, mixer_kwargs, use_graph
        # ``warmed``: the model's steps that ran eagerly once in this process without replacing a
        # cache tensor, by ``warm_key`` (shapes, mixer options, prompt length). prewarmed: this one
        # did, its kernels are compiled and tuned: capture at the first step, no eager warm-up.
        self.warm_key, self.warmed = warm_key, warmed if warmed is not None else set()
        self.prewarmed = use_graph and warm_key in self.warmed
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.pointers: list[int] | None = None
        self.eager_steps = 0
        # Host time of the one-off work per generate(): the eager warm-up step and the captures
        # (the step's Python runs once during a capture); the session adds the buffers' preparation.
        self.warmup_ms = self.capture_ms = 0.0

    def _tensor_pointers(self) -> list[int]:
        return [t.data_ptr() for layer in self.cache.layers for t in layer.static_decode_tensors() if t is not None]

    def _forward(self) -> torch.Tensor:
        with static_decode_step():
            out = self.model.decode_forward_body(
                input_ids=self.input_ids, position_ids=self.position_ids, past_key_values=self.cache,
                use_cache=True, logits_to_keep=1, **self.mixer_kwargs,
            )
        return out.logits

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        if position_ids is not None:
            self.position_ids.copy_(position_ids[:, -1:])
        else:  # unpadded rows: every row's new token sits at the cache length (a fill, no host-to-device copy)
            self.position_ids.fill_(self.cache.get_seq_length())
        if not self.use_graph or (self.eager_steps == 0 and not self.prewarmed):
            first = self.eager_steps == 0
            self.eager_steps += 1
            start = time.perf_counter()
            before = self._tensor_pointers() if first else None
            logits = self._forward()
            if first:
                self.warmup_ms = 1e3 * (time.perf_counter() - start)
                if self.use_graph and self._tensor_pointers() == before:
                    self.warmed.add(self.warm_key)
            return logits
        if self.graph is not None and self._tensor_pointers() != self.pointers:
            self.graph = self.logits = None  # a cache tensor was replaced (reorder, reset): capture again
        if self.graph is None:
            # Capture records the kernels without running them; the forward's host bookkeeping
            # (one token) runs now, the replay below computes the step.
            self.graph = torch.cuda.CUDAGraph()
            before = self._tensor_pointers()
            start = time.perf_counter()  # host time: the capture overlaps the prefill still running on the device
            with torch.cuda.device(self.input_ids.device):
                self.logits = capture_graph(self.graph, self._forward)
            self.capture_ms += 1e3 * (time.perf_counter() - start)
            self.pointers = self._tensor_pointers()
            if self.pointers != before:
                # A layer swapped a cache tensor for a new one inside the step: replays would keep
                # reading the old one. A bug in that layer's static step, not a slow path to fall back to.
                raise RuntimeError(
                    f"{type(self.cache).__name__}: a layer replaced a cache tensor during the captured decode step, so "
                    "the step cannot be replayed from a CUDA graph (the cache is now one token ahead). Decode with "
                    "generate(..., decode_cuda_graph=False) and report the layer."
                )
        else:
            for layer in self.cache.layers:
                layer.static_decode_advance()
        with torch.cuda.device(self.input_ids.device):
            self.graph.replay()
        # The graph writes its output in place on the next replay: hand out a copy.
        return self.logits.clone()


class DecodeGraphSession:
    """Per generate() call: decides per forward whether the static / graphed step applies, and
    holds the one :class:`StaticDecodeStep` in use (a new one when the cache, batch, capacity or
    mixer options change)."""

    def __init__(self, model, mode: str):
        self.model, self.mode = model, mode
        self.max_length: int | None = None
        self.blocked: str | None = None  # why this generation decodes eagerly (beam search, ...)
        self.unpadded: bool | None = None
        self.step_runner: StaticDecodeStep | None = None
        self.step_key = None
        self.active = False  # True while the session's own forward runs (no re-entry)
        self.last_reason: str | None = None
        self.static_steps = 0  # decode steps run on static buffers (captured or replayed, or "eager" mode)
        self.prepare_ms = 0.0  # host time in the layers' prepare_static_decode (buffers sized to max_length)
        self.eager_decode_reasons: dict[str, int] = {}  # one-token steps that took the eager path, by reason
        self.deferred_stop_cache = None  # generate()'s cache when its stop check runs one step late (deferred_stop.py)

    def configure(self, generation_config) -> None:
        """Called by generate() once its generation config is final."""
        self.max_length = generation_config.max_length
        if getattr(generation_config, "num_beams", 1) > 1:
            self.blocked = "beam search reorders the cache every step"
        elif getattr(generation_config, "is_assistant", False) or getattr(generation_config, "prompt_lookup_num_tokens", None):
            self.blocked = "assisted decoding crops the cache"

    def _reason_not_static(self, input_ids, inputs_embeds, attention_mask, past_key_values, labels, kwargs) -> str | None:
        if self.active:
            return "inside the session's own step"
        if self.blocked:
            return self.blocked
        if torch.is_grad_enabled() or labels is not None:
            return "gradients requested"
        if input_ids is None or inputs_embeds is not None or input_ids.shape[1] != 1:
            return "not a one-token decode step"
        if past_key_values is None or past_key_values.get_seq_length() == 0:
            return "no filled cache"
        if any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states")):
            return "per-layer outputs requested"
        if self.unpadded is not True:
            return "the prompt has left padding (rows at different positions decode eagerly)"
        if self.max_length is None:
            return "no max_length known (not inside generate())"
        if past_key_values.get_seq_length() + 1 > self.max_length:
            return "past generate()'s max_length"
        if any(getattr(layer, "record_past", False) for layer in past_key_values.layers):
            return "the cache records its past for crops (assisted decoding)"
        if not static_decode_supported(past_key_values):
            return f"{type(past_key_values).__name__} has layers without a static decode step"
        # A model may veto for its own reasons (the SE hybrid: its retrieval modes).
        return self.model.static_decode_reason(kwargs)

    def note_forward(self, input_ids, inputs_embeds, attention_mask, past_key_values) -> None:
        """Record from the prefill (a forward on an empty cache) whether any row is padded: decode
        steps of generate() only append real tokens, so this holds for the whole generation."""
        if past_key_values is None or past_key_values.get_seq_length() == 0:
            self.unpadded = attention_mask is None or bool(attention_mask.all())

    def step(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, labels, kwargs):
        """Logits of one static decode step, or None (with ``last_reason`` set) when the eager path applies."""
        if not self.active:
            self.note_forward(input_ids, inputs_embeds, attention_mask, past_key_values)
        reason = self._reason_not_static(input_ids, inputs_embeds, attention_mask, past_key_values, labels, kwargs)
        self.last_reason = reason
        if reason is not None:
            self._count_eager(input_ids, reason)
            return None
        config = self.model.config
        capacity = self.capacity
        start = time.perf_counter()
        ready = all(layer.prepare_static_decode(capacity, config) for layer in past_key_values.layers)
        self.prepare_ms += 1e3 * (time.perf_counter() - start)
        if not ready:
            self.last_reason = "a cache layer is not ready for fixed buffers yet (e.g. a window still filling)"
            self._count_eager(input_ids, self.last_reason)
            return None
        mixer_kwargs = {k: kwargs[k] for k in self.model.model.mixer_forward_kwargs if kwargs.get(k) is not None}
        param = next(self.model.parameters())
        key = (id(past_key_values), input_ids.shape[0], capacity, param.dtype, param.device,
               tuple(sorted((k, repr(v)) for k, v in mixer_kwargs.items())))
        if key != self.step_key:
            # What the first step's kernels are specialised on, the cache aside (this generate()'s own).
            warm_key = (type(past_key_values).__name__, past_key_values.get_seq_length(), *key[1:])
            self.step_runner = StaticDecodeStep(
                self.model, past_key_values, input_ids.shape[0], input_ids.device, mixer_kwargs, self.mode == "graph",
                warm_key=warm_key, warmed=self.model._warmed_static_steps(),
            )
            self.step_key = key
        self.active = True
        try:
            logits = self.step_runner.run(input_ids, position_ids)
        finally:
            self.active = False
        self.static_steps += 1
        return CausalLMOutputWithPast(logits=logits, **cache_field(past_key_values))

    @property
    def capacity(self) -> int:
        """Columns of the static step's buffers: generate()'s max_length, aligned."""
        return _aligned(self.max_length)

    def capacity_to_reserve(self) -> int | None:
        """The static step's capacity when this generation may use it (known before the prefill,
        so caches can put the prompt straight into buffers of that size), else None."""
        return None if self.blocked or self.max_length is None else self.capacity

    def _count_eager(self, input_ids, reason: str) -> None:
        if input_ids is not None and input_ids.shape[1] == 1 and reason != "no filled cache":
            self.eager_decode_reasons[reason] = self.eager_decode_reasons.get(reason, 0) + 1

    def report(self) -> dict:
        """What the last generate() did: static steps, graph use, eager decode steps by reason, and
        the host time of its one-off setup (``setup_ms``: buffer preparation, warm-up step, capture)."""
        runner = self.step_runner
        return {
            "mode": self.mode,
            "static_steps": self.static_steps,
            "graph_captured": runner is not None and runner.graph is not None,
            # generate()'s stop check ran one step late (deferred_stop.py): no host wait per token.
            "deferred_stop_check": self.deferred_stop_cache is not None and stop_was_deferred(self.deferred_stop_cache),
            "eager_decode_steps": dict(self.eager_decode_reasons),
            "setup_ms": {
                "prepare": round(self.prepare_ms, 2),
                "warmup_step": round(runner.warmup_ms, 2) if runner is not None else 0.0,
                "capture": round(runner.capture_ms, 2) if runner is not None else 0.0,
            },
        }

    def release(self) -> None:
        if self.deferred_stop_cache is not None:
            withdraw_deferred_stop(self.deferred_stop_cache)
        self.step_runner = self.step_key = self.deferred_stop_cache = None

    def defer_stop_check(self, cache) -> None:
        """generate()'s own new cache, before the prefill: when this generation may decode on the
        static step (which never waits for the device), let its stop check run one step late."""
        if self.capacity_to_reserve() is not None and allow_deferred_stop(cache):
            self.deferred_stop_cache = cache


class DecodeGraphMixin:
    """generate() with the static / CUDA-graph decode step (module docstring). Mixed into
    HybridForCausalLM, whose forward asks :meth:`_static_decode_step` first."""

    _decode_graph_session: DecodeGraphSession | None = None
    _warmed_static_step_keys: set | None = None
    # DecodeGraphSession.report() of the last generate() (None when the static path was off).
    last_decode_report: dict | None = None

    def generate(self, *args, decode_cuda_graph=None, **kwargs):
        setting = decode_cuda_graph if decode_cuda_graph is not None else getattr(self.config, "decode_cuda_graph", None)
        mode = resolve_decode_mode(setting, self.device)
        rename_cache_kwarg(kwargs, CACHE_NAME)  # a cache passed under either name reaches generate() under its own
        session = DecodeGraphSession(self, mode) if mode is not None else None
        previous, self._decode_graph_session = self._decode_graph_session, session
        try:
            return super().generate(*args, **kwargs)
        finally:
            self._decode_graph_session = previous
            self.last_decode_report = session.report() if session is not None else None
            if session is not None:
                session.release()

    def _warmed_static_steps(self) -> set:
        """Static steps of this model that ran eagerly once in this process without replacing a
        cache tensor (StaticDecodeStep.prewarmed): later generate()s of that shape capture at once."""
        if self._warmed_static_step_keys is None:
            self._warmed_static_step_keys = set()
        return self._warmed_static_step_keys

    def static_decode_reason(self, forward_kwargs: dict) -> str | None:
        """Why this model's next one-token step must decode eagerly (None: the static step may run).
        ``forward_kwargs``: the forward's extra keywords (mixer options). Architectures override it."""
        return None

    def _note_generation_config(self, generation_config) -> None:
        if self._decode_graph_session is not None:
            self._decode_graph_session.configure(generation_config)

    def _reserve_static_buffers(self, cache) -> None:
        """Tell the layers of generate()'s new cache the static step's capacity before the prefill
        (cache_layer.ReservedColumnsMixin); layers without the hook size their buffers later."""
        session = self._decode_graph_session
        capacity = session.capacity_to_reserve() if session is not None else None
        if capacity is not None:
            session.defer_stop_check(cache)
            for layer in cache.layers:
                if hasattr(layer, "reserve_static_capacity"):
                    layer.reserve_static_capacity(capacity)

    def _static_decode_step(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, labels, kwargs):
        session = self._decode_graph_session
        if session is None:
            return None
        return session.step(input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, labels, kwargs)

    @contextlib.contextmanager
    def _without_decode_graph(self):
        previous, self._decode_graph_session = self._decode_graph_session, None
        try:
            yield
        finally:
            self._decode_graph_session = previous

    def decode_forward_body(self, **inputs):
        """The model's forward without the static-step dispatch (what a static step runs or captures)."""
        with self._without_decode_graph():
            return self.forward(**inputs)
