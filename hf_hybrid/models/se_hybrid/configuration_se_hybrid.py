"""Configuration of SE-Attn hybrid models: Mamba-2 layers + attention layers with Span-Expanded
Attention (Expansion Span, Sec. 3-4; defaults follow its Mamba-2-Hybrid fine-tuning recipe)."""
from __future__ import annotations

from ...kernels.span_expanded_attention import MODES
from ...compat import CACHE_NAME
from ..configuration_backbone import HybridBackboneConfig
from ..validation import ArchitectureLayerTypes, check_layer_types, check_positive

SE_HYBRID_LAYER_TYPES = ("mamba", "attention")
# transformers >= 5.17 renames the legacy hybrid names (mamba -> linear_attention, attention ->
# full_attention) inside PretrainedConfig; we accept both spellings and store ours.
_CANONICAL = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def canonical_layer_type(layer_type: str) -> str:
    """"mamba" or "attention" for either spelling (raises KeyError on anything else)."""
    return _CANONICAL[layer_type]
SE_ATTENTION_MODES = MODES


def default_layer_types(num_hidden_layers: int, attention_every: int = 4) -> list[str]:
    """Mostly Mamba-2 with one attention layer per ``attention_every`` (index 1, 5, 9, ...); at least one."""
    types = ["attention" if i % attention_every == 1 else "mamba" for i in range(num_hidden_layers)]
    if "attention" not in types:
        types[-1] = "attention"
    return types


class SEHybridConfig(ArchitectureLayerTypes, HybridBackboneConfig):
    r"""
    A Mamba-2 hybrid causal LM whose attention layers can run as full attention or Span-Expanded
    Attention (SE-Attn) and its ablations.

    Attention implementation (``attn_implementation=`` of from_pretrained / from_config, or
    ``model.set_attn_implementation``): attention layers in ``full`` mode go through transformers'
    attention interface (``"eager"``, ``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"``; see
    ``hf_hybrid.layers.attention``). The SE modes (``se``, ``swa``, ``se_nomem``, ``se_random``: chunked
    attention with retrieved memory blocks) and the Mamba-2 layers have no plain softmax form and run
    their own ops whatever is chosen; ``output_attentions`` gives None for them.

    Args:
        layer_types (`list[str]`): per layer ``"mamba"`` (alias ``"linear_attention"``) (transformers' Bamba Mamba-2 mixer: in_proj,
            conv1d, SSM scan, gated RMSNorm, out_proj) or ``"attention"`` (alias ``"full_attention"``). Default: one attention layer
            in four (at least one).
        attention_mode (`str`, defaults to ``"full"``): how attention layers attend, one of ``full``,
            ``se``, ``swa``, ``se_nomem``, ``se_random`` (see ``hf_hybrid.kernels.span_expanded_attention``).
            Also a forward / generate keyword. The paper fine-tunes with ``se`` and evaluates with ``full``.
        se_chunk_sizes (`list[int]`, defaults to ``[2048, 4096]``): in training forwards without a cache
            each attention layer draws its chunk size M from this list (Sec. 4.2: random chunk sizes
            regularise; we draw per layer, reading "the same chunk sizes at each layer ... suboptimal").
        se_eval_chunk_size (`int`, *optional*): the fixed M outside training and when decoding with a
            cache; defaults to the largest of ``se_chunk_sizes``. Forward keyword ``se_chunk_size``
            overrides both.
        se_block_size (`int`, defaults to 32): S, tokens per memory block.
        se_top_k (`int`, defaults to 8): k, memory blocks retrieved.
        se_select_every (`int`, defaults to 128): G, queries sharing one retrieval decision (must divide
            every chunk size); each group ranks blocks with its chunk's queries up to its first query, so
            nothing depends on future tokens (see the kernel's docstring).
        se_random_seed (`int`, defaults to 0): seed of ``se_random``'s block draw.
        sliding_window (`int`, *optional*): keys seen per query in ``swa`` mode (the token itself
            included); defaults to the largest chunk size (the paper pairs SW 4096 with M in {2048, 4096}).
        partial_rotary_factor (`float`, defaults to 1.0): fraction of head_dim rotated by RoPE (Bamba: 0.5).
        attention_bias (`bool`, defaults to False): biases on q/k/v/o projections.
        mamba_n_heads, mamba_d_head, mamba_d_state, mamba_d_conv, mamba_expand, mamba_n_groups,
        mamba_chunk_size, mamba_conv_bias, mamba_proj_bias, time_step_limit, mamba_hidden_act: the Mamba-2
            mixer's settings, with Bamba's names; ``mamba_n_heads`` defaults to
            mamba_expand * hidden_size / mamba_d_head.
        kernel_backend (`str`, defaults to ``"auto"``): backend of the SE-Attn op.
    The backbone's fields (sizes, norm, RoPE base ``rope_theta``, the MLP's ``mlp_type`` / ``hidden_act``
    / ``mlp_bias``) are ``HybridBackboneConfig``'s.
    """

    model_type = "se_hybrid"
    allowed_layer_types = SE_HYBRID_LAYER_TYPES
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    def __init__(
        self,
        layer_types: list[str] | None = None,
        attention_mode: str = "full",
        se_chunk_sizes: list[int] | tuple[int, ...] = (2048, 4096),
        se_eval_chunk_size: int | None = None,
        se_block_size: int = 32,
        se_top_k: int = 8,
        se_select_every: int = 128,
        se_random_seed: int = 0,
        sliding_window: int | None = None,
        partial_rotary_factor: float = 1.0,
        attention_bias: bool = False,
        mamba_n_heads: int | None = None,
        mamba_d_head: int = 64,
        mamba_d_state: int = 128,
        mamba_d_conv: int = 4,
        mamba_expand: int = 2,
        mamba_n_groups: int = 1,
        mamba_chunk_size: int = 256,
        mamba_conv_bias: bool = True,
        mamba_proj_bias: bool = False,
        time_step_limit: tuple[float, float] | list[float] | None = (0.0, float("inf")),
        mamba_hidden_act: str = "silu",
        **kwargs,
    ):
        super().__init__(**kwargs)
        hidden_size, num_hidden_layers = self.hidden_size, self.num_hidden_layers
        for name, value in (
            ("se_block_size", se_block_size), ("se_select_every", se_select_every), ("mamba_d_head", mamba_d_head),
            ("mamba_d_state", mamba_d_state), ("mamba_d_conv", mamba_d_conv), ("mamba_expand", mamba_expand),
            ("mamba_n_groups", mamba_n_groups), ("mamba_chunk_size", mamba_chunk_size),
        ):
            check_positive(name, value)
        check_positive("se_top_k", se_top_k, allow_zero=True)
        if mamba_hidden_act not in ("silu", "swish"):
            raise ValueError(f"mamba_hidden_act must be 'silu' (or 'swish'), the Mamba-2 conv's activation; got {mamba_hidden_act!r}.")
        if attention_mode not in SE_ATTENTION_MODES:
            raise ValueError(f"attention_mode={attention_mode!r} is not one of {list(SE_ATTENTION_MODES)}.")
        se_chunk_sizes = [int(m) for m in se_chunk_sizes]
        if not se_chunk_sizes:
            raise ValueError("se_chunk_sizes must list at least one chunk size, e.g. [2048, 4096].")
        for m in se_chunk_sizes:
            check_positive("se_chunk_sizes entries", m)
            if m % se_select_every:
                raise ValueError(
                    f"se_select_every ({se_select_every}) must divide every entry of se_chunk_sizes ({se_chunk_sizes})."
                )
        se_eval_chunk_size = max(se_chunk_sizes) if se_eval_chunk_size is None else se_eval_chunk_size
        check_positive("se_eval_chunk_size", se_eval_chunk_size)
        if se_eval_chunk_size % se_select_every:
            raise ValueError(f"se_select_every ({se_select_every}) must divide se_eval_chunk_size ({se_eval_chunk_size}).")
        sliding_window = max(se_chunk_sizes) if sliding_window is None else sliding_window
        check_positive("sliding_window", sliding_window)
        rotary_dim = int(self.head_dim * partial_rotary_factor)
        if not 0.0 < partial_rotary_factor <= 1.0 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor ({partial_rotary_factor}) must be in (0, 1] and give an even number of rotated "
                f"dimensions (head_dim {self.head_dim} * factor = {rotary_dim})."
            )
        mamba_n_heads = (mamba_expand * hidden_size) // mamba_d_head if mamba_n_heads is None else mamba_n_heads
        check_positive("mamba_n_heads", mamba_n_heads)
        if mamba_n_heads * mamba_d_head != mamba_expand * hidden_size:
            raise ValueError(
                f"mamba_n_heads * mamba_d_head ({mamba_n_heads} * {mamba_d_head}) must equal mamba_expand * hidden_size "
                f"({mamba_expand} * {hidden_size}); change mamba_d_head or leave mamba_n_heads unset."
            )
        if mamba_n_heads % mamba_n_groups:
            raise ValueError(f"mamba_n_groups ({mamba_n_groups}) must divide mamba_n_heads ({mamba_n_heads}).")
        layer_types = check_layer_types(
            layer_types if layer_types is not None else default_layer_types(num_hidden_layers),
            tuple(_CANONICAL),
            num_hidden_layers,
        )
        self.layer_types = [canonical_layer_type(t) for t in layer_types]
        if "attention" not in self.layer_types:
            raise ValueError("layer_types needs at least one 'attention' layer (an SE-Attn hybrid; the cache counts tokens there).")

        self.attention_mode = attention_mode
        self.se_chunk_sizes = se_chunk_sizes
        self.se_eval_chunk_size = se_eval_chunk_size
        self.se_block_size = se_block_size
        self.se_top_k = se_top_k
        self.se_select_every = se_select_every
        self.se_random_seed = se_random_seed
        self.sliding_window = sliding_window
        self.partial_rotary_factor = partial_rotary_factor
        self.attention_bias = attention_bias
        self.mamba_n_heads = mamba_n_heads
        self.mamba_d_head = mamba_d_head
        self.mamba_d_state = mamba_d_state
        self.mamba_d_conv = mamba_d_conv
        self.mamba_expand = mamba_expand
        self.mamba_n_groups = mamba_n_groups
        self.mamba_chunk_size = mamba_chunk_size
        self.mamba_conv_bias = mamba_conv_bias
        self.mamba_proj_bias = mamba_proj_bias
        self.time_step_limit = tuple(time_step_limit) if time_step_limit is not None else None
        self.mamba_hidden_act = mamba_hidden_act
        self.layer_types = [canonical_layer_type(t) for t in self.layer_types]  # undo transformers' renaming
