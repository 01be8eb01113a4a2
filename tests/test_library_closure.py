"""The package is the library: ``import torch_sparse_metal`` loads library modules alone, never the commands
(``torch_sparse_metal_tools``), the training example (``examples/char_lm``) or the repository's development tools
(``tsm_dev``); the library's modules import one another in one direction (no circle), and so do its packages, each
taken as one; they import at the top of the module (a function imports late only what is optional and outside the
package), with no module ``__getattr__`` forwarding names; and nothing shipped, docstring examples included,
imports the development tools."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torch_sparse_metal"
#: Top-level packages of this repository that are not the library.
NOT_LIBRARY = ("torch_sparse_metal_tools", "char_lm", "tsm_dev")

_CLOSURE = """
import json, sys
import torch_sparse_metal
print(json.dumps({m: getattr(sys.modules[m], "__file__", None) for m in sys.modules
                  if m.split(".")[0] in ("torch_sparse_metal", "torch_sparse_metal_tools", "char_lm", "tsm_dev")}))
"""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every Python module of the library, by dotted name.
MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
#: The compiled extension (setup.py builds it): a module of its own, not a name of the package face.
EXTENSION = "torch_sparse_metal._C"


def _imports(name: str) -> list[tuple[str, bool, int]]:
    """``(imported module, inside a function, line)`` for each import in module ``name``: ``from a import b`` names
    ``a.b`` where that is a module of the library, else ``a``; relative imports are resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in (*MODULES, EXTENSION) else base
                       for a in node.names]
        else:
            continue
        found += [(t, id(node) in in_function, node.lineno) for t in targets]
    return found


def test_import_loads_only_library_modules():
    out = subprocess.run([sys.executable, "-c", _CLOSURE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert "torch_sparse_metal.nn" in loaded and "torch_sparse_metal.backends.mps" in loaded
    assert sorted(m for m in loaded if m.split(".")[0] != "torch_sparse_metal") == []
    assert all(Path(f).resolve().is_relative_to(PACKAGE) for f in loaded.values() if f), loaded  # this checkout's


def test_the_library_imports_nothing_of_the_repository_beside_it():
    outside = [f"{name}:{line}: {target}" for name in MODULES for target, _, line in _imports(name)
               if target.split(".")[0] in NOT_LIBRARY]
    assert outside == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of ``graph`` meets (a node that is still on its path), each as its path."""
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def test_the_library_has_no_import_circle():
    """Each module's imports of library modules, at the top or inside functions, form no circle."""
    graph = {name: {t for t, _, _ in _imports(name) if t in MODULES and t != name} for name in MODULES}
    assert sum(map(len, graph.values())) > 50  # the walk sees the imports
    assert _circles(graph) == []


def _room(name: str) -> str:
    """The room a module stands in when each package of the library is drawn as one: ``torch_sparse_metal.ops``
    for ``torch_sparse_metal.ops._csr_linear``, the module itself at the package's root."""
    return ".".join(name.split(".")[:2])


def test_the_library_packages_import_one_another_one_way():
    """Drawn with each package (``ops/``, ``backends/``) as one room, the imports still run one way: the hosts in
    ``backends/`` stand above the ops they register kernels for, and what the ops, the tuner and the timer ask of a
    device comes from the seam below both, ``devices.py``. The package face, which imports everything, is left
    out."""
    graph: dict[str, set[str]] = {}
    for name in MODULES:
        if name != "torch_sparse_metal":
            graph.setdefault(_room(name), set()).update(
                _room(t) for t, _, _ in _imports(name)
                if t in MODULES and t != "torch_sparse_metal" and _room(t) != _room(name))
    assert {"torch_sparse_metal.ops", "torch_sparse_metal.backends"} <= set(graph)
    assert "torch_sparse_metal.ops" in graph["torch_sparse_metal.backends"]  # the walk sees the packages' imports
    assert _circles(graph) == []


def test_the_library_imports_its_own_modules_at_the_top():
    """A function imports late only what is optional and outside the package (safetensors, torch.distributed's
    checkpointing, ...), never a module of the library."""
    late = [f"{name}:{line}: {target}" for name in MODULES for target, inside, line in _imports(name)
            if inside and target.split(".")[0] in ("torch_sparse_metal", *NOT_LIBRARY)]
    assert late == []


def test_no_module_forwards_names_through_getattr():
    forwarding = [name for name, path in MODULES.items()
                  if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(
                      path.read_text()).body)]
    assert forwarding == []


def test_nothing_shipped_imports_the_development_tools():
    """The package and the commands (their docstring examples included) and the examples: a mention of tsm_dev in
    prose is fine, an import is not (the Metal hosts' examples get the executor from the tests' doctest
    namespace)."""
    importing = re.compile(r"^\s*(?:>>>\s*)?(?:from\s+tsm_dev[\s.]|import\s+tsm_dev\b)", re.MULTILINE)
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "torch_sparse_metal_tools").rglob("*.py"),
             *(ROOT / "examples").rglob("*.py")]
    assert len(files) > 30
    assert [str(f.relative_to(ROOT)) for f in files if importing.search(f.read_text())] == []


def _floors() -> dict[str, int]:
    """Each library module's floor (1: it imports no module of the package; else one above the highest it imports),
    by its path under the package; the face stands on top of everything and has none."""
    graph = {name: {t for t, _, _ in _imports(name) if t in MODULES and t not in (name, "torch_sparse_metal")}
             for name in MODULES}
    floors: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in floors:
            floors[name] = 1 + max((floor(t) for t in graph[name]), default=0)
        return floors[name]

    return {str(MODULES[n].relative_to(PACKAGE)): floor(n) for n in MODULES if n != "torch_sparse_metal"}


def test_the_architecture_page_draws_every_module_on_its_floor():
    """docs/architecture.md lists every module of the library under the floor the imports put it on."""
    drawn: dict[str, int] = {}
    current = None
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if match := re.fullmatch(r"floor (\d+)", line):
            current = int(match[1])
        elif not line.startswith("  "):
            current = None
        elif current is not None and (match := re.match(r"  (\S+\.py)\b", line)):
            drawn[match[1]] = current
    assert drawn == _floors()
