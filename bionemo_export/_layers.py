"""The package's layers: which of its parts may import which, and the static check that keeps it so.

Each part of the package (a subpackage, or a module directly under `bionemo_export`) sits in one
layer of `LAYERS`, lowest first. A module may import from its own part, from the parts of lower
layers, and from nothing above: a planner never imports the runtime, the runtime never imports the
CLI. Parts that share a layer are independent (neither imports the other), except in the foundation,
whose small modules may use each other. This holds for every
import, at the top of a module or inside a function (a lazy import defers a cost, it does not
excuse a climb). In addition, the package's imports form no circle, whatever their kind (top
level, inside a function, for type checkers): every module can be imported first, and no two
modules need each other. A registry is filled from above, never looked up from below: the models
package imports each family, and the base class asks the registered families (`ModelFamily.claims`)
instead of importing them; the CLI's main module records the assembled commands in the package
(`cli.assembled`) instead of being imported by it.

`tests/unit/test_layers.py` runs `check(package_imports(root))`; the developer guide describes the
layers. Placing a new part is one line of `LAYERS`; a part missing from it fails the check.

Importable anywhere: the standard library only, and nothing of the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "bionemo_export"
ROOT = "(root)"
"""The unit of `bionemo_export/__init__.py` itself (its version string)."""


@dataclass(frozen=True)
class Layer:
    """One layer: its parts (units) and what they are for."""

    name: str
    units: tuple[str, ...]
    purpose: str
    independent: bool = True
    """Its parts import none of each other (False: they may, without a circle)."""


LAYERS: tuple[Layer, ...] = (
    Layer("foundation", (ROOT, "_layers", "errors", "choices", "tensors", "tasks", "procfs",
                         "digests", "templates", "memory_plan"),
          "the exception base, the choices, the tensor spec, the task table, /proc, file digests, "
          "template rendering, memory estimates: the standard library, numpy and jinja2 only", independent=False),
    Layer("served package", ("serving",),
          "the code Triton's Python backend runs inside a served repository, copied whole into each Python model "
          "(relative imports, numpy only): the served models, tokenizers, decoding and search, numerics"),
    Layer("models", ("models",), "checkpoint readers and PyTorch models of each family (torch)"),
    Layer("generation", ("generation",), "the PyTorch reference decoder and sampler"),
    Layer("planners and clients", ("model_repository", "client"),
          "plan, write and check a repository (config.pbtxt, manifest, digests); query a server"),
    Layer("exporters", ("exporters",), "PyTorch to ONNX, graph optimization, verification (torch, onnx)"),
    Layer("runtime", ("runtime",),
          "the serving host: tritonserver, supervisor, object storage, TensorRT engines"),
    Layer("build steps", ("build_records", "build_staging", "build_precision"),
          "the build's typed manifest records, its staging folder (atomic replace, signals), the precisions "
          "`precision auto` tries"),
    Layer("task kits", ("kits",),
          "each task's graphs, planner, verify check and dev-server answer (a kit per task), registered by task"),
    Layer("applications", ("build", "verify", "bench", "deploy", "dev_server", "testing", "doctor"),
          "what the commands do: build a repository, verify it, benchmark, deploy, the dev server, what this "
          "host can do (doctor: the builds' exporters and the serving host's runtime)"),
    Layer("tuning", ("tune",), "tune: search a repository's serving settings with bench's perf_analyzer runs"),
    Layer("reports", ("checkpoint_report",), "inspect: a checkpoint read as a build would read it"),
    Layer("cli", ("cli",), "the Typer commands"),
)

SERVED = "serving"
"""The served package: copied whole into each Python model's version folder (as bionemo_serving/)."""
SERVED_THIRD_PARTY = ("numpy", "onnxruntime", "triton_python_backend_utils")
"""What the served package may import besides itself and the standard library: what Triton's Python
backend has (onnxruntime only in the models that open a session)."""

HEAVY = ("torch", "onnx", "onnxruntime", "transformers", "model_navigator", "safetensors", "tensorrt")
"""Third-party packages a serving host does without: the modules that `serve`, `health`, `client`,
`deploy`, `repo push`, `doctor` and `engines build` import when loaded must not import them."""


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the importing module sees it."""

    importer: str
    """The importing module, e.g. "bionemo_export.cli.serve"."""
    target: str
    """The imported module: one of the package's ("bionemo_export.runtime.server") or a third-party top-level
    name ("torch")."""
    line: int
    kind: str = "top"
    """"top": run when the importer is imported; "lazy": inside a function, run when it is called;
    "typing": under `if TYPE_CHECKING:`, read by type checkers only."""

    @property
    def internal(self) -> bool:
        return self.target == PACKAGE or self.target.startswith(PACKAGE + ".")

    @property
    def top_level(self) -> bool:
        return self.kind == "top"

    def __str__(self) -> str:
        where = {"top": "", "lazy": " (inside a function)", "typing": " (if TYPE_CHECKING)"}[self.kind]
        return f"{self.importer} -> {self.target} (line {self.line}){where}"


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the package's file `path`, `root` being the package folder."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(root: Path) -> list[Import]:
    """Every import in the package's Python files under `root` (the `bionemo_export` folder): the
    package's own modules resolved (relative imports, `from package import module`), third-party ones
    by their top-level name. Each has its kind: top level, inside a function, or for type checkers."""
    modules = {module_name(path, root) for path in root.rglob("*.py")}
    packages = {module_name(path, root) for path in root.rglob("__init__.py")}
    found: list[Import] = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        found += _imports(tree, importer, package, modules | packages)
    return found


def _imports(tree: ast.Module, importer: str, package: str, modules: set[str]) -> list[Import]:
    found: list[Import] = []

    def target_of(module: str, name: str) -> str:
        submodule = f"{module}.{name}"
        return submodule if submodule in modules else module

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                # The TYPE_CHECKING body never runs; its `else:` does.
                visit(ast.Module(body=child.body, type_ignores=[]), "typing" if kind == "top" else kind)
                visit(ast.Module(body=child.orelse, type_ignores=[]), kind)
                continue
            inner = "lazy" if kind == "top" and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else kind
            if isinstance(child, ast.For) and _imports_every_module(child) and importer == package:
                # `for m in pkgutil.iter_modules(__path__): importlib.import_module(...)` (a registry)
                # imports each module of the package.
                found.extend(Import(importer, module, child.lineno, inner) for module in sorted(modules)
                             if module.rpartition(".")[0] == package)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    name = alias.name if alias.name.startswith(PACKAGE) else alias.name.split(".")[0]
                    found.append(Import(importer, name, child.lineno, inner))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    module = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                if module == PACKAGE or module.startswith(PACKAGE + "."):
                    for alias in child.names:
                        found.append(Import(importer, target_of(module, alias.name), child.lineno, inner))
                elif module != "__future__":
                    found.append(Import(importer, module.split(".")[0], child.lineno, inner))
            visit(child, inner)

    visit(tree, "top")
    return found


def _imports_every_module(loop: ast.For) -> bool:
    """Whether `loop` walks `pkgutil.iter_modules(__path__)` and imports what it finds."""
    walks = (isinstance(loop.iter, ast.Call) and isinstance(loop.iter.func, ast.Attribute)
             and loop.iter.func.attr == "iter_modules" and any(isinstance(a, ast.Name) and a.id == "__path__"
                                                                for a in loop.iter.args))
    return walks and any(isinstance(node, ast.Attribute) and node.attr == "import_module" for node in ast.walk(loop))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def unit_of(module: str) -> str:
    """The part a module belongs to: "runtime" for "bionemo_export.runtime.server", ROOT for the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def layer_index(layers: Sequence[Layer] = LAYERS) -> dict[str, int]:
    """Unit -> the position of its layer, lowest 0."""
    return {unit: position for position, layer in enumerate(layers) for unit in layer.units}


def unplaced(imports: Iterable[Import], modules: Iterable[str], layers: Sequence[Layer] = LAYERS) -> list[str]:
    """Parts of the package that no layer names (each must be placed before it can be checked)."""
    placed = layer_index(layers)
    seen = {unit_of(m) for m in modules} | {unit_of(i.target) for i in imports if i.internal}
    return sorted(unit for unit in seen if unit not in placed)


def climbs(imports: Iterable[Import], layers: Sequence[Layer] = LAYERS) -> list[str]:
    """Each import of the package's own modules that reaches a higher layer, or a part of its own
    layer other than its own, one line each naming both layers."""
    placed, names = layer_index(layers), [layer.name for layer in layers]
    found = []
    for imp in imports:
        if not imp.internal:
            continue
        source, target = unit_of(imp.importer), unit_of(imp.target)
        if source == target or source not in placed or target not in placed:
            continue
        if placed[target] > placed[source]:
            found.append(f"{imp}: climbs from {names[placed[source]]} to {names[placed[target]]}")
        elif placed[target] == placed[source] and layers[placed[source]].independent:
            found.append(f"{imp}: {source} and {target} share the layer {names[placed[source]]} and are independent")
    return found


def import_graph(imports: Iterable[Import], kinds: Iterable[str] = ("top",)) -> dict[str, set[str]]:
    """Module -> the package's modules that importing it imports at once (by its imports of `kinds`):
    each target, and the target's enclosing packages that the importer is not already inside
    (importing `a.b.c` runs `a/b/__init__.py` first; the importer's own packages are already loading)."""
    graph: dict[str, set[str]] = {}
    wanted = set(kinds)
    for imp in imports:
        if not (imp.internal and imp.kind in wanted):
            continue
        graph.setdefault(imp.importer, set())
        parts = imp.target.split(".")
        for end in range(2, len(parts) + 1):
            enclosing = ".".join(parts[:end])
            inside = imp.importer == enclosing or imp.importer.startswith(enclosing + ".")
            if enclosing != imp.importer and (end == len(parts) or not inside):
                graph[imp.importer].add(enclosing)
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The graph's circles: each strongly connected set of more than one module, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:  # recursion depth is bounded by the package's few hundred modules
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def loaded_with(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    """The package's modules that importing `start` imports (itself included)."""
    seen, todo = {start}, [start]
    while todo:
        for successor in graph.get(todo.pop(), ()):
            if successor not in seen:
                seen.add(successor)
                todo.append(successor)
    return seen


def heavy_imports(imports: Sequence[Import], start: str, heavy: Iterable[str] = HEAVY) -> list[str]:
    """The top-level imports of a HEAVY package that importing `start` runs, one line each."""
    loaded = loaded_with(import_graph(imports), start)
    wanted = set(heavy)
    return [str(imp) for imp in imports
            if imp.top_level and not imp.internal and imp.target in wanted and imp.importer in loaded]


def outside_the_served_package(imports: Iterable[Import]) -> list[str]:
    """Each import of the served package that reaches outside it: to another part of the package
    (the copy in a repository has none), or to a third-party package a Triton host lacks."""
    import sys

    found = []
    for imp in imports:
        if unit_of(imp.importer) != SERVED:
            continue
        if imp.internal and unit_of(imp.target) != SERVED:
            found.append(f"{imp}: the served package imports only itself (it is copied alone into repositories)")
        elif not imp.internal and imp.target not in sys.stdlib_module_names and imp.target not in SERVED_THIRD_PARTY:
            found.append(f"{imp}: the served package imports only the standard library and "
                         f"{', '.join(SERVED_THIRD_PARTY)}")
    return found


def check(imports: Sequence[Import], modules: Iterable[str], layers: Sequence[Layer] = LAYERS) -> list[str]:
    """Everything wrong with the package's imports, one line each (empty: the layers hold)."""
    problems = [f"{unit}: a part of the package in no layer: add it to LAYERS" for unit in
                unplaced(imports, modules, layers)]
    problems += climbs(imports, layers)
    problems += outside_the_served_package(imports)
    graph = import_graph(imports, kinds=("top", "typing", "lazy"))
    problems += ["import circle: " + " <-> ".join(circle) for circle in circles(graph)]
    return problems
