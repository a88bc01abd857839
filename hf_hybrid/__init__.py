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
from .models.rattention import RattentionCache, RattentionConfig, RattentionForCausalLM, RattentionModel  # noqa: E402
from .models.se_hybrid import SEHybridCache, SEHybridConfig, SEHybridForCausalLM, SEHybridModel  # noqa: E402
from .sparse import AttentionPattern, SparseInferenceConfig  # noqa: E402


def __getattr__(name: str):
    # HyLoraConfig lives with peft; import it on first use so `import hf_hybrid` stays light.
    if name == "HyLoraConfig":
        from .peft import HyLoraConfig

        return HyLoraConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HyLoraConfig",
    "RattentionCache",
    "RattentionConfig",
    "RattentionForCausalLM",
    "RattentionModel",
    "SEHybridCache",
    "SEHybridConfig",
    "SEHybridForCausalLM",
    "SEHybridModel",
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
