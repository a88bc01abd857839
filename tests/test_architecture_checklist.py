"""DESIGN.md's "Adding an architecture" checklist holds for every entry of hf_hybrid/architectures.py.

Each test checks one line of the checklist for every registered architecture, so a new entry that
misses a piece fails here with the piece named, not somewhere downstream.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.configuration_utils import ALLOWED_LAYER_TYPES

import hf_hybrid
from hf_hybrid.architectures import ARCHITECTURES, MODEL_TYPES, architecture
from hf_hybrid.models.registry import architecture_classes

ROOT = Path(__file__).resolve().parents[1]
ARCH_IDS = [arch.model_type for arch in ARCHITECTURES]
every_architecture = pytest.mark.parametrize("arch", ARCHITECTURES, ids=ARCH_IDS)


def _imported_modules(path: Path) -> set[str]:
    """Dotted names of what ``path`` imports (relative dots stripped), as written."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_table_has_unique_names():
    for field in ("model_type", "class_prefix", "reproduction", "demo_key", "bench_row"):
        values = [getattr(arch, field) for arch in ARCHITECTURES]
        assert len(set(values)) == len(values), f"two architectures share a {field}: {values}"
    with pytest.raises(KeyError, match="not an hf-hybrid architecture"):
        architecture("no_such_model")


def test_design_md_has_the_checklist():
    design = (ROOT / "DESIGN.md").read_text(encoding="utf-8")
    assert "### Adding an architecture" in design
    assert "tests/test_architecture_checklist.py" in design


@every_architecture
def test_files(arch):
    folder = ROOT / "hf_hybrid" / "models" / arch.model_type
    for name in ("__init__.py", f"configuration_{arch.model_type}.py", f"modeling_{arch.model_type}.py",
                 f"cache_{arch.model_type}.py"):
        assert (folder / name).is_file(), f"{arch.model_type}: hf_hybrid/models/{arch.model_type}/{name} is missing"


@every_architecture
def test_config(arch):
    config_class = arch.load(arch.config_class_name)
    assert issubclass(config_class, PretrainedConfig)
    assert config_class.model_type == arch.model_type
    assert config_class.__module__ == f"{arch.module}.configuration_{arch.model_type}"
    assert type(AutoConfig.for_model(arch.model_type, **arch.tiny_config_kwargs())) is config_class


@every_architecture
def test_model_classes_are_registered_and_exported(arch):
    registered = architecture_classes(arch.model_type)
    assert registered["AutoModel"].__name__ == arch.model_class_name
    assert registered["AutoModelForCausalLM"].__name__ == arch.causal_lm_class_name
    assert sorted(c.__name__ for name, c in registered.items() if name not in ("AutoModel", "AutoModelForCausalLM")) == sorted(
        arch.head_class_names
    )
    for name in arch.exported_names:
        assert getattr(hf_hybrid, name) is arch.load(name), f"hf_hybrid.{name}"
        assert name in hf_hybrid.__all__


@every_architecture
def test_cache(arch):
    cache_class = arch.load(arch.cache_class_name)
    assert issubclass(cache_class, Cache)
    assert cache_class.__module__ == f"{arch.module}.cache_{arch.model_type}"
    assert arch.load(arch.model_class_name).cache_class is cache_class


@every_architecture
def test_layer_types(arch):
    """The table's layer kinds are the ones its config declares and validates itself."""
    from importlib import import_module

    config_module = import_module(f"{arch.module}.configuration_{arch.model_type}")
    declared = [value for name, value in vars(config_module).items() if name.endswith("_LAYER_TYPES") and isinstance(value, tuple)]
    assert declared in ([arch.layer_types], []) and (declared or not arch.layer_types), (
        f"{arch.model_type}: the table lists layer_types {arch.layer_types}, its config declares {declared}"
    )
    config_class = arch.load(arch.config_class_name)
    if arch.layer_types:
        assert set(arch.layer_types) == set(config_class.allowed_layer_types)
    kinds = getattr(arch.load(arch.config_class_name)(**arch.tiny_config_kwargs(4)), "layer_types", None) or []
    assert set(kinds) <= set(arch.layer_types) | set(ALLOWED_LAYER_TYPES)


@every_architecture
def test_mixers_and_reference_ops(arch):
    """Its mixers are modules of hf_hybrid/layers/ that its modeling file builds, and every op they
    run has a readable reference (kernels/<op>/reference.py) and a test in tests/kernels/."""
    assert arch.mixer_modules, f"{arch.model_type}: name its mixer modules"
    for mixer in arch.mixer_modules:
        assert (ROOT / "hf_hybrid" / "layers" / f"{mixer}.py").is_file(), f"{arch.model_type}: hf_hybrid/layers/{mixer}.py is missing"
    modeling = ROOT / "hf_hybrid" / "models" / arch.model_type / f"modeling_{arch.model_type}.py"
    built = _imported_modules(modeling)
    used_ops = set()
    for mixer in arch.mixer_modules:
        path = ROOT / "hf_hybrid" / "layers" / f"{mixer}.py"
        assert f"layers.{mixer}" in built, f"{arch.model_type}: {modeling.name} does not import layers.{mixer}"
        used_ops |= _imported_modules(path)
    used_ops |= built
    kernel_tests = sorted((ROOT / "tests" / "kernels").glob("test_*.py"))
    assert arch.reference_ops, f"{arch.model_type}: name the ops its mixers run"
    for op in arch.reference_ops:
        assert (ROOT / "kernels" / op / "reference.py").is_file(), f"{arch.model_type}: kernels/{op}/reference.py is missing"
        assert any(name.endswith(f"kernels.{op}") or f"kernels.{op}." in name for name in used_ops), (
            f"{arch.model_type}: no mixer of it (nor its modeling file) imports kernels.{op}"
        )
        assert any(f"hf_hybrid.kernels.{op}" in name for path in kernel_tests for name in _imported_modules(path)), (
            f"{arch.model_type}: no test of tests/kernels/ imports hf_hybrid.kernels.{op}"
        )


@every_architecture
def test_model_card(arch):
    assert (ROOT / "model_cards" / arch.model_card).is_file(), f"model_cards/{arch.model_card} is missing"


@every_architecture
def test_tests(arch):
    assert (ROOT / "tests" / "models" / f"test_{arch.model_type}.py").is_file(), f"tests/models/test_{arch.model_type}.py is missing"


@every_architecture
def test_tiny_fixture_runs_and_peft_targets_exist(arch):
    """The tiny fixture builds a model that runs, and each default peft target names modules of it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.model_type, **arch.tiny_config_kwargs())).eval()
    with torch.no_grad():
        logits = model(torch.arange(3, 9).unsqueeze(0)).logits
    assert logits.shape == (1, 6, arch.tiny_config_kwargs()["vocab_size"]) and torch.isfinite(logits).all()
    leaf_names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    missing = [target for target in arch.peft_targets if target not in leaf_names]
    assert not missing, f"{arch.model_type}: peft targets {missing} name no module of the model"
    from hf_hybrid.peft import PEFT_TARGET_MODULES

    assert PEFT_TARGET_MODULES[arch.model_type] == arch.peft_targets


@every_architecture
def test_bench_row(arch):
    from hf_hybrid.bench.models import architectures

    rows = {row.name: row.model_type for row in architectures(quick=True)}
    assert rows.get(arch.bench_row) == arch.model_type, (
        f"{arch.model_type}: the model bench (hf_hybrid/bench/models.py) has no row {arch.bench_row!r} of it"
    )


@every_architecture
def test_demo_contestant(arch):
    from hf_hybrid.demo.setup import SIZES, default_contestants

    contestants = {c.key: c.model_type for c in default_contestants(SIZES["smoke"])}
    assert contestants.get(arch.demo_key) == arch.model_type, f"{arch.model_type}: the demo has no contestant {arch.demo_key!r}"


@every_architecture
def test_reproduction(arch):
    path = ROOT / "hf_hybrid" / "reproduce" / f"{arch.reproduction}.py"
    assert path.is_file(), f"{arch.model_type}: hf_hybrid/reproduce/{arch.reproduction}.py is missing"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assigned = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(target, ast.Name)}
    assert "run" in defined and {"PAPER", "PRESETS"} <= assigned, f"hf_hybrid/reproduce/{arch.reproduction}.py"


def test_model_types_match_the_registered_auto_classes():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert set(MODEL_TYPES) <= set(CONFIG_MAPPING.keys())


def _model_types_of(factories) -> set[str]:
    return {factory().model_type for factory in factories}


# Test modules whose cases are hand-picked configs per architecture (variants tuned to what each
# checks): each must still have a case of every registered architecture.
_CASE_TABLES = {
    "test_model_outputs": lambda m: _model_types_of(m.CONFIGS.values()),
    "test_attention_implementations": lambda m: _model_types_of([*m.SOFTMAX_CONFIGS.values(), *m.OTHER_CONFIGS.values()]),
    "test_assisted_decoding": lambda m: _model_types_of(factory for factory, _ in m.ARCHITECTURES.values()),
    "test_examples": lambda m: set(m.PRETRAIN_CASES),
}


@pytest.mark.parametrize("module_name", sorted(_CASE_TABLES))
def test_hand_picked_case_tables_cover_every_architecture(module_name):
    import importlib

    covered = _CASE_TABLES[module_name](importlib.import_module(module_name))
    missing = sorted(set(MODEL_TYPES) - covered)
    assert not missing, f"tests/{module_name}.py has no case of {missing}"


@every_architecture
def test_readme_lists_it(arch):
    rows = [line.split("|")[1].strip() for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|")]
    assert f"`{arch.model_type}`" in rows, f"README.md's table of architectures has no row `{arch.model_type}`"


def test_an_entry_without_its_pieces_fails_the_checklist():
    """The checks are not vacuous: a new entry naming nothing that exists fails each with the piece named."""
    from dataclasses import replace

    toy = replace(architecture("rat"), model_type="toy", class_prefix="Toy", reproduction="toy", demo_key="toy",
                  bench_row="Toy", mixer_modules=("toy_attention",), reference_ops=("toy_op",))
    for check, message in ((test_files, "hf_hybrid/models/toy/"), (test_model_card, "model_cards/toy.md"),
                           (test_tests, "tests/models/test_toy.py"), (test_bench_row, "no row 'Toy'"),
                           (test_demo_contestant, "no contestant 'toy'"), (test_reproduction, "reproduce/toy.py"),
                           (test_mixers_and_reference_ops, "layers/toy_attention.py"), (test_readme_lists_it, "`toy`")):
        with pytest.raises(AssertionError, match=message.replace("(", r"\(")):
            check(toy)
