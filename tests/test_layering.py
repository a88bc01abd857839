"""The package's imports point only down the layers DESIGN.md section 1 states.

Every module of the package (hf_hybrid/, and kernels/, conversion/, model_cards/, which install as
hf_hybrid.kernels / .conversion / .model_cards) is parsed; every import of a package module,
function-level imports included, must reach a layer at or below its own, and the units of one
layer must not import each other in a cycle. ``LAYERS`` below is the order DESIGN.md draws: change
both together.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_hybrid"
# Top-level folders of the repository that install under hf_hybrid (pyproject's package-dir).
MAPPED_FOLDERS = ("kernels", "conversion", "model_cards")

# Bottom first. Each layer: its units, each a name and the module prefixes it owns (a prefix owns
# itself and its submodules; the longest matching prefix wins). Imports go to a lower layer, or to
# another unit of the same layer without a cycle.
LAYERS: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    ("foundation", {  # import no other layer (torch / transformers only)
        "architectures": ("hf_hybrid.architectures",),
        "compat": ("hf_hybrid.compat",),
        "options": ("hf_hybrid.options",),
        "library_patches": ("hf_hybrid._compat",),
        "checkout": ("hf_hybrid._checkout",),
        "data": ("hf_hybrid.data",),
        "sparse": ("hf_hybrid.sparse",),
        "backend": ("hf_hybrid.kernels._backend",),
    }),
    ("kernels", {"kernels": ("hf_hybrid.kernels",)}),
    ("layers", {"layers": ("hf_hybrid.layers",)}),
    ("generation", {"generation": ("hf_hybrid.generation",)}),
    ("models", {"models": ("hf_hybrid.models",)}),
    ("things done to models", {
        "sharing": ("hf_hybrid.hub", "hf_hybrid.remote_code"),
        "peft": ("hf_hybrid.peft",),
        "conversion": ("hf_hybrid.conversion",),
        "adapt": ("hf_hybrid.adapt",),
        "distributed": ("hf_hybrid.distributed",),
        "training": ("hf_hybrid.training",),
    }),
    ("package", {"package": ("hf_hybrid",)}),  # hf_hybrid/__init__.py alone: registration and exports
    ("tools", {  # what users run
        "cli": ("hf_hybrid.cli",),
        "demo": ("hf_hybrid.demo",),
        "eval": ("hf_hybrid.eval",),
        "bench": ("hf_hybrid.bench",),
        "reproduce": ("hf_hybrid.reproduce",),
        "model_cards": ("hf_hybrid.model_cards",),
    }),
)
# Prefixes that own only the module itself, not its submodules (the package's __init__).
EXACT = {"hf_hybrid"}


def _module_files() -> dict[str, tuple[Path, bool]]:
    """{module name: (file, is a package __init__)} of every module the package installs."""
    folders = [(ROOT / PACKAGE, PACKAGE)] + [(ROOT / name, f"{PACKAGE}.{name}") for name in MAPPED_FOLDERS]
    modules = {}
    for folder, prefix in folders:
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((prefix,) + (parts[:-1] if is_package else parts))
            modules[name] = (path, is_package)
    return modules


MODULES = _module_files()


def _imports(module: str) -> list[tuple[int, str]]:
    """(line, imported package module) for every import of ``module``, at any depth of its code."""
    path, is_package = MODULES[module]
    base = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                try:
                    target = importlib.util.resolve_name("." * node.level + (node.module or ""), base)
                except ImportError:  # more dots than packages: fails when the line runs
                    raise AssertionError(f"{module} (line {node.lineno}): relative import beyond the package") from None
            elif node.module and node.module.split(".")[0] == PACKAGE:
                target = node.module
            else:
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                submodule = f"{target}.{alias.name}"
                found.append((node.lineno, submodule if submodule in MODULES else target))
    return found


def _unit_of(module: str) -> tuple[int, str]:
    """(layer index, unit name) owning ``module``: its longest matching prefix."""
    best = None
    for index, (_, units) in enumerate(LAYERS):
        for unit, prefixes in units.items():
            for prefix in prefixes:
                owns = module == prefix or (prefix not in EXACT and module.startswith(prefix + "."))
                if owns and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), index, unit)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS here and to DESIGN.md section 1.")
    return best[1], best[2]


def _edges() -> list[tuple[str, int, str]]:
    """(importer, line, imported) for every import between package modules."""
    return [(module, line, target) for module in sorted(MODULES) for line, target in _imports(module)]


def test_every_module_has_a_layer():
    assert len(MODULES) > 100  # the walk found the package (and its mapped folders)
    for module in MODULES:
        _unit_of(module)


def test_imports_point_down():
    names = [name for name, _ in LAYERS]
    upward = []
    for module, line, target in _edges():
        (low, _), (high, _) = _unit_of(module), _unit_of(target)
        if high > low:
            upward.append(f"{module} (line {line}) imports {target}: layer {names[low]!r} -> {names[high]!r}")
    assert not upward, "imports pointing up the layers (DESIGN.md section 1):\n" + "\n".join(dict.fromkeys(upward))


def test_units_of_a_layer_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for module, _, target in _edges():
        (layer, unit), (target_layer, target_unit) = _unit_of(module), _unit_of(target)
        if layer == target_layer and unit != target_unit:
            graph.setdefault(unit, set()).add(target_unit)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(unit for unit in graph if reaches(unit, unit, set()))
    assert not cycles, f"units importing each other in a cycle: {cycles} ({ {u: sorted(graph[u]) for u in cycles} })"


@pytest.mark.parametrize("source, expected", [
    ("from ...generation.graph_decode import DecodeGraphMixin", ["hf_hybrid.generation.graph_decode"]),
    ("def save(self):\n    from ...reproduce import rat_plus", ["hf_hybrid.reproduce.rat_plus"]),
    ("import hf_hybrid.hub", ["hf_hybrid.hub"]),
    ("from torch import nn", []),
])
def test_import_parsing_sees_function_level_and_submodule_imports(source, expected, tmp_path, monkeypatch):
    path = tmp_path / "probe.py"
    path.write_text(source, encoding="utf-8")
    monkeypatch.setitem(MODULES, "hf_hybrid.models.rat.probe", (path, False))
    assert [target for _, target in _imports("hf_hybrid.models.rat.probe")] == expected


def test_the_order_design_md_states():
    """Models build on generation's decode-step mixin; sharing and peft work on models; the package's
    __init__ sits above what it registers and below the tools."""
    layer = lambda module: _unit_of(module)[0]  # noqa: E731
    assert layer("hf_hybrid.kernels.chunk_attention") < layer("hf_hybrid.layers.rat_attention")
    assert layer("hf_hybrid.layers.rat_attention") < layer("hf_hybrid.generation.graph_decode")
    assert layer("hf_hybrid.generation.graph_decode") < layer("hf_hybrid.models.common")
    assert layer("hf_hybrid.models.common") < layer("hf_hybrid.hub") < layer("hf_hybrid") < layer("hf_hybrid.reproduce")
    assert layer("hf_hybrid.compat") < layer("hf_hybrid.generation.graph_decode")
    design = (ROOT / "DESIGN.md").read_text(encoding="utf-8")
    section = design[design.index("## 1."):design.index("## 2.")]
    for name, units in LAYERS:
        assert name in section, f"DESIGN.md section 1 does not name the layer {name!r}"
