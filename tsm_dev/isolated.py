"""Run named cases in a child process that may crash: a segfault or abort ends one case, not the caller.

``run_isolated("pkg.module:function", names)`` starts ``python -m tsm_dev.isolated`` on the
names; the child calls ``function(name)`` for each, one JSON line per case (flushed before the next starts). When
the child dies mid-case, that case is recorded as a crash (its signal or exit status) and a fresh child resumes
with the next name, so one bad case costs one interpreter start, not the whole run. With
``TORCH_SPARSE_METAL_ISOLATED_TRACEBACK`` set, a case that raised also records its traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Outcome", "run_isolated"]


@dataclass(frozen=True)
class Outcome:
    """``status``: "returned" (``detail``: the function's JSON-able result), "raised" (``error``: the exception's
    type name, ``detail``: its message) or "crashed" (``detail``: how the process ended)."""

    status: str
    error: str = ""
    detail: object = None


def run_isolated(target: str, names: list[str], timeout: float = 600.0, env: dict | None = None
                 ) -> dict[str, Outcome]:
    """Outcome of ``target(name)`` for every name, each case crash-isolated (see the module docstring)."""
    results: dict[str, Outcome] = {}
    todo = list(names)
    # the child imports this package from the repository root, wherever the caller's working directory is
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    child_env = {**os.environ, **(env or {}), "PYTHONFAULTHANDLER": "1", "PYTHONPATH": path}
    while todo:
        proc = subprocess.run([sys.executable, "-m", __name__, target], input="\n".join(todo), text=True,
                              capture_output=True, timeout=timeout, env=child_env)
        if not proc.stdout.startswith("ready\n"):  # the target did not even import: no case to blame
            raise RuntimeError(f"the child process could not start {target}: {proc.stderr[-2000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                results[record["name"]] = Outcome(record["status"], record.get("error", ""), record.get("detail"))
        todo = [n for n in todo if n not in results]
        if todo:  # the child ended inside todo[0]
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
            results[todo.pop(0)] = Outcome("crashed", detail=f"{how}; stderr: {proc.stderr[-2000:]}")
    return results


def demo(name: str) -> str:
    """A case function for testing the runner: ``"segfault"`` crashes the process, anything else returns."""
    if name == "segfault":
        import ctypes

        ctypes.string_at(0)
    return name


def _child(target: str) -> None:
    module, function = target.split(":")
    run = getattr(importlib.import_module(module), function)
    print("ready", flush=True)
    for name in sys.stdin.read().split("\n"):
        if not name:
            continue
        try:
            record = {"name": name, "status": "returned", "detail": run(name)}
        except Exception as exc:  # noqa: BLE001 - every exception is an outcome to report
            record = {"name": name, "status": "raised", "error": type(exc).__name__, "detail": str(exc)}
            if os.environ.get("TORCH_SPARSE_METAL_ISOLATED_TRACEBACK"):
                record["traceback"] = traceback.format_exc()
        print(json.dumps(record, default=repr), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
