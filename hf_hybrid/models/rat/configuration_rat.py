"""Configuration of RAT models (RAT paper, Sec. 2.3 and 3.1; defaults follow its 1.3B model)."""
from __future__ import annotations

from transformers import PretrainedConfig

from ...compat import CACHE_NAME
from ..validation import ArchitectureLayerTypes, check_kv_heads, check_layer_types, check_positive, resolve_head_dim

RAT_LAYER_TYPES = ("rat", "sliding_attention", "full_attention")


class RatConfig(ArchitectureLayerTypes, PretrainedConfig):
    r"""
    One config class expresses the paper's four model families through ``layer_types``:

    * RAT:            every layer ``"rat"`` (chunked recurrence + inter-chunk attention)
    * Attention:      every layer ``"full_attention"`` (or ``"rat"`` with ``chunk_size=1``-like behaviour)
    * Attention-SWA:  ``"full_attention"`` and ``"sliding_attention"`` interleaved
    * RAT-SWA:        ``"rat"`` and ``"sliding_attention"`` interleaved (``RatConfig.hybrid_layer_types``)

    Attention implementation (``attn_implementation=`` of from_pretrained / from_config, or
    ``model.set_attn_implementation``): ``"sliding_attention"`` and ``"full_attention"`` layers go
    through transformers' attention interface (``"eager"``, ``"sdpa"``, ``"flex_attention"``,
    ``"flash_attention_2"``; see ``hf_hybrid.layers.attention``). ``"rat"`` layers have no plain
    softmax form (attention over chunk-end keys merged with the token's own recurrent key, chunk-index
    RoPE), so they run their own kernels whatever is chosen; ``output_attentions`` gives None for them.

    Args:
        chunk_size (`int`, defaults to 16): L, the chunk length of the intra-chunk recurrence. ``1`` gives the
            attention-like baseline, a value >= the sequence length the RNN baseline.
        num_qk_groups (`int`, defaults to 2): q/k projections are shared by groups of heads (head h uses
            group h % num_qk_groups), as in the official code; 1 shares one q/k across all heads.
        sliding_window (`int`, defaults to 1024): window of ``"sliding_attention"`` layers, counting the token
            itself (transformers' convention: key j is visible to query i iff i - j < sliding_window).
        layer_types (`list[str]`): per layer, one of ``"rat"``, ``"sliding_attention"``, ``"full_attention"``.
        use_rope (`bool`, defaults to True): False gives NoPE. RAT layers rotate by chunk index, attention
            layers by token position.
        kernel_backend (`str`, defaults to ``"auto"``): backend of the RAT ops (``"auto"``, ``"reference"``,
            ``"triton"``, see ``hf_hybrid.kernels``).
    """

    model_type = "rat"
    allowed_layer_types = RAT_LAYER_TYPES
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        intermediate_size: int = 5632,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        chunk_size: int = 16,
        num_qk_groups: int = 2,
        sliding_window: int = 1024,
        layer_types: list[str] | None = None,
        use_rope: bool = True,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        kernel_backend: str = "auto",
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        **kwargs,
    ):
        check_positive("num_hidden_layers", num_hidden_layers)
        check_positive("vocab_size", vocab_size)
        check_positive("intermediate_size", intermediate_size)
        check_positive("chunk_size", chunk_size)
        check_positive("num_qk_groups", num_qk_groups)
        check_positive("sliding_window", sliding_window)
        self.head_dim = resolve_head_dim(hidden_size, num_attention_heads, head_dim)
        num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        check_kv_heads(num_attention_heads, num_key_value_heads)
        if num_attention_heads % num_qk_groups:
            raise ValueError(
                f"num_qk_groups ({num_qk_groups}) must divide num_attention_heads ({num_attention_heads})."
            )
        if use_rope and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE; set use_rope=False for NoPE.")
        self.layer_types = check_layer_types(
            layer_types if layer_types is not None else ["rat"] * num_hidden_layers, RAT_LAYER_TYPES, num_hidden_layers
        )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.chunk_size = chunk_size
        self.num_qk_groups = num_qk_groups
        self.sliding_window = sliding_window
        self.use_rope = use_rope
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.kernel_backend = kernel_backend
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @staticmethod
    def hybrid_layer_types(num_hidden_layers: int, mixer: str = "rat", every: int = 1) -> list[str]:
        """The paper's interleaving (Sec. 3.1): ``mixer`` and sliding-window attention alternate in runs of
        ``every`` layers, e.g. RAT-SWA = hybrid_layer_types(n, "rat"), Attention-SWA = (n, "full_attention")."""
        return [mixer if (i // every) % 2 == 0 else "sliding_attention" for i in range(num_hidden_layers)]
