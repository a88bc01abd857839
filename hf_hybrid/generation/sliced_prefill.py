"""generate() at any batch the decode cache holds: the prompt's prefill runs in slices of the
sequence when the whole batch's activations would not fit beside the cache.

The slices are transformers' own: ``generation_config.prefill_chunk_size`` makes generate() run the
prompt as consecutive forwards of that many tokens, each continuing the cache the previous one
filled (``GenerationMixin._prefill``). Every cache of this package continues a non-empty cache
exactly as the one-shot prefill fills it (RAT's chunks and RAT-SWA windows, RAT+'s dilated and
dense stores, RATTENTION's window and linear state, FoX's K/V and forget sums, the SE hybrid's
blocks and Mamba-2 states in every attention mode), whatever the slice length and however it
falls against chunks, windows and left padding (tests/features/test_sliced_prefill.py). Slicing the
sequence keeps one cache of the whole batch from the first token on, so the static / CUDA-graph
decode step (graph_decode.py) takes the decode steps afterwards as after a one-shot prefill.

What this module adds is the choice (``plan_prefill_slices``), made where generate() prepares its
cache (``HybridForCausalLM._prepare_cache_for_generation`` calls
:meth:`SlicedPrefillMixin._plan_prefill_slices`):

* a user's ``prefill_chunk_size`` wins (generate(..., prefill_chunk_size=n) or the generation
  config's);
* ``generate(..., prefill_slicing=False)`` (or ``model.config.prefill_slicing = False``) turns the
  automatic choice off: one forward over the whole prompt;
* otherwise (``"auto"``, the default) on CUDA the prompt is sliced when the estimate below says the
  one-shot prefill's activations would not fit the free memory beside the decode cache; elsewhere
  (CPU, no free-memory figure) it is not sliced.

The estimate (documented, deliberately simple, in bytes; s = the model's dtype size):

    activations(rows, tokens) = rows * tokens * s * (4 * hidden + 10 * mixer_width + 4 * intermediate)
                                [+ FoX's attention over a filled cache, see with_cache_bytes]
    cache(rows)               = rows * (per_row + per_token * capacity)
    budget                    = HEADROOM * free memory

``mixer_width`` is the widest of hidden, heads x head_dim and the Mamba-2 inner width: a layer's
peak holds the residual, its norm, the mixer's projections and outputs (five to ten of that width
with the gates and the kernels' outputs) and the MLP's gate, up and product. The cache's bytes are
measured, not modelled: a fresh cache of the model's own class is filled by two one-row probe
prompts (``PROBE_TOKENS`` after the config's longest window) and its tensors counted; per_token
and per_row come from the two counts (a layer whose memory grew in steps, a doubling buffer, may
be counted high: the estimate errs towards smaller slices). The probe runs only when a cheap
bound (every layer keeping all K/V) does not already fit, and once per model, dtype and device.
The slice is the longest multiple of ``SLICE_ALIGN`` tokens that fits; ``model.last_prefill_plan``
says what was chosen and from which figures. The probe's two forwards go through the model (its
forward hooks see them). The free memory is that of ``model.device`` (a model split over several
devices is planned by its first).

Where a continuing slice takes another path than a prefill from position 0, that path keeps its
memory to the slice: FoX's attention over its cache runs SDPA over blocks of heads
(kernels/forgetting_attention/decode.py), and softmax layers run SDPA without a flex_attention
BlockMask when nothing is padded (hf_hybrid/layers/attention.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

PREFILL_SLICING_MODES = (None, "auto", False)
# Fraction of the free memory the estimate may plan for (the allocator's fragmentation, the
# kernels' workspaces, what the estimate leaves out).
HEADROOM = 0.85
# Slices are multiples of this many tokens (whole tiles of the prefill kernels, chunk ends at
# their usual places); a prompt shorter than two of them is never sliced.
SLICE_ALIGN = 256
# One-row prompt lengths of the cache probe, past the config's longest window (windowed layers
# stop growing there; a probe inside the window would count them as growing per token).
PROBE_TOKENS = (64, 192)
WINDOW_FIELDS = ("window_size", "sliding_window")


@dataclasses.dataclass(frozen=True)
class CacheFootprint:
    """Bytes of a decode cache: per_row + per_token * tokens for each row."""

    per_row: float
    per_token: float

    def bytes(self, rows: int, tokens: int) -> float:
        return rows * (self.per_row + self.per_token * tokens)


@dataclasses.dataclass
class PrefillPlan:
    """What :func:`plan_prefill_slices` chose, and from which figures (bytes)."""

    slice_tokens: int | None  # None: one forward over the whole prompt
    reason: str
    rows: int = 0
    prompt_tokens: int = 0
    free_bytes: float | None = None
    activation_bytes: float | None = None  # of the one-shot prefill
    cache_bytes: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def activation_bytes_per_token(config, dtype: torch.dtype) -> float:
    """Peak activation bytes per prompt token of one decoder layer in an inference forward (module docstring)."""
    hidden = config.hidden_size
    heads = getattr(config, "num_attention_heads", 0) * (getattr(config, "head_dim", None) or 0)
    mamba = getattr(config, "mamba_expand", 0) * hidden
    width = max(hidden, heads, mamba)
    size = torch.empty((), dtype=dtype).element_size()
    return size * (4 * hidden + 10 * width + 4 * config.intermediate_size)


def with_cache_bytes(config, rows: int, tokens: int, keys: int) -> float:
    """Extra bytes of a slice that attends over a filled cache, where a mixer's path materialises
    scores: FoX's attention over its cache runs SDPA with a float32 bias [rows, heads, tokens, keys]
    (built and masked: about three of them) on float32 copies of the keys and values, over blocks of
    heads that keep the bias near ``SDPA_BIAS_BLOCK`` elements
    (kernels/forgetting_attention/decode.py)."""
    if getattr(config, "model_type", None) != "fox":
        return 0.0
    from ..kernels.forgetting_attention.decode import SDPA_BIAS_BLOCK

    heads, dim = config.num_attention_heads, config.head_dim
    per_head = rows * tokens * keys
    if heads * per_head <= SDPA_BIAS_BLOCK:
        block_heads, bias = heads, heads * per_head
    else:
        block_heads = max(1, SDPA_BIAS_BLOCK // per_head)
        bias = min(block_heads * per_head, SDPA_BIAS_BLOCK + rows * keys)  # a block of queries when one head is too large
    return 3 * 4 * bias + (2 * 4 + 2 * 2) * rows * keys * dim * block_heads


def full_kv_footprint(config, dtype: torch.dtype) -> CacheFootprint:
    """The cache of every layer keeping all keys and values: a bound on this package's caches."""
    size = torch.empty((), dtype=dtype).element_size()
    heads = max(getattr(config, "num_key_value_heads", None) or config.num_attention_heads, config.num_attention_heads)
    per_token = config.num_hidden_layers * 2 * heads * config.head_dim * size
    return CacheFootprint(per_row=0.0, per_token=1.25 * per_token)  # + forget sums, positions, states


def prefill_bytes(rows: int, tokens: int, keys: int, per_token_activation: float, extra=None) -> float:
    """Activation bytes of a prefill slice of ``rows`` x ``tokens`` queries ending at key ``keys``
    (``extra(tokens, keys)``: what attending over a filled cache adds, counted when keys > tokens)."""
    return rows * tokens * per_token_activation + (extra(tokens, keys) if extra is not None and keys > tokens else 0.0)


def choose_slice(rows: int, prompt: int, capacity: int, per_token_activation: float, cache: CacheFootprint,
                 free_bytes: float, extra=None, align: int | None = None) -> tuple[int | None, str]:
    """The prefill's slice length in tokens (None: the whole prompt at once) for ``rows`` rows of a
    ``prompt``-token prompt whose cache grows to ``capacity`` tokens, with ``free_bytes`` free.
    ``extra(tokens, keys)``: bytes a slice of ``tokens`` queries over ``keys`` cached keys adds.
    ``align``: slices are multiples of it (default ``SLICE_ALIGN``)."""
    align = SLICE_ALIGN if align is None else align
    budget = HEADROOM * free_bytes - cache.bytes(rows, capacity)
    if prefill_bytes(rows, prompt, prompt, per_token_activation, extra) <= budget:
        return None, "the one-shot prefill fits"
    if prompt < 2 * align:
        return None, f"the prompt is shorter than two slices of {align} tokens (the estimate says it does not fit)"
    fitting = [n for n in range(align, prompt, align) if prefill_bytes(rows, n, prompt, per_token_activation, extra) <= budget]
    if not fitting:
        return align, f"not even a slice of {align} tokens fits the estimate; sliced as finely as allowed"
    return fitting[-1], "the one-shot prefill does not fit the free memory"


def free_device_memory(device: torch.device) -> float | None:
    """Bytes the next allocations on ``device`` can get: the driver's free memory plus what
    PyTorch's allocator holds unused. None off CUDA (no automatic slicing there)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def tensor_bytes(obj) -> int:
    """Bytes of the distinct storages reachable from ``obj`` (a cache layer: its attributes,
    lists, tuples, dicts and plain objects such as per-row states)."""
    seen_storage, seen_obj, total = set(), set(), 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen_storage:
                seen_storage.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, (type, torch.nn.Module)) and id(item) not in seen_obj:
            seen_obj.add(id(item))
            stack.extend(vars(item).values())
    return total


@torch.no_grad()
def probe_lengths(config) -> tuple[int, int]:
    """PROBE_TOKENS after the config's longest window (``window_size``, ``sliding_window``)."""
    window = max([w for w in (getattr(config, name, None) for name in WINDOW_FIELDS) if isinstance(w, int)] + [0])
    return tuple(window + n for n in PROBE_TOKENS)


def probe_cache_footprint(model, tokens: tuple[int, int] | None = None, mixer_kwargs: dict | None = None) -> CacheFootprint:
    """The decode cache's bytes per row and per token, from a fresh cache of the model's class
    filled by one-row prompts of two lengths (module docstring); ``mixer_kwargs``: the generation's
    mixer options (RAT+'s sparse pattern, the SE hybrid's attention mode), which shape the cache."""
    tokens = probe_lengths(model.config) if tokens is None else tokens
    counts = []
    device = model.device
    for length in tokens:
        cache = model.base_model_class.cache_class(model.config)
        ids = torch.full((1, length), 3, dtype=torch.long, device=device)
        with model._without_decode_graph():
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **(mixer_kwargs or {}))
        counts.append(sum(tensor_bytes(layer) for layer in cache.layers))
        del cache
    per_token = max(counts[1] - counts[0], 0) / (tokens[1] - tokens[0])
    return CacheFootprint(per_row=max(counts[0] - per_token * tokens[0], 0.0), per_token=per_token)


def plan_prefill_slices(model, rows: int, prompt: int, capacity: int, free_bytes: float | None,
                        mixer_kwargs: dict | None = None) -> PrefillPlan:
    """The automatic choice for a prefill of ``rows`` x ``prompt`` tokens whose cache grows to
    ``capacity`` tokens, with ``free_bytes`` free on the model's device (None: not sliced);
    ``mixer_kwargs``: the generation's mixer options (probe_cache_footprint)."""
    plan = PrefillPlan(None, "", rows=rows, prompt_tokens=prompt, free_bytes=free_bytes)
    if free_bytes is None:
        plan.reason = "no free-memory figure for this device (automatic slicing is for CUDA)"
        return plan
    config, dtype = model.config, model.dtype
    per_token = activation_bytes_per_token(config, dtype)  # one layer's peak: layers run one after another
    plan.activation_bytes = rows * prompt * per_token

    def extra(tokens, keys):
        return with_cache_bytes(config, rows, tokens, keys)

    # The bound first: most calls fit even if every layer kept all K/V, and need no probe.
    bound = full_kv_footprint(config, dtype)
    if plan.activation_bytes + bound.bytes(rows, capacity) <= HEADROOM * free_bytes:
        plan.cache_bytes = bound.bytes(rows, capacity)
        plan.reason = "the one-shot prefill fits (even if every layer kept all keys and values)"
        return plan
    footprint = _cached_footprint(model, mixer_kwargs or {})
    plan.cache_bytes = footprint.bytes(rows, capacity)
    plan.slice_tokens, plan.reason = choose_slice(rows, prompt, capacity, per_token, footprint, free_bytes, extra)
    if plan.slice_tokens is not None and plan.reason.startswith("not even"):
        logger.warning(
            f"generate(): the decode cache of {rows} rows x {capacity} tokens leaves too little memory for the prefill "
            f"by the estimate (hf_hybrid/generation/sliced_prefill.py); prefilling in slices of {plan.slice_tokens} "
            "tokens. If it runs out of memory, lower the batch or pass a smaller prefill_chunk_size."
        )
    return plan


def _cached_footprint(model, mixer_kwargs: dict) -> CacheFootprint:
    key = (model.dtype, str(model.device), model.config.num_hidden_layers, repr(sorted(mixer_kwargs.items())))
    cached = getattr(model, "_prefill_cache_footprints", None)
    if cached is None:
        cached = model._prefill_cache_footprints = {}
    if key not in cached:
        cached[key] = probe_cache_footprint(model, mixer_kwargs=mixer_kwargs)
    return cached[key]


def resolve_slicing(setting) -> bool:
    """True when the automatic choice is on for a ``prefill_slicing`` setting."""
    if setting not in PREFILL_SLICING_MODES:
        raise ValueError(
            f"prefill_slicing must be one of {PREFILL_SLICING_MODES} (None/'auto': slice the prefill when it would not "
            f"fit beside the decode cache; False: never slice automatically), got {setting!r}."
        )
    return setting is not False


class SlicedPrefillMixin:
    """generate(..., prefill_slicing=...) (module docstring). Mixed into HybridForCausalLM, whose
    ``_prepare_cache_for_generation`` calls :meth:`_plan_prefill_slices`."""

    _prefill_slicing_setting = None
    # PrefillPlan.as_dict() of the last generate() (None when nothing was planned: a user's
    # prefill_chunk_size, slicing off, or no generate() yet).
    last_prefill_plan: dict | None = None

    def generate(self, *args, prefill_slicing=None, **kwargs):
        if prefill_slicing is None:
            prefill_slicing = getattr(self.config, "prefill_slicing", None)
        resolve_slicing(prefill_slicing)
        with _set_attribute(self, "_prefill_slicing_setting", prefill_slicing):
            return super().generate(*args, **kwargs)

    def _plan_prefill_slices(self, generation_config, model_kwargs, args: tuple, kwargs: dict) -> None:
        """Set ``generation_config.prefill_chunk_size`` (generate()'s own copy) when the automatic
        choice slices this prefill; a user's value stays. ``args`` / ``kwargs``: the rest of
        transformers' ``_prepare_cache_for_generation`` arguments (its ``batch_size`` among them)."""
        self.last_prefill_plan = None
        arguments = _prepare_cache_arguments(args, kwargs)
        if generation_config.prefill_chunk_size is not None or not resolve_slicing(self._prefill_slicing_setting):
            return
        if getattr(generation_config, "is_assistant", False) or "ASSISTED" in str(arguments.get("generation_mode", "")).upper():
            return  # assisted decoding: its cache records its past for crops; an assistant prefills draft tokens
        batch_size = arguments.get("batch_size")
        if not isinstance(batch_size, int):
            mask = model_kwargs.get("attention_mask")
            if mask is None:
                return  # no batch size to plan for
            batch_size = mask.shape[0]
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        mask = model_kwargs.get("attention_mask")
        max_length = generation_config.max_length
        prompt = mask.shape[1] if mask is not None else max_length - (generation_config.max_new_tokens or 0)
        mixer_kwargs = {k: model_kwargs[k] for k in self.model.mixer_forward_kwargs if model_kwargs.get(k) is not None}
        plan = plan_prefill_slices(self, rows, prompt, max_length, free_device_memory(self.device), mixer_kwargs)
        self.last_prefill_plan = plan.as_dict()
        if plan.slice_tokens is not None:
            generation_config.prefill_chunk_size = plan.slice_tokens


def _prepare_cache_arguments(args: tuple, kwargs: dict) -> dict:
    """The rest of transformers' ``_prepare_cache_for_generation(generation_config, model_kwargs,
    ...)`` arguments by name (``generation_mode``, ``batch_size``: positions differ across versions)."""
    from transformers import GenerationMixin

    signature = inspect.signature(GenerationMixin._prepare_cache_for_generation)
    try:
        return dict(signature.bind_partial(None, None, None, *args, **kwargs).arguments)
    except TypeError:
        return {}


@contextlib.contextmanager
def _set_attribute(obj, name: str, value):
    previous = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)


_MISSING = object()
