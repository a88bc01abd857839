"""Configuration of FoX (Forgetting Transformer) models; defaults follow the paper's 760M model
(Appendix B: 24 layers, hidden 1536, head dim 64, no RoPE, untied embeddings)."""
from __future__ import annotations

from transformers import PretrainedConfig

from ...compat import CACHE_NAME
from ..validation import check_kv_heads, check_positive, resolve_head_dim

FOX_BLOCK_TYPES = ("llama", "pro")
FOX_FORGET_GATES = ("data_dependent", "data_independent", "fixed", "none")


class FoxConfig(PretrainedConfig):
    r"""
    Attention implementation: Forgetting Attention has no plain softmax form (the forget gates'
    decay bias c_i - c_j is added inside the kernel's tile loop), so it runs its own kernels whatever
    ``attn_implementation`` says; every implementation transformers accepts (``"eager"``,
    ``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"``) is accepted and changes nothing, and
    ``output_attentions`` gives None for every layer.

    Args:
        block_type (`str`, defaults to ``"pro"``): ``"llama"`` (LLaMA block with RoPE replaced by the
            forget gate) or ``"pro"`` (QK-norm, KV-shift, output gate and per-head output RMSNorm,
            Appendix A). ``qk_norm``, ``kv_shift``, ``output_gate`` and ``output_norm`` default to the
            block's choice (all on for ``"pro"``, all off for ``"llama"``); set them for ablations.
        forget_gate (`str`, defaults to ``"data_dependent"``): f = sigmoid(w_f x + b_f) per head;
            ``"data_independent"`` f = sigmoid(b) learnable, ``"fixed"`` the same frozen (ALiBi),
            ``"none"`` f = 1 (the Transformer baselines, with ``use_rope=True``).
        forget_gate_t_min / forget_gate_t_max (`float`, 2 and 256): Appendix D initialisation of the
            data-independent and fixed gates (decay time scales spread geometrically over heads;
            (2, 256) equals ALiBi's default slopes). The data-dependent gate's bias starts at 0.
        use_rope (`bool`, defaults to False): FoX needs no positional embedding; True adds RoPE with
            ``rope_theta`` (500000, the paper's Transformer baseline).
        num_key_value_heads (`int`, defaults to num_attention_heads): grouped-query attention.
        qk_norm_eps (`float`, defaults to ``rms_norm_eps``): epsilon of the per-head QK-norm (the
            official FoX code and FLA use 1e-5 there and ``norm_eps`` elsewhere; checkpoints
            converted from them keep both).
        kernel_backend (`str`, defaults to ``"auto"``): Forgetting Attention backend (``"auto"``:
            Triton on CUDA, reference on CPU; ``"reference"``; ``"triton"``).
    """

    model_type = "fox"
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1536,
        intermediate_size: int = 4096,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 24,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        block_type: str = "pro",
        qk_norm: bool | None = None,
        kv_shift: bool | None = None,
        output_gate: bool | None = None,
        output_norm: bool | None = None,
        forget_gate: str = "data_dependent",
        forget_gate_t_min: float = 2.0,
        forget_gate_t_max: float = 256.0,
        use_rope: bool = False,
        rope_theta: float = 500000.0,
        max_position_embeddings: int = 16384,
        rms_norm_eps: float = 1e-6,
        qk_norm_eps: float | None = None,
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
        if block_type not in FOX_BLOCK_TYPES:
            raise ValueError(f"block_type must be one of {FOX_BLOCK_TYPES}, got {block_type!r}.")
        if forget_gate not in FOX_FORGET_GATES:
            raise ValueError(f"forget_gate must be one of {FOX_FORGET_GATES}, got {forget_gate!r}.")
        if not 0 < forget_gate_t_min <= forget_gate_t_max:
            raise ValueError(
                f"forget_gate_t_min ({forget_gate_t_min}) and forget_gate_t_max ({forget_gate_t_max}) must satisfy "
                "0 < forget_gate_t_min <= forget_gate_t_max."
            )
        if kernel_backend not in ("auto", "reference", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'reference' or 'triton', got {kernel_backend!r}.")
        self.head_dim = resolve_head_dim(hidden_size, num_attention_heads, head_dim)
        num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        check_kv_heads(num_attention_heads, num_key_value_heads)
        if use_rope and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE; set use_rope=False.")
        pro = block_type == "pro"
        self.block_type = block_type
        self.qk_norm = pro if qk_norm is None else bool(qk_norm)
        self.kv_shift = pro if kv_shift is None else bool(kv_shift)
        self.output_gate = pro if output_gate is None else bool(output_gate)
        self.output_norm = pro if output_norm is None else bool(output_norm)
        self.forget_gate = forget_gate
        self.forget_gate_t_min = float(forget_gate_t_min)
        self.forget_gate_t_max = float(forget_gate_t_max)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.use_rope = use_rope
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.qk_norm_eps = rms_norm_eps if qk_norm_eps is None else float(qk_norm_eps)
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
