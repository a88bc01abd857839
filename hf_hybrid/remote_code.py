"""Self-contained code for checkpoints: load with trust_remote_code=True where hf-hybrid is not installed.

transformers' remote-code loader copies the file named in ``config.auto_map`` plus every file it
imports as ``from .name import ...`` *from the same folder*, recursively. Our model code lives in a
package tree (``hf_hybrid.models.rat.modeling_rat`` imports ``...layers``, ``...kernels``), so
:func:`write_remote_code` writes three files per checkpoint:

* ``configuration_<arch>.py`` and ``modeling_<arch>.py``: the architecture's config and model modules,
  verbatim except for their package imports, which import from the bundle;
* ``hf_hybrid_bundle.py``: every other package module they need, each module's source verbatim as a
  string, and a small importer that makes them submodules of the bundle, so each keeps its own
  namespace and its relative imports (the code that runs is the package's own: logits are bit-equal).

transformers reads every line ``from .name import`` (in strings too) as a file to fetch, so the
bundled modules' relative imports are written ``from .. name import`` (a space after the dots, the
same import to Python) and the entry files import bundled modules the same way; one plain
``from .hf_hybrid_bundle import`` line in each entry file makes transformers fetch the bundle.
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
BUNDLE = "hf_hybrid_bundle"


def _module_source(module: str) -> tuple[str, bool, tuple[tuple[ast.ImportFrom, str], ...]]:
    """(source, is a package, its package imports: :func:`_package_imports`) of ``module``'s file."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot locate the source of {module}")
    is_package = spec.submodule_search_locations is not None
    stat = os.stat(spec.origin)
    source, imports = _parsed_source(module, spec.origin, is_package, (stat.st_mtime_ns, stat.st_size))
    return source, is_package, imports


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
            # any module; a submodule imported that way would be fetched by its name alone.
            submodules = [a.name for a in node.names if importlib.util.find_spec(f"{target}.{a.name}") is not None]
            if submodules:
                raise ValueError(
                    f"{module}: `from . import {', '.join(submodules)}` imports a submodule, which cannot be bundled; "
                    "import from the module itself"
                )
        if target == PACKAGE:
            raise ValueError(f"{module}: imports from the {PACKAGE} package itself, which is never bundled; "
                             "import from the module that defines the name")
        found.append((node, target))
    return found


def _relative_path(module: str) -> str:
    """``hf_hybrid.layers.norm`` -> ``layers.norm``: the module's name under the bundle."""
    return module.removeprefix(PACKAGE + ".")


def _rewrite_imports(source: str, imports, statement) -> str:
    """``source`` with each package import replaced by ``statement(node, target)`` (one line each)."""
    lines = source.splitlines(keepends=True)
    # Rewrite from the bottom so earlier line numbers stay valid.
    for node, target in sorted(imports, key=lambda item: item[0].lineno, reverse=True):
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        indent = lines[node.lineno - 1][: node.col_offset]
        lines[node.lineno - 1 : node.end_lineno] = [f"{indent}{statement(node, target)} import {names}\n"]
    return "".join(lines)


def _collect(entry_points: dict[str, str]) -> dict[str, tuple[str, bool, tuple]]:
    """Every package module the entry points need, transitively: {module: (source, is_package, imports)}."""
    found: dict[str, tuple[str, bool, tuple]] = {}
    pending = list(entry_points)
    while pending:
        module = pending.pop()
        if module in found:
            continue
        found[module] = _module_source(module)
        pending.extend(target for _, target in found[module][2])
    return found


def _bundled_source(module: str, source: str, is_package: bool, imports, entry_points: dict[str, str]) -> str:
    """A bundled module's source: package imports relative to the bundle, written ``from .. name``."""
    package_depth = _relative_path(module).count(".") + (1 if is_package else 0)

    def statement(node, target):
        if target in entry_points:  # a sibling file of the bundle: up to the bundle, then one more
            return f"from {'.' * (package_depth + 2)} {entry_points[target]}"
        return f"from {'.' * (package_depth + 1)} {_relative_path(target)}"

    return _rewrite_imports(source, imports, statement)


def _entry_source(source: str, imports, entry_points: dict[str, str]) -> str:
    """An entry file's source: imports of the other entry file stay plain, the rest import from the bundle."""

    def statement(node, target):
        if target in entry_points:
            return f"from .{entry_points[target]}"
        return f"from . {BUNDLE}.{_relative_path(target)}"

    rewritten = _rewrite_imports(source, imports, statement)
    # The one plain relative import of the bundle goes before the first statement that is neither the
    # docstring nor a __future__ import (no line before the first import moves in the rewrite).
    statements = ast.parse(source).body
    if statements and isinstance(statements[0], ast.Expr) and isinstance(statements[0].value, ast.Constant):
        statements = statements[1:]
    while statements and isinstance(statements[0], ast.ImportFrom) and statements[0].module == "__future__":
        statements = statements[1:]
    lines = rewritten.splitlines(keepends=True)
    first = min([statements[0].lineno] + [d.lineno for d in getattr(statements[0], "decorator_list", [])]) if statements else len(lines) + 1
    lines.insert(first - 1, f"from .{BUNDLE} import BUNDLED_MODULES  # noqa: F401  (transformers fetches the bundle)\n")
    return "".join(lines)


_BUNDLE_HEADER = """\"\"\"The hf-hybrid modules that {entry_files} use, in one file (hf_hybrid/remote_code.py wrote it).

Each module's source below is the package's file verbatim, except its package imports, written
`from .. name import` (a space after the dots: the same import to Python; transformers' loader would
read `from ..name import` as a file of the checkpoint to fetch). Importing this file makes every
module importable as a submodule of it, with its own namespace, as in the installed package.
\"\"\"
import importlib.abc
import importlib.machinery
import linecache
import sys

__path__ = []  # a package: the modules below are its submodules

# name under this file -> is a package (has submodules)
BUNDLED_MODULES = {modules}

SOURCES = {{}}
"""

_BUNDLE_IMPORTER = """

class _BundledModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    \"\"\"Finds and runs the modules of SOURCES as submodules of this file's module.\"\"\"

    prefix = __name__ + "."

    def find_spec(self, fullname, path=None, target=None):
        name = fullname[len(self.prefix):] if fullname.startswith(self.prefix) else None
        if name not in BUNDLED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=BUNDLED_MODULES[name])

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        name = module.__name__[len(self.prefix):]
        if BUNDLED_MODULES[name]:
            module.__path__ = []
        source = SOURCES.get(name)
        if source is None:  # a package whose own __init__ nothing here needs
            return
        # A file name that inspect (and so Triton's JIT) resolves through linecache.
        module.__file__ = f"{__file__}/{name.replace('.', '/')}.py"
        linecache.cache[module.__file__] = (len(source), None, source.splitlines(True), module.__file__)
        exec(compile(source, module.__file__, "exec"), module.__dict__)

    def get_source(self, fullname):
        return SOURCES.get(fullname[len(self.prefix):])


if not any(getattr(finder, "prefix", None) == _BundledModules.prefix for finder in sys.meta_path):
    sys.meta_path.insert(0, _BundledModules())
"""


_QUOTES = "'" * 3  # the sources' string delimiter (spelt so that this file can be bundled too)


def _bundle_file(modules: dict[str, tuple[str, bool]], entry_files: list[str]) -> str:
    """hf_hybrid_bundle.py for {name under the bundle: (source, is_package)}."""
    packages = {}
    for name, (_, is_package) in modules.items():
        parts = name.split(".")
        for depth in range(1, len(parts)):  # the packages above a module, bundled or not
            packages.setdefault(".".join(parts[:depth]), True)
        packages[name] = packages.get(name, False) or is_package
    listing = "{\n" + "".join(f"    {name!r}: {packages[name]},\n" for name in sorted(packages)) + "}"
    text = [_BUNDLE_HEADER.format(entry_files=" and ".join(entry_files), modules=listing)]
    for name in sorted(modules):
        source = modules[name][0]
        if _QUOTES in source or source.rstrip("\n").endswith("\\"):
            raise ValueError(f"{PACKAGE}.{name}: the bundle keeps each source in a raw string between {_QUOTES}; "
                             f"this one contains {_QUOTES} or ends in a backslash")
        text.append(f"\nSOURCES[{name!r}] = r{_QUOTES}{source}{_QUOTES}\n")
    text.append(_BUNDLE_IMPORTER)
    return "".join(text)


def bundle_modules(entry_points: dict[str, str]) -> dict[str, str]:
    """{file name: source} for the given modules and everything they import from the package.

    ``entry_points`` maps module names to the file stems they get (e.g. the modeling module to
    ``modeling_rat``), so that ``config.auto_map`` can name them. Each entry point is a file of its
    own; every other module goes into ``hf_hybrid_bundle.py``.
    """
    collected = _collect(entry_points)
    files = {}
    bundled = {}
    for module, (source, is_package, imports) in collected.items():
        if module in entry_points:
            files[entry_points[module] + ".py"] = _entry_source(source, imports, entry_points)
        else:
            bundled[_relative_path(module)] = (_bundled_source(module, source, is_package, imports, entry_points), is_package)
    files[BUNDLE + ".py"] = _bundle_file(bundled, sorted(files))
    return files


def write_remote_code(model, directory: str | Path) -> dict[str, str]:
    """Write the code of ``model``'s architecture into ``directory`` and point ``config.json``'s
    auto_map at it. Returns the auto_map."""
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
