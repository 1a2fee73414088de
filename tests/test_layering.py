"""Imports flow one way through the project's layers, with no cycles and no function-local project imports.

Every module of `configs`, `pallas_kernels`, `k3jax`, `sharding`, `benchmarks` and the entry points `train.py` /
`serve.py` is parsed with `ast` (imports inside functions included; nothing is imported). The layers, bottom to
top (a module may import its own layer and the ones below; the first matching prefix decides):

  0  configs, k3jax.config, k3jax.numerics, k3jax.atomic   the config schema, dtype helpers, atomic writes
  1  pallas_kernels                                        the kernels: a leaf
  2  k3jax.ops                                             one dispatch point per op
  3  sharding                                              mesh, rules, shardings, shard_map forms of ops
  4  k3jax.layers                                          the model's layers
  5  k3jax.vision                                          the vision tower, its packing and preprocessing
  6  k3jax.model                                           K3Model and its decode cache
  7  k3jax.mtp, k3jax.eagle3                               the MTP layer and the EAGLE-3 draft (the decoder block)
  8  k3jax.param_count                                     parameter counts from shapes
  9  k3jax.data                                            tokenizers, data preparation, the Grain pipeline
  10 k3jax.convert                                         HF <-> k3jax checkpoint conversion
  11 k3jax.loading, k3jax (the package's lazy helpers)     loading models and tokenizers for training / serving
  12 k3jax.inference                                       generation, scheduling, the server
  13 k3jax.training                                        the trainer (may start from a converted checkpoint)
  14 train, serve, benchmarks                              entry points

The application layers 8-13 are ordered so that each imports only the ones before it: training reads data, loads
checkpoints (loading, convert) and counts parameters; inference loads models (loading) and uses the byte tokenizer
(data); loading reads converted checkpoints (convert) and tokenizers (data); data needs none of them.

Rules, each failure naming the file, the line and the rule:
  (a) no import cycle between modules (top-level and function-local imports alike);
  (b) no import of a module in a higher layer;
  (c) no function-local import of a project module (optional third-party dependencies may be imported lazily).
"""

from __future__ import annotations

import ast
import dataclasses
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("configs", "pallas_kernels", "k3jax", "sharding", "benchmarks")
SCRIPTS = ("train.py", "serve.py")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("configs", "k3jax.config", "k3jax.numerics", "k3jax.atomic"),
    ("pallas_kernels",),
    ("k3jax.ops",),
    ("sharding",),
    ("k3jax.layers",),
    ("k3jax.vision",),
    ("k3jax.model",),
    ("k3jax.mtp", "k3jax.eagle3"),
    ("k3jax.param_count",),
    ("k3jax.data",),
    ("k3jax.convert",),
    ("k3jax.loading", "k3jax"),
    ("k3jax.inference",),
    ("k3jax.training",),
    ("train", "serve", "benchmarks"),
)


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module
    path: str  # file, relative to the repository root
    line: int
    local: bool  # inside a function body


def _module_files() -> dict[str, str]:
    """Module name -> file path (relative to ROOT) for every scanned module."""
    out = {}
    for package in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, package)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = rel
    for script in SCRIPTS:
        out[script[:-3]] = script
    return out


MODULES = _module_files()


def _resolve(name: str) -> str | None:
    """The project module `name` refers to (its longest prefix that is a scanned module), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def _imports_of(module: str, path: str) -> list[Import]:
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule `pkg.sub` when there is one
                names = [f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") == f"{base}.{a.name}" else base
                         for a in child.names]
            else:
                visit(child, inner)
                continue
            for name in dict.fromkeys(names):
                target = _resolve(name)
                if target is not None and target != module:
                    found.append(Import(module, target, path, child.lineno, local))

    visit(tree, False)
    return found


IMPORTS = [imp for module, path in MODULES.items() for imp in _imports_of(module, path)]


def layer_of(module: str) -> int | None:
    """The layer index of `module` (the first prefix in LAYERS that it matches), or None."""
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "k3jax"):
            return index
    for index, prefixes in enumerate(LAYERS):
        if module in prefixes:  # the bare `k3jax` package
            return index
    return None


def _layer_name(index: int) -> str:
    return "/".join(LAYERS[index])


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:  # recursion depth is bounded by the module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_every_module_has_a_layer():
    missing = sorted(f"{path}: rule (layers): module {m} matches no layer in LAYERS"
                     for m, path in MODULES.items() if layer_of(m) is None)
    assert not missing, "\n".join(missing)


def test_no_import_cycles():
    problems = []
    for component in _cycles():
        members = set(component)
        edges = [f"  {imp.path}:{imp.line}: {imp.source} imports {imp.target}"
                 + (" (inside a function)" if imp.local else "")
                 for imp in IMPORTS if imp.source in members and imp.target in members]
        problems.append(f"rule (a) import cycle between {', '.join(component)}:\n" + "\n".join(edges))
    assert not problems, "\n".join(problems)


def test_imports_only_flow_down_the_layers():
    problems = []
    for imp in IMPORTS:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is not None and dst is not None and dst > src:
            problems.append(f"{imp.path}:{imp.line}: rule (b) upward import: {imp.source} (layer {src}, "
                            f"{_layer_name(src)}) imports {imp.target} (layer {dst}, {_layer_name(dst)})")
    assert not problems, "\n".join(problems)


def test_no_function_local_project_imports():
    problems = [f"{imp.path}:{imp.line}: rule (c) function-local import of project module {imp.target} in "
                f"{imp.source}" for imp in IMPORTS if imp.local]
    assert not problems, "\n".join(problems)


def test_the_scan_sees_imports_inside_functions_and_relative_imports(tmp_path):
    """The parser itself: a function-local import and a relative import are both found and resolved."""
    source = "from . import rules\n\n\ndef f():\n    from sharding.shard import resolve_spec\n    return resolve_spec\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = _imports_of("sharding.probe", os.path.relpath(path, ROOT))
    assert [(i.target, i.line, i.local) for i in found] == [("sharding.rules", 1, False), ("sharding.shard", 5, True)]
