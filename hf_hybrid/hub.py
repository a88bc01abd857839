"""Sharing checkpoints: filled model cards, self-contained remote code, push_to_hub.

``save_pretrained`` of every hf-hybrid model writes, next to the weights, the model's code
(see remote_code.py: three files; loadable with trust_remote_code=True where hf-hybrid is not installed) and a
README.md model card from ``model_cards/<model_type>.md`` unless the folder already has one.
``push_to_hub`` uploads exactly that folder, so the Hub shows our card instead of a generic one.
"""
from __future__ import annotations

import contextlib
import importlib.resources
import socket
import string
import tempfile
from pathlib import Path

from huggingface_hub import HfApi

from .models.common import register_sharing as _register_with_models
from .models.registry import architecture_classes
from .remote_code import write_remote_code

# The cards describe the causal LM; a saved task head gets its own Hub task and loading class.
_HEAD_PIPELINE_TAGS = {
    "AutoModelForSequenceClassification": "text-classification",
    "AutoModelForTokenClassification": "token-classification",
    "AutoModelForQuestionAnswering": "question-answering",
}


def card_template(model_type: str) -> str:
    """model_cards/<model_type>.md, or model_cards/default.md for an architecture without its own."""
    templates = importlib.resources.files("hf_hybrid.model_cards")
    resource = templates / f"{model_type}.md"
    return (resource if resource.is_file() else templates / "default.md").read_text(encoding="utf-8")


def _layer_summary(config) -> str:
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return f"{config.num_hidden_layers} identical layers"
    runs, previous = [], None
    for kind in layer_types:
        if runs and kind == previous:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
        previous = kind
    return ", ".join(f"{count} x {kind}" if count > 1 else kind for kind, count in runs)


def render_model_card(model, repo_id: str | None = None, training_data: str | None = None) -> str:
    """The card for ``model``: its template with config fields and facts filled in ($name placeholders)."""
    config = model.config
    values = {key: value for key, value in config.to_dict().items() if isinstance(value, (int, float, str, bool))}
    name = repo_id or getattr(config, "name_or_path", "") or f"{config.model_type} model"
    values.update(
        model_name=name.rstrip("/").split("/")[-1] or name,
        repo_id=repo_id or "path/to/checkpoint",
        parameters=f"{sum(p.numel() for p in model.parameters()):,}",
        layer_summary=_layer_summary(config),
        training_data=training_data or "Not documented by the uploader.",
    )
    card = string.Template(card_template(config.model_type)).safe_substitute(values)
    for auto_class, model_class in architecture_classes(config.model_type).items():
        if model_class is type(model) and auto_class in _HEAD_PIPELINE_TAGS:
            card = card.replace("pipeline_tag: text-generation", f"pipeline_tag: {_HEAD_PIPELINE_TAGS[auto_class]}", 1)
            card = card.replace("AutoModelForCausalLM", auto_class)
    return card


def save_sharing_files(model, directory: str | Path, repo_id: str | None = None, training_data: str | None = None) -> None:
    """Remote code + auto_map, and README.md (kept if the folder already has one)."""
    if not type(model).__module__.startswith("hf_hybrid."):
        return  # running as remote code: transformers' custom_object_save already copied the code + auto_map
    directory = Path(directory)
    write_remote_code(model, directory)
    card = directory / "README.md"
    if not card.exists():
        card.write_text(render_model_card(model, repo_id, training_data), encoding="utf-8")


class HubUnreachableError(ConnectionError):
    """The Hub could not be reached: offline mode, no network, or an HF_ENDPOINT nobody answers at.
    Its message is one line that says which, and the fix."""


# Connection failures of the HTTP clients huggingface_hub has used (httpx, its httpx2 fork, requests),
# matched by name so that none of them has to be installed.
_TRANSPORT_MODULES = {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"}
_TRANSPORT_CLASSES = {"TransportError", "ConnectionError", "NewConnectionError", "Timeout"}


def _unreachable_cause(error: BaseException) -> BaseException | None:
    """The exception in ``error``'s chain that says the Hub was not reached, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ConnectionError, TimeoutError, socket.gaierror)):
            return error
        kind = type(error)
        if kind.__module__.split(".")[0] in _TRANSPORT_MODULES and any(c.__name__ in _TRANSPORT_CLASSES for c in kind.__mro__):
            return error
        error = error.__cause__ or error.__context__
    return None


def unreachable_message(error: BaseException, endpoint: str | None = None) -> str | None:
    """One line naming why the Hub was not reached and the fix, or None for any other error."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    cause = _unreachable_cause(error)
    if cause is None:
        return None
    if isinstance(cause, OfflineModeIsEnabled):
        return ("offline mode is on (HF_HUB_OFFLINE=1), so the Hub is not contacted: unset HF_HUB_OFFLINE to upload, "
                "or keep the model on disk with model.save_pretrained(path)")
    endpoint = endpoint or constants.ENDPOINT
    reason = " ".join(str(cause).split()) or type(cause).__name__
    return (f"cannot reach the Hugging Face Hub at {endpoint} ({reason}): check the network connection and HF_ENDPOINT, "
            "or keep the model on disk with model.save_pretrained(path)")


@contextlib.contextmanager
def reaching_the_hub(endpoint: str | None = None):
    """Inside the block, a failure to reach the Hub is raised as :class:`HubUnreachableError` with a
    one-line message (the original error stays chained); every other error passes unchanged."""
    try:
        yield
    except HubUnreachableError:
        raise
    except Exception as error:
        message = unreachable_message(error, endpoint)
        if message is None:
            raise
        raise HubUnreachableError(message) from error


def push_model_to_hub(
    model,
    repo_id: str,
    *,
    commit_message: str = "Upload model",
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    training_data: str | None = None,
    max_shard_size: str | int = "5GB",
):
    """Create the repo, save weights + config + remote code + filled card, upload the folder.

    Raises :class:`HubUnreachableError` (one-line message, the fix included) when the Hub cannot be reached."""
    api = HfApi(token=token)
    with reaching_the_hub(api.endpoint):
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder, max_shard_size=max_shard_size, card_repo_id=repo_id, card_training_data=training_data)
            return api.upload_folder(
                repo_id=repo_id, folder_path=folder, commit_message=commit_message, revision=revision, create_pr=create_pr
            )


def register_sharing() -> None:
    """Make every hf-hybrid model's save_pretrained write the sharing files and its push_to_hub use
    :func:`push_model_to_hub` (run by ``import hf_hybrid``; the models do not import this module)."""
    _register_with_models(save_sharing_files, push_model_to_hub)
