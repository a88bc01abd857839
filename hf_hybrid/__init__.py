"""hf-hybrid: efficient-attention architectures as first-class Hugging Face Transformers models.

``import hf_hybrid`` registers every architecture with AutoConfig, AutoModel, AutoModelForCausalLM
and the task-head Auto classes (sequence / token classification, question answering), and gives
peft default ``target_modules`` for every model type (hf_hybrid/peft.py).
"""
from ._checkout import map_checkout_folders as _map_checkout_folders

_map_checkout_folders(__name__, __file__)

from .models import register_all as _register_all  # noqa: E402

__version__ = "0.1.0"

_register_all()

from .models.fox import (  # noqa: E402
    FoxCache,
    FoxConfig,
    FoxForCausalLM,
    FoxForQuestionAnswering,
    FoxForSequenceClassification,
    FoxForTokenClassification,
    FoxModel,
)
from .models.rat import (  # noqa: E402
    RatCache,
    RatConfig,
    RatForCausalLM,
    RatForQuestionAnswering,
    RatForSequenceClassification,
    RatForTokenClassification,
    RatModel,
)
from .models.rat_plus import (  # noqa: E402
    RatPlusCache,
    RatPlusConfig,
    RatPlusForCausalLM,
    RatPlusForQuestionAnswering,
    RatPlusForSequenceClassification,
    RatPlusForTokenClassification,
    RatPlusModel,
)
from .models.rattention import (  # noqa: E402
    RattentionCache,
    RattentionConfig,
    RattentionForCausalLM,
    RattentionForQuestionAnswering,
    RattentionForSequenceClassification,
    RattentionForTokenClassification,
    RattentionModel,
)
from .models.se_hybrid import (  # noqa: E402
    SEHybridCache,
    SEHybridConfig,
    SEHybridForCausalLM,
    SEHybridForQuestionAnswering,
    SEHybridForSequenceClassification,
    SEHybridForTokenClassification,
    SEHybridModel,
)
from .peft import HyLoraConfig, register_peft_defaults  # noqa: E402
from .sparse import AttentionPattern, SparseInferenceConfig  # noqa: E402

register_peft_defaults()


__all__ = [
    "AttentionPattern",
    "FoxCache",
    "FoxConfig",
    "FoxForCausalLM",
    "FoxForQuestionAnswering",
    "FoxForSequenceClassification",
    "FoxForTokenClassification",
    "FoxModel",
    "HyLoraConfig",
    "RatCache",
    "RatConfig",
    "RatForCausalLM",
    "RatForQuestionAnswering",
    "RatForSequenceClassification",
    "RatForTokenClassification",
    "RatModel",
    "RatPlusCache",
    "RatPlusConfig",
    "RatPlusForCausalLM",
    "RatPlusForQuestionAnswering",
    "RatPlusForSequenceClassification",
    "RatPlusForTokenClassification",
    "RatPlusModel",
    "RattentionCache",
    "RattentionConfig",
    "RattentionForCausalLM",
    "RattentionForQuestionAnswering",
    "RattentionForSequenceClassification",
    "RattentionForTokenClassification",
    "RattentionModel",
    "SEHybridCache",
    "SEHybridConfig",
    "SEHybridForCausalLM",
    "SEHybridForQuestionAnswering",
    "SEHybridForSequenceClassification",
    "SEHybridForTokenClassification",
    "SEHybridModel",
    "SparseInferenceConfig",
    "__version__",
]
