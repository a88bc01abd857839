"""Configuration of FoX (Forgetting Transformer) models; defaults follow the paper's 760M model
(Appendix B: 24 layers, hidden 1536, head dim 64, no RoPE, untied embeddings)."""
from __future__ import annotations

from ...compat import CACHE_NAME
from ..configuration_backbone import HybridBackboneConfig

FOX_BLOCK_TYPES = ("llama", "pro")
FOX_FORGET_GATES = ("data_dependent", "data_independent", "fixed", "none")


class FoxConfig(HybridBackboneConfig):
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
    The backbone's fields (sizes, norm, RoPE base ``rope_theta``, the MLP's ``mlp_type`` / ``hidden_act``
    / ``mlp_bias``) are ``HybridBackboneConfig``'s.
    """

    model_type = "fox"
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    backbone_defaults = dict(hidden_size=1536, intermediate_size=4096, num_attention_heads=24,
                             rope_theta=500000.0, max_position_embeddings=16384)
    kernel_backends = ("auto", "reference", "triton")

    def __init__(
        self,
        block_type: str = "pro",
        qk_norm: bool | None = None,
        kv_shift: bool | None = None,
        output_gate: bool | None = None,
        output_norm: bool | None = None,
        forget_gate: str = "data_dependent",
        forget_gate_t_min: float = 2.0,
        forget_gate_t_max: float = 256.0,
        use_rope: bool = False,
        qk_norm_eps: float | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if block_type not in FOX_BLOCK_TYPES:
            raise ValueError(f"block_type must be one of {FOX_BLOCK_TYPES}, got {block_type!r}.")
        if forget_gate not in FOX_FORGET_GATES:
            raise ValueError(f"forget_gate must be one of {FOX_FORGET_GATES}, got {forget_gate!r}.")
        if not 0 < forget_gate_t_min <= forget_gate_t_max:
            raise ValueError(
                f"forget_gate_t_min ({forget_gate_t_min}) and forget_gate_t_max ({forget_gate_t_max}) must satisfy "
                "0 < forget_gate_t_min <= forget_gate_t_max."
            )
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
        self.use_rope = use_rope
        self.qk_norm_eps = self.rms_norm_eps if qk_norm_eps is None else float(qk_norm_eps)
