"""The backbone fields every hf-hybrid architecture shares, in one config base class.

Every model is ``embed_tokens -> N x DecoderLayer(mixer, MLP) -> norm -> lm_head``
(``hf_hybrid.layers.backbone``); only the token mixer differs. The fields of that shared part
(sizes, norm, RoPE base, embeddings, token ids, the feed-forward block) live here, each
architecture's config adds only its mixer's fields. The names and meanings are Llama's, so a
saved ``config.json`` has the keys it always had.
"""
from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from .validation import check_kv_heads, check_positive, resolve_head_dim

# "gated": down_proj(act(gate_proj(x)) * up_proj(x)) (SwiGLU with act "silu", Llama's block);
# "plain": down_proj(act(up_proj(x))), the two-layer MLP of GPT-2 and of the RAT / RAT+ authors' code.
MLP_TYPES = ("gated", "plain")

# The shared fields and their defaults; an architecture changes a default through ``backbone_defaults``.
BACKBONE_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=None,
    head_dim=None,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    use_cache=True,
    tie_word_embeddings=False,
    mlp_type="gated",
    hidden_act="silu",
    mlp_bias=False,
    kernel_backend="auto",
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
)


class HybridBackboneConfig(PretrainedConfig):
    r"""
    Fields of the shared backbone (Llama's names and meanings):

    Args:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads: sizes.
        num_key_value_heads (`int`, *optional*): grouped-query attention; defaults to
            ``default_num_key_value_heads(num_attention_heads)`` (all heads unless the architecture says otherwise).
        head_dim (`int`, *optional*): defaults to hidden_size // num_attention_heads.
        rope_theta (`float`): RoPE base. max_position_embeddings (`int`): the longest position trained.
        rms_norm_eps (`float`, defaults to 1e-6): eps of every RMSNorm of the backbone.
        initializer_range (`float`, defaults to 0.02): std of the normal initialisation.
        use_cache, tie_word_embeddings, pad_token_id, bos_token_id, eos_token_id: as in transformers.
        mlp_type (`str`, defaults to ``"gated"``): the feed-forward block. ``"gated"``:
            down_proj(act(gate_proj(x)) * up_proj(x)) (SwiGLU with ``hidden_act="silu"``); ``"plain"``:
            down_proj(act(up_proj(x))), the two-layer MLP of the RAT / RAT+ authors' models
            (``hidden_act="gelu"``, intermediate_size = 4 * hidden_size, no bias).
        hidden_act (`str`, defaults to ``"silu"``): the MLP's activation, any name of transformers'
            ``ACT2FN`` (``"gelu"`` is the exact erf GELU, ``"gelu_pytorch_tanh"`` the tanh approximation).
        mlp_bias (`bool`, defaults to False): biases on the MLP's projections.
        kernel_backend (`str`, defaults to ``"auto"``): backend of the architecture's ops, one of
            ``kernel_backends`` when the architecture lists them.
    """

    backbone_defaults: ClassVar[dict] = {}  # an architecture's own defaults for the shared fields
    kernel_backends: ClassVar[tuple[str, ...] | None] = None  # the kernel_backend values an architecture accepts

    def __init__(self, **kwargs):
        values = {**BACKBONE_DEFAULTS, **self.backbone_defaults}
        for name in values:
            if name in kwargs:
                values[name] = kwargs.pop(name)
        for name in ("num_hidden_layers", "vocab_size", "intermediate_size"):
            check_positive(name, values[name])
        self.head_dim = resolve_head_dim(values["hidden_size"], values["num_attention_heads"], values["head_dim"])
        num_key_value_heads = values["num_key_value_heads"]
        if num_key_value_heads is None:
            num_key_value_heads = self.default_num_key_value_heads(values["num_attention_heads"])
        check_kv_heads(values["num_attention_heads"], num_key_value_heads)
        if values["mlp_type"] not in MLP_TYPES:
            raise ValueError(f"mlp_type must be one of {MLP_TYPES}, got {values['mlp_type']!r}.")
        if values["hidden_act"] not in ACT2FN:
            raise ValueError(f"hidden_act {values['hidden_act']!r} is not an activation of transformers' ACT2FN "
                             "(e.g. 'silu', 'gelu', 'gelu_pytorch_tanh').")
        if self.kernel_backends is not None and values["kernel_backend"] not in self.kernel_backends:
            raise ValueError(f"kernel_backend must be one of {self.kernel_backends}, got {values['kernel_backend']!r}.")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "rope_theta", "max_position_embeddings", "rms_norm_eps", "initializer_range", "use_cache",
                     "mlp_type", "hidden_act", "kernel_backend"):
            setattr(self, name, values[name])
        self.num_key_value_heads = num_key_value_heads
        self.mlp_bias = bool(values["mlp_bias"])
        super().__init__(
            pad_token_id=values["pad_token_id"],
            bos_token_id=values["bos_token_id"],
            eos_token_id=values["eos_token_id"],
            tie_word_embeddings=values["tie_word_embeddings"],
            **kwargs,
        )

    @staticmethod
    def default_num_key_value_heads(num_attention_heads: int) -> int:
        """num_key_value_heads when the config does not give it: every head its own k/v."""
        return num_attention_heads
