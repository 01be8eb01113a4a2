"""Library, tools, lab: ``import torch_sparse_metal`` loads the library alone (at most 4,500 lines of Python), never
the commands (``bench``, ``selfcheck``, ``tune``, the trainer in ``train/``, their helpers), the tuner and timer
(loaded when tuning is turned on) or the test helpers; and nothing shipped, docstring examples included, imports
the repository's development tools (``tsm_dev``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The most lines of Python the library may have (issue #38).
LIBRARY_LINES = 4500
#: Modules of the package that are tools: the commands, their helpers, the tuner and timer, the test helpers.
TOOLS = ("tuning", "timing")

_CLOSURE = """
import json, sys
import torch_sparse_metal
print(json.dumps({m: getattr(sys.modules[m], "__file__", None) for m in sys.modules
                  if m.split(".")[0] in ("torch_sparse_metal", "torch_sparse_metal_tools", "char_lm", "tsm_dev")}))
"""


def test_import_loads_the_library_alone_within_its_line_budget():
    out = subprocess.run([sys.executable, "-c", _CLOSURE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    package = ROOT / "torch_sparse_metal"
    assert all(Path(f).resolve().is_relative_to(package) for f in loaded.values() if f), loaded  # this checkout's
    parts = {m: m.split(".") for m in loaded}
    tools = sorted(m for m, p in parts.items() if p[0] != "torch_sparse_metal" or len(p) > 1 and p[1] in TOOLS)
    assert tools == []
    lines = sum(len(Path(f).read_text().splitlines()) for f in loaded.values() if f and f.endswith(".py"))
    assert lines <= LIBRARY_LINES, f"the library is {lines} lines of Python, over {LIBRARY_LINES}"


def test_nothing_shipped_imports_the_development_tools():
    """The package (its docstring examples included) and the examples: a mention of tsm_dev in prose is fine, an
    import is not (the Metal hosts' examples get the executor from the tests' doctest namespace)."""
    importing = re.compile(r"^\s*(?:>>>\s*)?(?:from\s+tsm_dev[\s.]|import\s+tsm_dev\b)", re.MULTILINE)
    files = [*(ROOT / "torch_sparse_metal").rglob("*.py"), *(ROOT / "torch_sparse_metal_tools").rglob("*.py"),
             *(ROOT / "examples").rglob("*.py")]
    assert len(files) > 30
    assert [str(f.relative_to(ROOT)) for f in files if importing.search(f.read_text())] == []
