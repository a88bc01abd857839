"""push_to_hub end to end against a Hub served on 127.0.0.1 (tests/hub_server.py).

The real huggingface_hub / transformers client code runs unmodified in subprocesses whose
HF_ENDPOINT points at the loopback server (set before huggingface_hub is imported, which reads it
once): one process pushes a tiny RAT model, fresh processes with empty caches load it back, and the
server's stored files are checked (model card, config.json auto_map, remote code).
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from hub_server import HubServer

REPO_ID = "me/tiny-rat"
TOKEN = "hf_test"
TRAINING_DATA = "generated MQAR"

_PUSH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import hf_hybrid
    from transformers import AutoModelForCausalLM

    config = hf_hybrid.RatConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, chunk_size=4, sliding_window=6, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    first = model.push_to_hub("me/tiny-rat", token="hf_test", training_data="generated MQAR")
    again = model.push_to_hub("me/tiny-rat", token="hf_test", training_data="generated MQAR")  # nothing changed
    ids = torch.load(sys.argv[1])
    with torch.no_grad():
        logits = model(ids).logits
    parameters = sum(p.numel() for p in model.parameters())
    torch.save({"logits": logits, "first": first.oid, "again": again.oid, "parameters": parameters}, sys.argv[2])
    """
)

# Loads the pushed checkpoint twice, each time from an empty cache: first where hf-hybrid cannot be
# imported (only the code pushed with the checkpoint can run), then with hf-hybrid imported (its own
# classes, no trust_remote_code). One process for both keeps the test fast on small CI machines.
_LOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch

    class BlockHfHybrid:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_hybrid":
                raise ModuleNotFoundError(f"No module named {name!r}")

    blocker = BlockHfHybrid()
    sys.meta_path.insert(0, blocker)
    from transformers import AutoModelForCausalLM

    ids = torch.load(sys.argv[1])
    remote = AutoModelForCausalLM.from_pretrained("me/tiny-rat", trust_remote_code=True).eval()
    assert not any(name.split(".")[0] == "hf_hybrid" for name in sys.modules)

    sys.meta_path.remove(blocker)
    import hf_hybrid  # registers the architectures
    local = AutoModelForCausalLM.from_pretrained("me/tiny-rat", cache_dir=sys.argv[3]).eval()
    with torch.no_grad():
        result = {name: {"logits": model(ids).logits, "module": type(model).__module__}
                  for name, model in (("remote", remote), ("local", local))}
    torch.save(result, sys.argv[2])
    """
)


@pytest.fixture
def hub():
    with HubServer(token=TOKEN) as server:
        yield server


def _client_env(hub: HubServer, hf_home: Path) -> dict[str, str]:
    """The caller's environment (TRITON_INTERPRET included) minus any Hub settings, tokens and offline
    switches, plus the loopback endpoint and an empty cache."""
    hub_settings = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(hub_settings) or k.startswith("HF_HYBRID_")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1")
    env["NO_PROXY"] = "127.0.0.1,localhost"  # never route the loopback hub through a proxy
    return env


def _run(script: str, hub: HubServer, tmp_path: Path, name: str) -> dict:
    """Run ``script`` in a fresh process with its own empty HF_HOME (and an empty spare cache folder
    as argv[3]); it writes tmp_path/<name>.pt, which is returned."""
    output = tmp_path / f"{name}.pt"
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ids.pt"), str(output), str(tmp_path / f"cache_{name}")],
        env=_client_env(hub, tmp_path / f"hf_home_{name}"), cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(output)


def _front_matter(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n"), "the model card must start with YAML front matter"
    front, _, body = card[4:].partition("\n---\n")
    return yaml.safe_load(front), body


def test_push_to_hub_then_from_pretrained_through_a_loopback_hub(hub, tmp_path):
    assert hub.endpoint.startswith("http://127.0.0.1:")
    torch.save(torch.tensor([[5, 17, 3, 42, 8, 60, 1, 9, 33, 2, 11]]), tmp_path / "ids.pt")

    pushed = _run(_PUSH_SCRIPT, hub, tmp_path, "push")
    loaded = _run(_LOAD_SCRIPT, hub, tmp_path, "load")
    local, remote = loaded["local"], loaded["remote"]

    assert hub.unhandled == [] and hub.errors == [], (hub.unhandled, hub.errors)

    # One commit for the push on top of the repo's initial commit; pushing unchanged files again
    # creates none (create_repo exist_ok + the preupload oids let the client skip every file).
    history = hub.history(REPO_ID)
    assert [commit.title for commit in history] == ["Upload model", "initial commit"]
    assert pushed["first"] == pushed["again"] == history[0].oid

    assert local["module"].startswith("hf_hybrid.")
    assert torch.equal(pushed["logits"], local["logits"]), "logits after from_pretrained are not bit-identical"
    assert remote["module"].startswith("transformers_modules.")
    assert torch.equal(pushed["logits"], remote["logits"]), "remote-code logits are not bit-identical"

    files = hub.head(REPO_ID).files
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md"} <= set(files)

    # README.md is our filled RAT card, not transformers' generic one.
    card = files["README.md"].decode()
    metadata, body = _front_matter(card)
    assert metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-generation"
    assert metadata["license"] == "apache-2.0"
    assert {"hf-hybrid", "rat"} <= set(metadata["tags"])
    assert re.search(r"^## Training data\n\n" + re.escape(TRAINING_DATA) + r"\.?\n", body, re.MULTILINE), body
    assert body.lstrip().startswith("# tiny-rat\n")
    assert f"{pushed['parameters']:,} parameters" in body
    assert f'from_pretrained("{REPO_ID}")' in body
    assert re.search(r"\$\{?[A-Za-z_]", card) is None, "unfilled $placeholders in the card"

    # config.json points the Auto classes at uploaded code, and that code is complete: every
    # module named by auto_map or imported relatively by an uploaded file was uploaded too.
    config = json.loads(files["config.json"])
    assert config["model_type"] == "rat"
    auto_map = config["auto_map"]
    assert {"AutoConfig", "AutoModelForCausalLM"} <= set(auto_map)
    needed = {reference.split(".")[0] + ".py" for reference in auto_map.values()}
    for name in [name for name in files if name.endswith(".py")]:
        imports = [node for node in ast.walk(ast.parse(files[name].decode(), filename=name))
                   if isinstance(node, (ast.Import, ast.ImportFrom))]
        # `from .a import x` and `from .a.b import x` both need the file a.py (the bundle's modules are
        # submodules of hf_hybrid_bundle.py).
        needed |= {f"{node.module.split('.')[0]}.py" for node in imports
                   if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
        absolute = [alias.name for node in imports if isinstance(node, ast.Import) for alias in node.names]
        absolute += [node.module for node in imports if isinstance(node, ast.ImportFrom) and node.level == 0]
        assert not any(module.split(".")[0] == "hf_hybrid" for module in absolute), f"{name} still imports hf_hybrid"
    assert needed <= set(files), f"remote code files missing on the hub: {sorted(needed - set(files))}"
    assert {"configuration_rat.py", "modeling_rat.py", "hf_hybrid_bundle.py"} <= needed

    # Both loads really went through the hub: the weights were downloaded once per empty cache, and
    # the remote-code loader fetched every code file.
    downloaded = [path.rpartition("/")[2] for method, path in hub.requests if method == "GET" and "/resolve/" in path]
    assert downloaded.count("model.safetensors") == 2
    assert needed <= set(downloaded), f"code files not fetched: {sorted(needed - set(downloaded))}"


def test_hub_server_refuses_unauthenticated_writes_and_unknown_routes(hub):
    """The loopback hub checks the token (so a successful push proves the token reached it) and
    reports routes it does not implement instead of pretending to serve them."""
    request = urllib.request.Request(
        f"{hub.endpoint}/api/repos/create", data=json.dumps({"name": "x", "organization": "me"}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer wrong"}, method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401
    assert hub.repos == {}

    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{hub.endpoint}/api/spaces/me/x", timeout=10)
    assert missing.value.code == 404
    assert hub.unhandled == [("GET", "/api/spaces/me/x")]
