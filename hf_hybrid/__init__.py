"""hf-hybrid: efficient-attention architectures as first-class Hugging Face Transformers models.

``import hf_hybrid`` registers every architecture with AutoConfig / AutoModel / AutoModelForCausalLM.
"""
from ._checkout import map_checkout_folders as _map_checkout_folders

_map_checkout_folders(__name__, __file__)

from .models import register_all as _register_all  # noqa: E402

__version__ = "0.1.0"

_register_all()

from .models.fox import FoxCache, FoxConfig, FoxForCausalLM, FoxModel  # noqa: E402
from .models.rat import RatCache, RatConfig, RatForCausalLM, RatModel  # noqa: E402
from .models.rat_plus import RatPlusCache, RatPlusConfig, RatPlusForCausalLM, RatPlusModel  # noqa: E402
from .sparse import AttentionPattern, SparseInferenceConfig  # noqa: E402

__all__ = [
    "AttentionPattern",
    "SparseInferenceConfig",
    "RatPlusCache",
    "RatPlusConfig",
    "RatPlusForCausalLM",
    "RatPlusModel",
    "FoxCache",
    "FoxConfig",
    "FoxForCausalLM",
    "FoxModel",
    "RatCache",
    "RatConfig",
    "RatForCausalLM",
    "RatModel",
    "__version__",
]
