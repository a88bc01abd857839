"""The two published FoX checkpoint formats and how their configs map onto hf-hybrid's ``FoxConfig``.

* ``official``: the FoX authors' code (model_type ``forgetting_transformer-project_fox``): LLaMA and
  Pro blocks, KV-shift as ``k_proj.linear`` + ``k_proj.shift_proj``, output gate ``ogate_proj``,
  per-head output norm ``output_norm``, forget gate ``fgate_proj`` or a per-head ``fgate_bias``,
  one SwiGLU input matrix ``mlp.gate_proj`` holding [gate; up].
* ``fla``: flash-linear-attention's ``forgetting_transformer``: the LLaMA block with optional
  QK-norm, output gate and GQA; ``f_proj`` / ``g_proj``; separate ``gate_proj`` / ``up_proj``.

Both write per-head norms (QK-norm, output norm) as one weight over all heads and build the
QK-norm with their GroupNorm's default epsilon, 1e-5, while every other norm uses ``norm_eps``.
A field we cannot represent exactly is refused with a message that names it.
"""
from __future__ import annotations

from ..models.fox import FoxConfig

OFFICIAL, FLA = "official", "fla"
MODEL_TYPES = {OFFICIAL: "forgetting_transformer-project_fox", FLA: "forgetting_transformer"}
QK_NORM_EPS = 1e-5  # GroupNorm's default in both codebases; their QK-norm is built without an eps
# official fgate_type <-> our forget_gate
FORGET_GATES = {"full": "data_dependent", "bias_only": "data_independent", "fixed": "fixed", "none": "none"}
# Fields that only choose an implementation (fused kernels, training-loss variants) or an inference
# approximation (log_pruning_tolerance prunes keys whose weight is below a tolerance: we compute the
# exact attention it approximates); they do not change the weights' function.
IGNORED_FIELDS = (
    "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp",
    "log_pruning_tolerance", "elementwise_affine",
)


class UnsupportedCheckpoint(ValueError):
    """A source field whose value hf-hybrid's fox model cannot represent exactly."""


def source_format(config: dict) -> str:
    model_type = config.get("model_type")
    for fmt, name in MODEL_TYPES.items():
        if model_type == name:
            return fmt
    raise UnsupportedCheckpoint(
        f"config.json has model_type={model_type!r}; a FoX checkpoint of the official code has "
        f"{MODEL_TYPES[OFFICIAL]!r} and one of flash-linear-attention {MODEL_TYPES[FLA]!r}."
    )


def _refuse_unless(ok: bool, field: str, value, why: str) -> None:
    if not ok:
        raise UnsupportedCheckpoint(f"{field}={value!r}: {why}")


def intermediate_size(config: dict) -> int:
    """The SwiGLU width both codebases derive when intermediate_size is unset: 2/3 of
    hidden_ratio x hidden, rounded up to a multiple of 256."""
    if config.get("intermediate_size") is not None:
        return int(config["intermediate_size"])
    ratio = config.get("hidden_ratio") or 4
    size = int(config["hidden_size"] * ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


def fox_config_from_source(config: dict) -> FoxConfig:
    """FoxConfig computing what the source config computes; refuses what it cannot represent."""
    fmt = source_format(config)
    get = config.get
    _refuse_unless(get("window_size") is None, "window_size", get("window_size"),
                   "sliding-window Forgetting Attention is not supported by hf-hybrid's fox model; "
                   "convert a checkpoint trained without a window.")
    _refuse_unless(get("hidden_act", "swish") in ("swish", "silu"), "hidden_act", get("hidden_act"),
                   "only the SwiGLU MLP (hidden_act 'swish') is supported.")
    bias_field = "attention_bias" if fmt == OFFICIAL else "qkv_bias"
    _refuse_unless(not get(bias_field, False), bias_field, get(bias_field),
                   "hf-hybrid's fox projections have no biases.")
    hidden, heads = config["hidden_size"], config["num_heads"]
    _refuse_unless(hidden % heads == 0, "num_heads", heads, f"must divide hidden_size ({hidden}).")
    gate = bool(get("use_output_gate", False))
    kwargs = dict(
        vocab_size=config["vocab_size"], hidden_size=hidden, intermediate_size=intermediate_size(config),
        num_hidden_layers=config["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=get("num_kv_heads") or heads, head_dim=hidden // heads,
        rms_norm_eps=get("norm_eps", 1e-6), qk_norm=bool(get("qk_norm", False)), qk_norm_eps=QK_NORM_EPS,
        output_gate=gate, initializer_range=get("initializer_range", 0.02),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        pad_token_id=get("pad_token_id"), bos_token_id=get("bos_token_id", 1), eos_token_id=get("eos_token_id", 2),
    )
    if fmt == FLA:
        kwargs.update(kv_shift=False, output_norm=False, forget_gate="data_dependent", use_rope=False)
    else:
        _refuse_unless(get("num_kv_heads") is None, "num_kv_heads", get("num_kv_heads"),
                       "the official code has no grouped-query attention; it must be null.")
        shift_k, shift_v = bool(get("use_k_shift", False)), bool(get("use_v_shift", False))
        _refuse_unless(shift_k == shift_v, "use_k_shift/use_v_shift", (shift_k, shift_v),
                       "hf-hybrid's KV-shift shifts keys and values together; both must be equal.")
        if gate:
            _refuse_unless(get("ogate_act", "sigmoid") == "sigmoid", "ogate_act", get("ogate_act"),
                           "only the sigmoid output gate is supported.")
        fgate = get("fgate_type", "full")
        _refuse_unless(fgate in FORGET_GATES, "fgate_type", fgate, f"expected one of {tuple(FORGET_GATES)}.")
        kwargs.update(
            kv_shift=shift_k, output_norm=bool(get("use_output_norm", False)), forget_gate=FORGET_GATES[fgate],
            use_rope=bool(get("use_rope", False)), rope_theta=float(get("rope_base", 500000.0)),
            max_position_embeddings=get("max_position_embeddings") or 16384,
        )
        if get("decay_time_min") is not None and get("decay_time_max") is not None:
            kwargs.update(forget_gate_t_min=get("decay_time_min"), forget_gate_t_max=get("decay_time_max"))
    pro = all(kwargs[k] for k in ("qk_norm", "kv_shift", "output_gate", "output_norm"))
    return FoxConfig(block_type="pro" if pro else "llama", **kwargs)


def source_config_from_fox(config: FoxConfig, fmt: str) -> dict:
    """The source format's config.json for ``config``; refuses what that format cannot express."""
    def refuse_unless(ok: bool, field: str, why: str) -> None:
        _refuse_unless(ok, field, getattr(config, field), f"the {fmt} format {why}")

    refuse_unless(config.head_dim * config.num_attention_heads == config.hidden_size, "head_dim",
                  "derives head_dim as hidden_size / num_heads.")
    if config.qk_norm:
        refuse_unless(config.qk_norm_eps == QK_NORM_EPS, "qk_norm_eps", f"fixes the QK-norm epsilon at {QK_NORM_EPS}.")
    common = dict(
        model_type=MODEL_TYPES[fmt], architectures=["ForgettingTransformerForCausalLM"],
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_heads=config.num_attention_heads, hidden_act="swish",
        window_size=None, qk_norm=config.qk_norm, use_output_gate=config.output_gate, norm_eps=config.rms_norm_eps,
        initializer_range=config.initializer_range, tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        use_cache=True, fuse_norm=True, fuse_cross_entropy=True,
    )
    if fmt == FLA:
        for field, flag in (("kv_shift", config.kv_shift), ("output_norm", config.output_norm), ("use_rope", config.use_rope)):
            refuse_unless(not flag, field, "has no such option.")
        refuse_unless(config.forget_gate == "data_dependent", "forget_gate", "has only the data-dependent forget gate.")
        num_kv = None if config.num_key_value_heads == config.num_attention_heads else config.num_key_value_heads
        return dict(common, num_kv_heads=num_kv, qkv_bias=False, hidden_ratio=4, fuse_swiglu=True,
                    fuse_linear_cross_entropy=False, use_l2warp=False)
    refuse_unless(config.num_key_value_heads == config.num_attention_heads, "num_key_value_heads",
                  "has no grouped-query attention.")
    fgate = {ours: theirs for theirs, ours in FORGET_GATES.items()}[config.forget_gate]
    bias_init = fgate in ("bias_only", "fixed")
    return dict(
        common, num_kv_heads=None, attention_bias=False, hidden_ratio=4, use_rope=config.use_rope,
        rope_base=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        ogate_act="sigmoid", fgate_type=fgate, fgate_bias_init=bias_init,
        decay_time_min=config.forget_gate_t_min if bias_init else None,
        decay_time_max=config.forget_gate_t_max if bias_init else None,
        use_output_norm=config.output_norm, use_k_shift=config.kv_shift, use_v_shift=config.kv_shift,
        qk_norm_share_param_across_head=False, log_pruning_tolerance=None,
    )
