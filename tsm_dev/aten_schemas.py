"""``python -m tsm_dev.aten_schemas``: which of torch's kernels exist, per supported torch, for every op that
:mod:`torch_sparse_metal.sparse_mps_ops` registers or refuses: the committed data file
``tests/data/aten_sparse_mps_ops.json`` that ``tests/test_sparse_mps_versions.py`` checks the registrations against.

Only one torch installs here, so the facts of the others come from their wheels: for each minor version that
``setup.py``'s ``SUPPORTED_TORCH`` allows, the newest patch's macOS arm64 wheel (the build that has the MPS kernels)
is downloaded with ``pip download --no-deps --only-binary=:all: --platform macosx_14_0_arm64 --python-version 3.11
torch==X.Y.*`` (macOS 14: torch 2.12 and later publish no wheel for older macOS; pip also takes older tags for it),
and its ATen schema file, ``torchgen/packaged/ATen/native/native_functions.yaml``, is read from the zip: each
``func``'s name and overload, and the dispatch keys with kernels of torch's. A functional op with a
``structured_delegate`` also has the kernels its out= overload has for the structured backends and a generated
``CompositeExplicitAutogradNonFunctional`` one; a ``ufunc_inner_loop`` gives CPU and CUDA kernels; an op with
neither ``dispatch`` nor ``structured_delegate`` is ``CompositeImplicitAutograd`` (torchgen's rules). Only the keys
in :data:`KEYS` are kept. The wheels go into a temporary folder that is deleted afterwards (``--keep DIR`` keeps
them). Kernels registered by hand outside the schema file are not seen here (none is known for these keys); the
test suite's live check on the installed torch, and ``sparse_mps_ops`` itself at import, ask the dispatcher.

This machine's pip configuration caps torch for installs (a constraints file); a download of a macOS wheel installs
nothing, so the download runs without that file (``PIP_CONSTRAINT=/dev/null``).

Example::

    $ python -m tsm_dev.aten_schemas                        # every supported minor; rewrites the data file
    $ python -m tsm_dev.aten_schemas --versions 2.13 2.15 --out /tmp/ops.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The committed data file.
DATA = ROOT / "tests" / "data" / "aten_sparse_mps_ops.json"
#: The schema file inside a torch wheel.
YAML_PATH = "torchgen/packaged/ATen/native/native_functions.yaml"
#: The dispatch keys recorded: the three that sparse_mps_ops registers for, the CPU keys (the metadata kernels'
#: redispatch target, and what the live check compares on Linux), and the composites that serve every key.
KEYS = ("SparseCsrMPS", "SparseMPS", "MPS", "SparseCsrCPU", "SparseCPU", "CPU", "CompositeImplicitAutograd",
        "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
#: Backends whose out= kernel a structured functional op shares (torchgen's STRUCTURED_DISPATCH_KEYS, with Meta).
STRUCTURED = {"CPU", "CUDA", "MPS", "XPU", "MTIA", "Meta"}
PLATFORM = "macosx_14_0_arm64"
PYTHON = "3.11"


def supported_minors(setup_py: Path = ROOT / "setup.py") -> list[str]:
    """The minor versions ``SUPPORTED_TORCH = "torch>=A.B,<C.D"`` in ``setup.py`` allows (same major).

    Example:
        >>> supported_minors()[0]
        '2.7'
    """
    spec = re.search(r'SUPPORTED_TORCH = "torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', setup_py.read_text())
    if spec is None:
        raise ValueError(f"no SUPPORTED_TORCH = \"torch>=A.B,<C.D\" in {setup_py}")
    major, low, major_hi, high = map(int, spec.groups())
    if major != major_hi:
        raise ValueError(f"SUPPORTED_TORCH spans majors {major} and {major_hi}: list the versions with --versions")
    return [f"{major}.{minor}" for minor in range(low, high)]


def op_names() -> list[str]:
    """Every op name (``name`` or ``name.overload``) that sparse_mps_ops registers or refuses, sorted.

    Example:
        >>> "sparse_sampled_addmm" in op_names()
        True
    """
    from torch_sparse_metal import sparse_mps_ops

    return sorted({name for name, _key in sparse_mps_ops.entries()})


def kernels(functions: list[dict[str, Any]], names: list[str]) -> dict[str, list[str] | None]:
    """For each of ``names``, the keys of :data:`KEYS` that torch has a kernel for (None: no such op), from the
    parsed ``native_functions.yaml``.

    Example:
        >>> yaml = [{"func": "mm.out(Tensor self) -> Tensor", "structured": True, "dispatch": {"CPU, MPS": "k"}},
        ...         {"func": "mm(Tensor self) -> Tensor", "structured_delegate": "mm.out",
        ...          "dispatch": {"SparseCsrCPU": "s"}},
        ...         {"func": "t(Tensor self) -> Tensor"}]
        >>> found = kernels(yaml, ["mm", "t", "nope"])
        >>> found["mm"]
        ['MPS', 'SparseCsrCPU', 'CPU', 'CompositeExplicitAutogradNonFunctional']
        >>> found["t"], found["nope"]
        (['CompositeImplicitAutograd'], None)
    """
    by_name: dict[str, dict[str, Any]] = {}
    autogen: set[str] = set()
    for entry in functions:
        if "func" not in entry:
            continue
        name = entry["func"].split("(", 1)[0].strip()
        by_name[name.removesuffix(".default")] = entry
        autogen.update(a.strip() for a in str(entry.get("autogen", "")).split(",") if a.strip())

    def keys_of(entry: dict[str, Any]) -> set[str]:  # ufunc_inner_loop: CPU and CUDA kernels generated from it
        ufunc = {"CPU", "CUDA"} if entry.get("ufunc_inner_loop") else set()
        return ufunc | {k.strip() for group in (entry.get("dispatch") or {}) for k in group.split(",")}

    out: dict[str, list[str] | None] = {}
    for name in names:
        entry = by_name.get(name)
        if entry is None:
            out[name] = ["CompositeExplicitAutograd"] if name in autogen else None  # torchgen's generated kernels
            continue
        found = keys_of(entry)
        delegate = entry.get("structured_delegate")
        if delegate:  # the structured backends' kernels, and the functional kernel torchgen generates
            found |= (keys_of(by_name[delegate]) & STRUCTURED) | {"CompositeExplicitAutogradNonFunctional"}
        if not entry.get("dispatch") and not delegate:
            found.add("CompositeImplicitAutograd")
        out[name] = [k for k in KEYS if k in found]
    return out


def download(minor: str, folder: Path) -> Path:
    """The newest ``torch==minor.*`` macOS arm64 wheel for CPython 3.11, downloaded into ``folder``."""
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}  # a download for another platform installs nothing
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--platform", PLATFORM, "--python-version", PYTHON, f"torch=={minor}.*", "-d", str(folder)],
                   check=True, env=env)
    (wheel,) = [w for w in folder.glob("torch-*.whl") if w.name.startswith(f"torch-{minor}.")]
    return wheel


def read_wheel(wheel: Path, names: list[str]) -> dict[str, Any]:
    """The record of one wheel: its file name and the :func:`kernels` of ``names``."""
    import yaml

    with zipfile.ZipFile(wheel) as z:
        text = z.read(YAML_PATH)
    functions = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return {"wheel": wheel.name, "ops": kernels(functions, names)}


def dump(data: dict[str, Any]) -> str:
    """JSON with one line per op (small diffs when a version is added)."""
    lines = ["{", f' "about": {json.dumps(data["about"])},', f' "keys": {json.dumps(data["keys"])},', ' "torch": {']
    versions = list(data["torch"].items())
    for i, (version, record) in enumerate(versions):
        lines.append(f'  "{version}": {{"wheel": {json.dumps(record["wheel"])}, "ops": {{')
        ops = list(record["ops"].items())
        lines += [f'   {json.dumps(n)}: {json.dumps(k)}{"," if j < len(ops) - 1 else ""}'
                  for j, (n, k) in enumerate(ops)]
        lines.append("  }}" + ("," if i < len(versions) - 1 else ""))
    return "\n".join([*lines, " }", "}"]) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command line.

    Example:
        >>> build_parser().parse_args(["--versions", "2.13"]).versions
        ['2.13']
    """
    parser = argparse.ArgumentParser(prog="python -m tsm_dev.aten_schemas", description=__doc__.split("\n")[0])
    parser.add_argument("--versions", nargs="+", metavar="X.Y", type=_minor,
                        help="minor versions to read (default: every one SUPPORTED_TORCH allows)")
    parser.add_argument("--out", type=Path, default=DATA, help=f"data file to write (default {DATA.relative_to(ROOT)})")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="download into DIR and keep the wheels (default: a temporary folder, deleted)")
    return parser


def _minor(text: str) -> str:
    if not re.fullmatch(r"\d+\.\d+", text):
        raise argparse.ArgumentTypeError(f"expected a minor version such as 2.13, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    """Download, read, write the data file; returns the exit status."""
    args = build_parser().parse_args(argv)
    minors = args.versions or supported_minors()
    names = op_names()
    data: dict[str, Any] = {
        "about": "Kernels of torch's for the ops torch_sparse_metal.sparse_mps_ops registers or refuses, per torch "
                 f"minor version (newest patch, {PLATFORM} wheel, {YAML_PATH}); an op's list holds the keys with a "
                 "kernel, null: no such op. Written by python -m tsm_dev.aten_schemas.",
        "keys": list(KEYS), "torch": {}}
    with tempfile.TemporaryDirectory(prefix="aten_schemas_") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for minor in minors:
            wheel = download(minor, folder)
            data["torch"][minor] = read_wheel(wheel, names)
            if args.keep is None:
                wheel.unlink()
            missing = [n for n, k in data["torch"][minor]["ops"].items() if k is None]
            print(f"torch {minor}: {wheel.name}" + (f"; no such op: {', '.join(missing)}" if missing else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(data))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
