"""hf_hybrid/remote_code.py: a checkpoint's remote code is three files (config, model, one bundle of
the package modules they need) that transformers' loader fetches and runs without hf_hybrid; each
module file is parsed once per version of the file."""
import ast
import os
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_hybrid  # noqa: F401  (registers the architectures)
from hf_hybrid import remote_code
from test_heads import MODEL_TYPES, tiny_config

ENTRY_POINTS = {"hf_hybrid.models.rat.configuration_rat": "configuration_rat",
                "hf_hybrid.models.rat.modeling_rat": "modeling_rat"}


def test_a_second_bundle_parses_nothing_again_and_is_identical():
    first = remote_code.bundle_modules(ENTRY_POINTS)
    before = remote_code._parsed_source.cache_info()
    second = remote_code.bundle_modules(ENTRY_POINTS)
    after = remote_code._parsed_source.cache_info()
    assert second == first and "modeling_rat.py" in first and "configuration_rat.py" in first
    assert after.misses == before.misses and after.hits > before.hits


def test_a_changed_file_is_parsed_again(monkeypatch):
    remote_code.bundle_modules(ENTRY_POINTS)
    misses = remote_code._parsed_source.cache_info().misses
    real_stat = os.stat

    def newer(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if str(path).endswith("modeling_rat.py"):  # the file as if saved again, one second later
            return SimpleNamespace(st_mtime_ns=result.st_mtime_ns + 10**9, st_size=result.st_size)
        return result

    monkeypatch.setattr(remote_code.os, "stat", newer)
    remote_code.bundle_modules(ENTRY_POINTS)
    assert remote_code._parsed_source.cache_info().misses == misses + 1


# transformers' remote-code loader reads these lines as files of the checkpoint to fetch
# (transformers.dynamic_module_utils.get_relative_imports).
FETCHED = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.M), re.compile(r"^\s*from\s+\.(\S+)\s+import", re.M))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_saved_checkpoint_carries_a_handful_of_modules(model_type, tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    model.save_pretrained(tmp_path)
    code = {path.name: path.read_text() for path in tmp_path.glob("*.py")}
    stem = model_type
    assert set(code) == {f"configuration_{stem}.py", f"modeling_{stem}.py", "hf_hybrid_bundle.py"}
    for name, text in code.items():
        ast.parse(text)
        fetched = {match for pattern in FETCHED for match in pattern.findall(text)}
        # Every file the loader will look for is one of the three: nothing else is fetched.
        assert {f"{f}.py" for f in fetched} <= set(code), (name, fetched)
    assert "hf_hybrid_bundle" in {m for p in FETCHED for m in p.findall(code[f"modeling_{stem}.py"])}
    # Only the architecture's own model package: no other architecture's modules ride along.
    bundle = code["hf_hybrid_bundle.py"]
    others = {t for t in MODEL_TYPES if t != model_type and not (model_type == "rat_plus" and t == "rat")}
    assert not any(f"SOURCES['models.{other}." in bundle for other in others), model_type


_OWN_NAMES_SCRIPT = """
import importlib, inspect, sys
from pathlib import Path
root = Path(sys.argv[1])
(root / "pkg" / "__init__.py").write_text("")
sys.path.insert(0, str(root))
modeling = importlib.import_module("pkg.modeling_rat")
norm = importlib.import_module("pkg.hf_hybrid_bundle.layers.norm")
from hf_hybrid.layers.norm import RMSNorm

assert modeling.RatForCausalLM.__module__ == "pkg.modeling_rat"
assert norm.RMSNorm is not RMSNorm and norm.RMSNorm.__module__ == "pkg.hf_hybrid_bundle.layers.norm"
assert inspect.getsource(norm.RMSNorm) == inspect.getsource(RMSNorm)
# A bundled module's relative import reaches the bundled module, not the installed package.
assert modeling.RatModel.cache_class.__module__ == "pkg.hf_hybrid_bundle.models.rat.cache_rat"
print("ok")
"""


def test_the_bundle_runs_the_package_modules_under_their_own_names(tmp_path):
    """Loaded through the bundle, a module keeps its namespace, its relative imports and its source
    (inspect finds it, as Triton's JIT needs). In its own process: the bundle's kernel modules
    register the package's custom ops again, which must not outlive the test in a shared worker."""
    import subprocess
    import sys

    model = AutoModelForCausalLM.from_config(tiny_config("rat"))
    model.save_pretrained(tmp_path / "pkg")
    out = subprocess.run([sys.executable, "-c", _OWN_NAMES_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


_RESAVE_SCRIPT = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM

source, copy, ids_path = sys.argv[1:4]
ids = torch.load(ids_path)
model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).eval()
model.save_pretrained(copy)  # transformers copies the remote code: the entry files and what they import
again = AutoModelForCausalLM.from_pretrained(copy, trust_remote_code=True).eval()
with torch.no_grad():
    same = torch.equal(model(ids).logits, again(ids).logits)
assert not any(name.split(".")[0] == "hf_hybrid" for name in sys.modules)
print(json.dumps({"same": same, "files": sorted(p.name for p in Path(copy).glob("*.py"))}))
"""


def test_a_remote_code_model_saves_and_reloads_without_hf_hybrid(tmp_path):
    """Saved again where hf-hybrid is not installed, a checkpoint keeps the same three files and reloads."""
    import json

    from helper_process import remote_code_helper

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("rattention")).save_pretrained(tmp_path / "ckpt")
    torch.save(torch.randint(1, 60, (1, 9)), tmp_path / "ids.pt")
    printed = remote_code_helper().run(_RESAVE_SCRIPT, tmp_path / "ckpt", tmp_path / "copy", tmp_path / "ids.pt")
    result = json.loads(printed.strip().splitlines()[-1])
    assert result == {"same": True, "files": ["configuration_rattention.py", "hf_hybrid_bundle.py", "modeling_rattention.py"]}
