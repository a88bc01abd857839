"""hf-hybrid: efficient-attention architectures as first-class Hugging Face Transformers models.

``import hf_hybrid`` registers every architecture with AutoConfig, AutoModel, AutoModelForCausalLM
and the task-head Auto classes (sequence / token classification, question answering), and gives
peft default ``target_modules`` for every model type (hf_hybrid/peft.py).

The architectures and what the package exports of each (config, model, causal LM, task heads,
cache) come from one table, hf_hybrid/architectures.py.
"""
from ._checkout import map_checkout_folders as _map_checkout_folders

_map_checkout_folders(__name__, __file__)

from .architectures import ARCHITECTURES as _ARCHITECTURES  # noqa: E402
from .models import register_all as _register_all  # noqa: E402

__version__ = "0.1.0"

_register_all()

for _arch in _ARCHITECTURES:
    for _name in _arch.exported_names:
        globals()[_name] = _arch.load(_name)
del _arch, _name

from . import hub as _hub  # noqa: E402
from .peft import HyLoraConfig, register_peft_defaults  # noqa: E402
from .sparse import AttentionPattern, SparseInferenceConfig  # noqa: E402
from .training import graph_training_layers, ungraph_training_layers  # noqa: E402

register_peft_defaults()
_hub.register_sharing()


__all__ = sorted(
    ["AttentionPattern", "HyLoraConfig", "SparseInferenceConfig", "__version__", "graph_training_layers",
     "ungraph_training_layers"]
    + [name for arch in _ARCHITECTURES for name in arch.exported_names]
)
