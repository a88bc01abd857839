"""Configuration of RAT+ models (RAT+ paper Sec. 4, Appendix A.1; defaults follow its 1.5B model)."""
from __future__ import annotations

from collections.abc import Sequence

from ...sparse import SparseInferenceConfig
from ...compat import CACHE_NAME
from ..configuration_backbone import HybridBackboneConfig
from ..validation import check_positive


def training_pattern(item) -> SparseInferenceConfig:
    """One entry of ``training_dilations``: an int D or a pattern dict/config.

    An int is the official code's training mask: dilation D with no local window and no sinks
    (D = L* = 64 is active recurrence learning's sparse case, D = 1 the dense case).
    """
    if isinstance(item, int) and not isinstance(item, bool):
        if item < 1:
            raise ValueError(f"training_dilations entries must be >= 1, got {item}.")
        return SparseInferenceConfig(dilation=item, local_window=0, num_sink_tokens=0)
    try:
        return SparseInferenceConfig.coerce(item)
    except (TypeError, ValueError) as error:
        raise ValueError(f"training_dilations entry {item!r} is not a dilation or a sparse pattern: {error}") from None


class RatPlusConfig(HybridBackboneConfig):
    r"""
    RAT+: dense attention over recurrent keys/values, trained once, sparsified per call at inference.

    Attention implementation: a RAT+ layer has no plain softmax form (recurrent keys/values, output
    gate, per-call dilated / top-k patterns), so it runs its own kernels whatever
    ``attn_implementation`` says; every implementation transformers accepts (``"eager"``,
    ``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"``) is accepted and changes nothing, and
    ``output_attentions`` gives None for every layer.

    Args:
        training_dilations (`list[int | dict]`, defaults to `[1, 64]`): active recurrence learning. In
            training mode, a forward with ``labels`` (and no explicit ``sparse_config``) runs one forward
            per entry on the same batch and returns the weighted sum of their losses: 1 is the dense
            case, 64 the sparse case D = L* = 64 (no window, no sinks). Entries may also be
            ``SparseInferenceConfig`` dicts (e.g. to adapt to D=16, W=256 jointly with dense). ``[1]``
            trains dense only (the paper's "no ARL" ablation).
        training_loss_weights (`list[float]`, *optional*): one weight per training pattern (default 1 each,
            i.e. L = L_dense + L_sparse, each pattern's loss counted as if it were trained alone).
        sparse_config (`dict` or `SparseInferenceConfig`, *optional*): the default inference pattern,
            stored as a dict; a forward/generate call's ``sparse_config=`` replaces it. Default: dense.
        use_recurrence (`bool`, defaults to True): False drops the recurrence (k~ = k, v~ = v), giving the
            paper's attention baseline with output gate (D-dagger) in the same code path.
        recurrence_gate_bias (`bool`, defaults to False): add a bias to the recurrence gate projection
            (the official code has none; dense-to-RAT+ conversion uses it to initialise the gate closed).
        use_rope (`bool`, defaults to True): RoPE by token position after the recurrence; False gives NoPE.
        kernel_backend (`str`, defaults to ``"auto"``): backend of the recurrence and attention ops
            (``"auto"``, ``"reference"``, ``"triton"``; see ``hf_hybrid.kernels``), or ``"scan"``: the
            recurrence as a PyTorch log-depth scan and attention through SDPA (no Triton at all).
    The backbone's fields (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``,
    ``max_position_embeddings``, ``tie_word_embeddings``, the MLP's ``mlp_type`` / ``hidden_act`` /
    ``mlp_bias``) are ``HybridBackboneConfig``'s and mean what they mean for Llama.
    """

    model_type = "rat_plus"
    keys_to_ignore_at_inference = [CACHE_NAME]  # the Trainer drops the cache from eval outputs

    kernel_backends = ("auto", "reference", "triton", "scan")

    def __init__(
        self,
        use_rope: bool = True,
        training_dilations: Sequence = (1, 64),
        training_loss_weights: Sequence[float] | None = None,
        sparse_config: dict | SparseInferenceConfig | None = None,
        use_recurrence: bool = True,
        recurrence_gate_bias: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_positive("max_position_embeddings", self.max_position_embeddings)
        if use_rope and self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE; set use_rope=False for NoPE.")
        num_hidden_layers, num_attention_heads = self.num_hidden_layers, self.num_attention_heads
        max_position_embeddings = self.max_position_embeddings

        if isinstance(training_dilations, (int, str, dict)) or not isinstance(training_dilations, Sequence) or not training_dilations:
            raise ValueError(f"training_dilations must be a non-empty list such as [1, 64], got {training_dilations!r}.")
        patterns = [training_pattern(item) for item in training_dilations]
        for pattern in patterns:
            pattern.validate_for_model(num_hidden_layers, num_attention_heads, max_position_embeddings)
        self.training_dilations = [item if isinstance(item, int) else p.to_dict() for item, p in zip(training_dilations, patterns)]
        if training_loss_weights is not None:
            training_loss_weights = [float(w) for w in training_loss_weights]
            if len(training_loss_weights) != len(patterns) or any(w < 0 for w in training_loss_weights):
                raise ValueError(
                    f"training_loss_weights must hold one non-negative weight per training_dilations entry "
                    f"({len(patterns)}), got {training_loss_weights}."
                )
        self.training_loss_weights = training_loss_weights

        sparse = SparseInferenceConfig.coerce(sparse_config)
        sparse.validate_for_model(num_hidden_layers, num_attention_heads, max_position_embeddings)
        self.sparse_config = sparse.to_dict()

        self.use_rope = use_rope
        self.use_recurrence = use_recurrence
        self.recurrence_gate_bias = recurrence_gate_bias

    def resolve_sparse_config(self, sparse_config=None) -> SparseInferenceConfig:
        """The call's pattern (or the stored default), checked against this model's layers and heads."""
        sparse = SparseInferenceConfig.coerce(self.sparse_config if sparse_config is None else sparse_config)
        sparse.validate_for_model(self.num_hidden_layers, self.num_attention_heads, self.max_position_embeddings)
        return sparse

    def training_patterns(self, training_dilations=None) -> tuple[list[SparseInferenceConfig], list[float]]:
        """Patterns and loss weights of the joint objective (the call's ``training_dilations`` or the config's)."""
        items = self.training_dilations if training_dilations is None else list(training_dilations)
        if not items:
            raise ValueError("training_dilations must not be empty.")
        patterns = [training_pattern(item) for item in items]
        for pattern in patterns:
            pattern.validate_for_model(self.num_hidden_layers, self.num_attention_heads, self.max_position_embeddings)
        weights = self.training_loss_weights if training_dilations is None else None
        return patterns, weights if weights is not None else [1.0] * len(patterns)
