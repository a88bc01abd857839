"""Configuration of RATTENTION local-global models (RATTENTION paper Sec. 3.3; defaults follow its
3B model, Fig. 3: hidden 2048, 56 layers, 16 query / 4 key-value heads of 128, [local x 3, global])."""
from __future__ import annotations

from ...kernels.residual_linear_attention.reference import FEATURE_MAPS
from ...compat import CACHE_NAME
from ..configuration_backbone import HybridBackboneConfig
from ..validation import ArchitectureLayerTypes, check_layer_types

RATTENTION_LAYER_TYPES = ("local", "global")
RATTENTION_BACKENDS = ("auto", "reference", "chunked", "triton")


class RattentionConfig(ArchitectureLayerTypes, HybridBackboneConfig):
    r"""
    Attention implementation (``attn_implementation=`` of from_pretrained / from_config, or
    ``model.set_attn_implementation``): ``"global"`` layers go through transformers' attention
    interface (``"eager"``, ``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"``; see
    ``hf_hybrid.layers.attention``). ``"local"`` layers (SWA + residual linear attention, summed after
    per-branch norms) have no plain softmax form and run their own ops whatever is chosen;
    ``output_attentions`` gives None for them.

    Args:
        window_size (`int`, defaults to 512): the paper's w. A local layer's sliding-window attention
            lets query i see keys j with 0 <= i - j <= w (the token plus w to its left); its residual
            linear attention reads the tokens j <= i - w - 1. ``-1`` drops the window: pure linear
            attention (the Fig. 4 point); ``0`` keeps only the token itself in the window.
            (transformers' ``sliding_window`` counts the token itself, so it would be w + 1.)
        layer_types (`list[str]`): per layer ``"local"`` (SWA + RLA) or ``"global"`` (full attention,
            no RoPE). Defaults to [local, local, local, global] repeated (``default_layer_types``).
        feature_map (`str`, defaults to ``"softmax"``): RLA feature map phi: ``"softmax"``
            ([softmax(x), softmax(-x)], the paper's choice), ``"relu"`` or ``"identity"`` (Table 4).
        use_residual_linear_attention (`bool`, defaults to True): False gives SWA-only local layers
            (the paper's local-global SWA baselines).
        qk_norm (`bool`, defaults to True): per-head RMSNorm of q and k before attention (the SWA
            branch and global layers; the RLA reads the raw projections).
        rope_theta (`float`, defaults to 500000): RoPE base of the local layers' SWA branch.
        branch_norm_eps (`float`, defaults to 1e-8): eps of the per-head RMSNorms on the SWA and RLA
            outputs before they are summed.
        num_key_value_heads (`int`, defaults to 4 when that divides num_attention_heads, else
            num_attention_heads): grouped-query attention, shared by SWA, RLA and global layers.
        kernel_backend (`str`, defaults to ``"auto"``): ``"auto"`` (Triton RLA + Triton SWA, kernels/window_attention, on
            CUDA, the chunked PyTorch RLA + reference SWA elsewhere), ``"triton"``, ``"chunked"`` or
            ``"reference"`` (the O(T^2) oracles).
    The backbone's fields (sizes, norm, RoPE base ``rope_theta``, the MLP's ``mlp_type`` / ``hidden_act``
    / ``mlp_bias``) are ``HybridBackboneConfig``'s.
    """

    model_type = "rattention"
    allowed_layer_types = RATTENTION_LAYER_TYPES
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    backbone_defaults = dict(intermediate_size=6656, num_hidden_layers=56, rope_theta=500000.0)
    kernel_backends = RATTENTION_BACKENDS

    def __init__(
        self,
        window_size: int = 512,
        layer_types: list[str] | None = None,
        feature_map: str = "softmax",
        use_residual_linear_attention: bool = True,
        qk_norm: bool = True,
        branch_norm_eps: float = 1e-8,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < -1:
            raise ValueError(
                f"window_size must be an integer >= -1 (-1 = pure linear attention, 0 = the token itself), got {window_size!r}."
            )
        if window_size == -1 and not use_residual_linear_attention:
            raise ValueError(
                "window_size=-1 removes the sliding window, so use_residual_linear_attention=False would leave local "
                "layers with no token mixer; set window_size >= 0 or use_residual_linear_attention=True."
            )
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {feature_map!r}.")
        if not branch_norm_eps > 0:
            raise ValueError(f"branch_norm_eps must be > 0, got {branch_norm_eps!r}.")
        self.layer_types = check_layer_types(
            layer_types if layer_types is not None else self.default_layer_types(self.num_hidden_layers),
            RATTENTION_LAYER_TYPES,
            self.num_hidden_layers,
        )
        if window_size >= 0 and "local" in self.layer_types and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: the local layers' window attention uses RoPE.")
        self.window_size = window_size
        self.feature_map = feature_map
        self.use_residual_linear_attention = bool(use_residual_linear_attention)
        self.qk_norm = bool(qk_norm)
        self.branch_norm_eps = branch_norm_eps

    @staticmethod
    def default_num_key_value_heads(num_attention_heads: int) -> int:
        """The paper's grouped-query attention: 4 key/value heads when that divides the query heads."""
        return 4 if num_attention_heads % 4 == 0 else num_attention_heads

    @staticmethod
    def default_layer_types(num_hidden_layers: int, every: int = 4) -> list[str]:
        """The paper's stack: every ``every``-th layer global, the others local ([local x 3, global] for 4)."""
        return ["global" if (i + 1) % every == 0 else "local" for i in range(num_hidden_layers)]
