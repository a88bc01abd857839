"""Self-contained code for checkpoints: load with trust_remote_code=True where hf-hybrid is not installed.

transformers' remote-code loader copies the file named in ``config.auto_map`` plus every file it
imports as ``from .name import ...`` *from the same folder*, recursively. Our model code lives in
a package tree (``hf_hybrid.models.rat.modeling_rat`` imports ``...layers``, ``...kernels``), so
:func:`write_remote_code` flattens the modules an architecture needs into one folder: each module
becomes ``<flat_name>.py`` and each intra-package import is rewritten to ``from .<flat_name> import``.
Only import statements change; the code itself is copied verbatim.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import os
from pathlib import Path

from .models.registry import architecture_classes

PACKAGE = "hf_hybrid"


def _flat_name(module: str, entry_points: dict[str, str]) -> str:
    if module in entry_points:
        return entry_points[module]
    return "hfh_" + module.removeprefix(PACKAGE + ".").replace(".", "_")


def _module_source(module: str) -> tuple[str, tuple[tuple[ast.ImportFrom, str], ...]]:
    """(source, its package imports: :func:`_package_imports`) of ``module``'s file."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot locate the source of {module}")
    stat = os.stat(spec.origin)
    return _parsed_source(module, spec.origin, spec.submodule_search_locations is not None, (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=1024)
def _parsed_source(module: str, origin: str, is_package: bool, version: tuple[int, int]):
    """One read and parse per version of a file (``version``: its mtime and size): every save_pretrained
    bundles the same ~60 modules again (~0.4 s of parsing each time)."""
    source = Path(origin).read_text(encoding="utf-8")
    return source, tuple(_package_imports(ast.parse(source), module, is_package))


def _package_imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[ast.ImportFrom, str]]:
    """Every ``from X import ...`` inside the package, with X resolved to an absolute module name."""
    base = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == PACKAGE for alias in node.names):
            raise ValueError(f"{module}: `import {PACKAGE}...` cannot be bundled; use a relative `from` import")
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = importlib.util.resolve_name("." * node.level + (node.module or ""), base)
        elif node.module and node.module.split(".")[0] == PACKAGE:
            target = node.module
        else:
            continue
        if node.module is None:
            # `from . import name` reads an attribute of the package's __init__, which is bundled like
            # any module; a submodule imported that way has no flat equivalent.
            submodules = [a.name for a in node.names if importlib.util.find_spec(f"{target}.{a.name}") is not None]
            if submodules:
                raise ValueError(
                    f"{module}: `from . import {', '.join(submodules)}` imports a submodule, which cannot be bundled; "
                    "import from the module itself"
                )
        found.append((node, target))
    return found


def bundle_modules(entry_points: dict[str, str]) -> dict[str, str]:
    """{file name: source} for the given modules and everything they import from the package.

    ``entry_points`` maps module names to the file stems they get (e.g. the modeling module to
    ``modeling_rat``), so that ``config.auto_map`` can name them.
    """
    files: dict[str, str] = {}
    pending, seen = list(entry_points), set()
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        source, imports = _module_source(module)
        lines = source.splitlines(keepends=True)
        # Rewrite from the bottom so earlier line numbers stay valid.
        for node, target in sorted(imports, key=lambda item: item[0].lineno, reverse=True):
            names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
            indent = lines[node.lineno - 1][: node.col_offset]
            lines[node.lineno - 1 : node.end_lineno] = [f"{indent}from .{_flat_name(target, entry_points)} import {names}\n"]
            pending.append(target)
        files[_flat_name(module, entry_points) + ".py"] = "".join(lines)
    return files


def write_remote_code(model, directory: str | Path) -> dict[str, str]:
    """Write the flattened code of ``model``'s architecture into ``directory`` and point
    ``config.json``'s auto_map at it. Returns the auto_map."""
    directory = Path(directory)
    config_module = type(model.config).__module__
    model_module = type(model).__module__
    entry_points = {config_module: config_module.rpartition(".")[2], model_module: model_module.rpartition(".")[2]}
    for name, source in bundle_modules(entry_points).items():
        (directory / name).write_text(source, encoding="utf-8")
    # Every Auto class of the architecture (base model, causal LM, task heads), whichever of them
    # was saved: a classifier fine-tuned from a causal-LM checkpoint loads through the same code.
    auto_map = {"AutoConfig": f"{entry_points[config_module]}.{type(model.config).__name__}"}
    for auto_class, model_class in architecture_classes(model.config.model_type).items():
        if model_class.__module__ == model_module:
            auto_map[auto_class] = f"{entry_points[model_module]}.{model_class.__name__}"
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return auto_map
