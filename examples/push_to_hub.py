"""Push an hf-hybrid model to the Hugging Face Hub, load it back from there and check what arrived.

    python examples/push_to_hub.py --repo-id you/tiny-rat              # the Hub; token: HF_TOKEN or `hf auth login`
    python examples/push_to_hub.py --model-type fox --repo-id you/tiny-fox --private
    python examples/push_to_hub.py --model-path pretrain_output --repo-id you/mqar-rat --training-data "generated MQAR"
    python examples/push_to_hub.py --endpoint http://127.0.0.1:8000 --token hf_test   # another Hub (CI: tests/hub_server.py)

Builds a tiny randomly initialised model of --model-type (``--set key=value`` changes its config),
or loads the checkpoint at --model-path, and pushes it with ``model.push_to_hub(repo_id)``: weights,
config.json with auto_map, the self-contained remote code and the filled model card. Then, from a
fresh empty cache, it reloads the pushed commit with ``AutoModelForCausalLM.from_pretrained(repo_id)``
and checks the logits are bit-identical, lists the repo's files (the remote-code modules named by
auto_map must be there) and reads README.md's front matter (library_name, pipeline_tag, tags).
Prints and returns a summary, and fails (AssertionError) if any check does not hold. A Hub that cannot
be reached (no network, a wrong --endpoint / HF_ENDPOINT, HF_HUB_OFFLINE=1) ends the script with a
one-line message naming the fix and exit status 1; main() itself raises hf_hybrid.hub.HubUnreachableError.

The endpoint: huggingface_hub reads HF_ENDPOINT once, when it is imported (``constants.ENDPOINT``),
and transformers' from_pretrained takes no endpoint argument. So when this file runs as a script,
--endpoint is put into HF_ENDPOINT before huggingface_hub or transformers is imported (everything
else is imported inside main()). When main() is called in a process that imported them already
(the in-process test), the endpoint constants are repointed for the duration of main() and
restored afterwards. The HfApi calls made here also get ``endpoint=`` explicitly. Without
--endpoint, huggingface_hub's own setting is used (HF_ENDPOINT, else https://huggingface.co).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from urllib.parse import urlsplit


def tiny_config_kwargs(model_type: str) -> dict:
    """The architecture's tiny test configuration (hf_hybrid/architectures.py): about 40k parameters,
    a push of well under a megabyte."""
    from hf_hybrid.architectures import architecture

    return architecture(model_type).tiny_config_kwargs()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="rat", help="an hf-hybrid model_type, e.g. rat or se_hybrid (ignored with --model-path)")
    parser.add_argument("--model-path", help="push this checkpoint instead of a new tiny model")
    parser.add_argument("--repo-id", help="owner/name; a bare name goes to the token's namespace (default tiny-<model-type>)")
    parser.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT, else https://huggingface.co)")
    parser.add_argument("--token", help="write token (default: HF_TOKEN, else the stored `hf auth login` token)")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--training-data", help="what the model was trained on, for the model card")
    parser.add_argument("--commit-message", default="Upload model (hf-hybrid push_to_hub example)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config fields")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@contextlib.contextmanager
def hub_endpoint(endpoint: str | None):
    """Point huggingface_hub (and so transformers) at ``endpoint`` inside the block; yields the endpoint in use."""
    from huggingface_hub import constants

    if endpoint is None or constants.ENDPOINT == endpoint.rstrip("/"):
        yield constants.ENDPOINT  # the script path: HF_ENDPOINT was set before the import
        return
    endpoint = endpoint.rstrip("/")
    names = ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_URL_HOSTS")
    saved = {name: getattr(constants, name) for name in names}
    constants.ENDPOINT = endpoint
    constants.HUGGINGFACE_CO_URL_TEMPLATE = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_URL_HOSTS = saved["HF_URL_HOSTS"] | {urlsplit(endpoint).hostname.lower()}
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            setattr(constants, name, value)


def build_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_hybrid.cli import parse_overrides

    if args.model_path:
        return AutoModelForCausalLM.from_pretrained(args.model_path)
    from hf_hybrid.architectures import MODEL_TYPES

    if args.model_type not in MODEL_TYPES:
        raise SystemExit(f"--model-type must be one of {list(MODEL_TYPES)}, got {args.model_type!r}")
    config = AutoConfig.for_model(args.model_type, **{**tiny_config_kwargs(args.model_type), **parse_overrides(args.set)})
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config)


def front_matter(card_text: str) -> dict:
    from huggingface_hub import ModelCard

    return ModelCard(card_text, ignore_metadata_errors=False).data.to_dict()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with hub_endpoint(args.endpoint) as endpoint:
        import torch
        from huggingface_hub import HfApi, hf_hub_download, is_offline_mode
        from transformers import AutoModelForCausalLM

        import hf_hybrid  # noqa: F401  (registers the architectures)
        from hf_hybrid.hub import HubUnreachableError, reaching_the_hub
        from hf_hybrid.models.common import HybridPreTrainedModel

        if is_offline_mode():
            raise HubUnreachableError("HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set, so the Hub is not contacted: "
                                      "unset them to run this example (or point --endpoint at a local test Hub)")
        model = build_model(args).eval()
        if not isinstance(model, HybridPreTrainedModel):
            raise SystemExit(f"{type(model).__name__} is not an hf-hybrid model; this example checks hf-hybrid's model card.")
        model_type = model.config.model_type
        generator = torch.Generator().manual_seed(args.seed)
        input_ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=generator)
        with torch.no_grad():
            logits = model(input_ids).logits

        with reaching_the_hub(endpoint):
            api = HfApi(endpoint=endpoint, token=args.token)
            # create_repo resolves a bare name to owner/name (push_to_hub calls it again, exist_ok).
            repo_id = api.create_repo(args.repo_id or f"tiny-{model_type.replace('_', '-')}", private=args.private or None, exist_ok=True).repo_id
            commit = model.push_to_hub(
                repo_id, token=args.token, private=args.private or None, commit_message=args.commit_message,
                training_data=args.training_data,
            )

            with tempfile.TemporaryDirectory() as cache_dir:  # empty: every file comes from the Hub
                reloaded = AutoModelForCausalLM.from_pretrained(
                    repo_id, revision=commit.oid, token=args.token, cache_dir=cache_dir
                ).eval()
                with torch.no_grad():
                    reloaded_logits = reloaded(input_ids).logits
                download = dict(repo_id=repo_id, revision=commit.oid, cache_dir=cache_dir, endpoint=endpoint, token=args.token)
                with open(hf_hub_download(filename="README.md", **download), encoding="utf-8") as f:
                    metadata = front_matter(f.read())
                with open(hf_hub_download(filename="config.json", **download), encoding="utf-8") as f:
                    auto_map = json.load(f).get("auto_map", {})
            files = sorted(api.list_repo_files(repo_id, revision=commit.oid))

    remote_code = {reference.split(".")[0] + ".py" for reference in auto_map.values()}
    summary = {
        "model_type": model_type,
        "endpoint": endpoint,
        "repo_id": repo_id,
        "commit": commit.oid,
        "parameters": sum(p.numel() for p in model.parameters()),
        "reloaded_class": f"{type(reloaded).__module__}.{type(reloaded).__name__}",
        "reloaded_model_type": reloaded.config.model_type,
        "logits_identical": torch.equal(logits, reloaded_logits),
        "max_logit_difference": (logits - reloaded_logits).abs().max().item(),
        "files": files,
        "remote_code_files": sorted(name for name in files if name.endswith(".py")),
        "auto_map": auto_map,
        "card": {key: metadata.get(key) for key in ("library_name", "pipeline_tag", "license", "tags")},
    }
    print(json.dumps(summary))

    assert summary["reloaded_model_type"] == model_type, summary["reloaded_class"]
    assert summary["logits_identical"], f"logits after from_pretrained differ by up to {summary['max_logit_difference']}"
    assert {"config.json", "model.safetensors", "README.md"} <= set(files), files
    assert {"AutoConfig", "AutoModelForCausalLM"} <= set(auto_map), auto_map
    assert remote_code <= set(files), f"remote code named by auto_map is missing: {sorted(remote_code - set(files))}"
    card = summary["card"]
    assert card["library_name"] == "transformers" and card["pipeline_tag"] == "text-generation", card
    assert {"hf-hybrid", model_type} <= set(card["tags"] or []), card
    return summary


if __name__ == "__main__":
    endpoint = parse_args().endpoint
    if endpoint:  # before huggingface_hub is imported: it reads HF_ENDPOINT once, at import
        os.environ["HF_ENDPOINT"] = endpoint
    from hf_hybrid.hub import HubUnreachableError

    try:
        main()
    except HubUnreachableError as error:  # one line with the fix, not the HTTP client's traceback
        raise SystemExit(f"push_to_hub.py: {error}") from None
