"""The package layering of docs/architecture.md, checked from the import graph of marin/.

Every import counts, at module level or inside a function: a package imports only packages on its
own floor or below, no two modules import each other (directly or around a loop), and no module
reaches for another module's private names.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYERS: list[set[str]] = [
    {"jaxcompat", "nativebuild", "runtime", "runsteps", "textfmt"},  # top-level helpers, no marin imports
    {"execution"},
    {"data", "kernels", "pools"},
    {"parallel"},
    {"models"},
    {"evaluation"},
    {"training"},
    {"scaling"},
    {"monitoring"},
    {"inference"},
    {"review"},
    {"cli", "commands"},
]
"""Floors, lowest first: the order docs/architecture.md states (a package in no floor fails the test)."""

KNOWN_PRIVATE: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "marin").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, list[str]]]:
    """``(importer, imported module, names)`` for every import of a marin module anywhere in a file."""
    out = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out += [(name, a.name, []) for a in node.names if a.name.split(".")[0] == "marin"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "marin":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.append((name, sub, []) if sub in modules else (name, node.module, [a.name]))
    return out


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else "marin"


def _floor(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"package marin.{package} is on no floor of the layering; add it to LAYERS and to "
                         "docs/architecture.md")


def test_every_import_goes_down_or_stays_in_its_package():
    modules = _modules()
    bad = []
    for importer, imported, _ in _imports(modules):
        a, b = _package(importer), _package(imported)
        if a == b or b == "marin":
            continue
        if _floor(b) >= _floor(a):
            bad.append(f"{importer} -> {imported} (floor {_floor(a)} imports floor {_floor(b)})")
    assert not bad, "imports that go up or sideways:\n  " + "\n  ".join(bad)


def test_no_import_cycles_between_modules():
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported, _ in _imports(modules):
        if imported in modules and imported != importer and not imported == importer.rsplit(".", 1)[0]:
            graph[importer].add(imported)
    # a package's __init__ importing its own modules is how a package exposes them, not a cycle
    for m in list(graph):
        graph[m] = {t for t in graph[m] if not (m.startswith(t + ".") and modules[t].name == "__init__.py")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_modules():
    modules = _modules()
    bad = [f"{importer} imports {name} from {imported}" for importer, imported, names in _imports(modules)
           for name in names if name.startswith("_") and not name.startswith("__")
           and (importer, imported, name) not in KNOWN_PRIVATE]
    assert not bad, "private names used across modules:\n  " + "\n  ".join(bad)


HEAVY = {"jax", "jaxlib", "ray", "optax", "orbax", "tensorstore", "tokenizers", "pyarrow", "draccus", "wandb",
         "lm_eval", "datasets", "scipy", "matplotlib", "tqdm", "safetensors", "zstandard", "numpy", "fsspec",
         "ml_dtypes", "scipy_openblas32", "ctypes", "playwright", "rensa", "sklearn", "tokamax"}
"""Optional or heavy dependencies: importing them inside a function can keep them off light paths."""


def _module_level_imports(tree: ast.Module) -> set[str]:
    """Every module a file imports at module level (``fsspec``, ``jax.numpy``, ``marin.data.store``)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_an_import_inside_a_function_keeps_a_heavy_dependency_off_a_light_path():
    """Inside a function, import only a heavy or optional dependency (or a marin module that brings
    one), never a module the file imports at module level anyway, and say why on the line or the one
    above (a slow submodule of a package imported at the top can be a reason)."""
    bad = []
    for path in sorted((REPO / "marin").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        at_top = _module_level_imports(tree)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                module = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name) or ""
                top = module.split(".")[0]
                line, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
                where = f"{rel}:{node.lineno}: {line.strip()}"
                if module in at_top:
                    bad.append(f"{where}  ({module} is imported at module level already)")
                elif top not in HEAVY and top != "marin":
                    bad.append(f"{where}  ({top} is neither heavy nor optional)")
                elif "#" not in line and not above.startswith("#"):
                    bad.append(f"{where}  (no reason given)")
    assert not bad, "imports inside functions (move them to the top, or say why):\n  " + "\n  ".join(sorted(set(bad)))


def test_imports_inside_functions_stay_few():
    """About a tenth of marin's imports sit inside functions (each for an optional or heavy
    dependency); the known files above hold most of the rest."""
    inside = total = 0
    for path in sorted((REPO / "marin").rglob("*.py")):
        tree = ast.parse(path.read_text())
        local = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
                total += 1
                inside += id(node) in local
    assert inside / total < 0.12, f"{inside} of {total} imports are inside functions"


def test_every_floor_names_a_package_that_exists():
    missing = [p for layer in LAYERS for p in sorted(layer)
               if not (REPO / "marin" / p).is_dir() and not (REPO / "marin" / f"{p}.py").is_file()]
    assert not missing, f"floors name packages that do not exist: {missing} (remove them here and in the doc)"


def test_the_floor_table_of_the_architecture_doc_is_this_layering():
    """docs/architecture.md's floor table names exactly these packages, floor by floor."""
    text = (REPO / "docs" / "architecture.md").read_text()
    floors = [set(re.findall(r"`([a-z_]+)`", m.group(2)))
              for m in re.finditer(r"^\| (\d+) \| ([^|]*) \|", text, re.MULTILINE)]
    assert floors == LAYERS, f"the floor table says {floors}, the layering {LAYERS}"


def test_the_layering_is_stated_in_the_architecture_doc():
    text = (REPO / "docs" / "architecture.md").read_text()
    for layer in LAYERS:
        for package in layer:
            assert f"`{package}`" in text, f"docs/architecture.md does not place `{package}` in the layering"
