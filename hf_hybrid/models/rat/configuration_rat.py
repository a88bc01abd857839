"""Configuration of RAT models (RAT paper, Sec. 2.3 and 3.1; defaults follow its 1.3B model)."""
from __future__ import annotations

from ...compat import CACHE_NAME
from ..configuration_backbone import HybridBackboneConfig
from ..validation import ArchitectureLayerTypes, check_layer_types, check_positive

RAT_LAYER_TYPES = ("rat", "sliding_attention", "full_attention")


class RatConfig(ArchitectureLayerTypes, HybridBackboneConfig):
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
    The backbone's fields (sizes, norm, RoPE base ``rope_theta``, the MLP) are ``HybridBackboneConfig``'s.
    """

    model_type = "rat"
    allowed_layer_types = RAT_LAYER_TYPES
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    def __init__(
        self,
        chunk_size: int = 16,
        num_qk_groups: int = 2,
        sliding_window: int = 1024,
        layer_types: list[str] | None = None,
        use_rope: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive("chunk_size", chunk_size)
        check_positive("num_qk_groups", num_qk_groups)
        check_positive("sliding_window", sliding_window)
        if self.num_attention_heads % num_qk_groups:
            raise ValueError(
                f"num_qk_groups ({num_qk_groups}) must divide num_attention_heads ({self.num_attention_heads})."
            )
        if use_rope and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE; set use_rope=False for NoPE.")
        self.layer_types = check_layer_types(
            layer_types if layer_types is not None else ["rat"] * self.num_hidden_layers, RAT_LAYER_TYPES, self.num_hidden_layers
        )
        self.chunk_size = chunk_size
        self.num_qk_groups = num_qk_groups
        self.sliding_window = sliding_window
        self.use_rope = use_rope

    @staticmethod
    def hybrid_layer_types(num_hidden_layers: int, mixer: str = "rat", every: int = 1) -> list[str]:
        """The paper's interleaving (Sec. 3.1): ``mixer`` and sliding-window attention alternate in runs of
        ``every`` layers, e.g. RAT-SWA = hybrid_layer_types(n, "rat"), Attention-SWA = (n, "full_attention")."""
        return [mixer if (i // every) % 2 == 0 else "sliding_attention" for i in range(num_hidden_layers)]
