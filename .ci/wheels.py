#!/usr/bin/env python3
"""The binary wheels CI builds (docs/architecture.md, "Wheels"): packing a cross-built extension as a wheel,
checking a wheel's structure, and installing one where no compiler can run.

    python .ci/wheels.py check WHEEL PLATFORM [--reference WHEEL]  # a valid wheel for PLATFORM, as the reference
    python .ci/wheels.py install PYTHON WHEEL [PIP_ARGS...]          # PYTHON -m pip install, compilers stubbed
    python .ci/wheels.py reference                                   # the host's wheel from .ci/wheel, or exit

.ci/wheel builds the host's wheel with `python -m build` into WHEELS/<platform>; .ci/macos_cross_build and
.ci/aarch64_tests pack the library they build with `pack` into WHEELS/<their platform> and check it against that
host wheel: the same files with the same contents, apart from the extension (its name and bytes), WHEEL's tag and
RECORD.
"""

from __future__ import annotations

import argparse
import base64
import csv
import email.parser
import hashlib
import importlib.metadata
import io
import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
import zipfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / "build/ci/wheels"  # one folder per platform tag, each holding that platform's wheel
EXTENSION = "torch_sparse_metal/_C."  # the compiled extension's path in a wheel, less its suffix


def host_platform() -> str:
    """The host's platform tag as setuptools writes it (linux_x86_64)."""
    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def python_tag() -> str:
    """The interpreter and ABI tags of a CPython extension for the running CPython (cp311-cp311)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"{tag}-{tag}"


def reference_wheel() -> Path:
    """The host's wheel that .ci/wheel built from this tree (the cross-built wheels must hold what it holds)."""
    found = sorted((WHEELS / host_platform()).glob("torch_sparse_metal-*.whl"))
    if len(found) != 1:
        sys.exit(f"wheels: FAIL: expected one wheel in {WHEELS / host_platform()}, found {len(found)}: run "
                 ".ci/wheel first (it builds the host's wheel that the cross-built wheels are compared with)")
    return found[0]


def pack(extension: Path, filename: str, platform: str, out_dir: Path) -> Path:
    """A wheel of the package for `platform` (a platform tag such as macosx_14_0_arm64), packed by setup.py's own
    bdist_wheel from this tree, with the library `extension` (built for that platform) as the compiled extension
    under `filename`. The interpreter and ABI tags are the running CPython's, which must match the target's."""
    from setuptools.command.build_ext import build_ext

    class Prebuilt(build_ext):
        """build_ext that places the cross-built library where the compiled one would go."""

        def run(self):
            target = Path(self.build_lib) / "torch_sparse_metal" / filename
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(extension, target)

    import setuptools

    extension, out_dir = extension.resolve(), out_dir.resolve()
    real_setup = setuptools.setup
    shutil.rmtree(out_dir, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="tsm-wheel-") as tmp:
        args = ["-q", "build", "--build-base", f"{tmp}/build", "egg_info", "--egg-base", tmp,
                "bdist_wheel", "--plat-name", platform, "--bdist-dir", f"{tmp}/bdist", "--dist-dir", str(out_dir)]

        def setup(**kw):
            real_setup(**{**kw, "cmdclass": {**kw.get("cmdclass", {}), "build_ext": Prebuilt},
                          "script_name": "setup.py", "script_args": args})

        cwd = Path.cwd()
        os.chdir(REPO)  # setup.py's paths are relative to the repository, as pip runs it
        try:
            with (mock.patch.dict(os.environ, {"TORCH_SPARSE_METAL_CUDA": "0", "TORCH_SPARSE_METAL_SANITIZE": "0"}),
                  mock.patch.object(setuptools, "setup", setup), warnings.catch_warnings()):
                # bdist_wheel runs the install command, which warns when setup.py is run directly (as here)
                warnings.simplefilter("ignore", setuptools.SetuptoolsDeprecationWarning)
                runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
        finally:
            os.chdir(cwd)
    (wheel,) = out_dir.glob("*.whl")
    return wheel


def _record(z: zipfile.ZipFile, dist_info: str) -> dict[str, str]:
    """RECORD's {path: hash}, each hash checked against the file's bytes; every file listed, and only those."""
    rows = list(csv.reader(io.StringIO(z.read(f"{dist_info}/RECORD").decode())))
    record = {path: digest for path, digest, _size in rows}
    problems = sorted(set(record) ^ set(z.namelist()))
    if problems:
        raise ValueError(f"RECORD and the archive list different files: {problems}")
    for path, digest in record.items():
        if path == f"{dist_info}/RECORD":
            continue
        actual = base64.urlsafe_b64encode(hashlib.sha256(z.read(path)).digest()).rstrip(b"=").decode()
        if digest != f"sha256={actual}":
            raise ValueError(f"RECORD's hash of {path} is {digest}, the file's sha256={actual}")
    return record


def check(wheel: Path, platform: str, reference: Path | None = None) -> bytes:
    """Checks that `wheel` is a valid wheel of this package for `platform` and the running CPython: RECORD's hashes,
    WHEEL's tag (the file name's), METADATA's torch requirement (the running torch's minor version, which the
    extension was built against), one compiled extension named for that CPython and platform. With `reference`,
    the wheel must hold the same files as that one with the same contents, apart from the extension, WHEEL and
    RECORD. Returns the extension's bytes; raises ValueError on the first problem."""
    name, version, *tag = wheel.name.removesuffix(".whl").split("-")
    expected_tag = f"{python_tag()}-{platform}"
    if "-".join(tag) != expected_tag:
        raise ValueError(f"{wheel.name}: the file name's tag is {'-'.join(tag)}, not {expected_tag}")
    dist_info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as z:
        record = _record(z, dist_info)
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/WHEEL").decode())
        if meta.get_all("Tag") != [expected_tag] or meta["Root-Is-Purelib"] != "false":
            raise ValueError(f"WHEEL: Tag {meta.get_all('Tag')}, Root-Is-Purelib {meta['Root-Is-Purelib']}; "
                             f"expected Tag {expected_tag}, Root-Is-Purelib false")
        metadata = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        major, minor = importlib.metadata.version("torch").split(".")[:2]
        wanted = f"torch=={major}.{minor}.*"
        requires = metadata.get_all("Requires-Dist") or []
        if (metadata["Name"], metadata["Version"]) != (name, version) or wanted not in requires:
            raise ValueError(f"METADATA: {metadata['Name']} {metadata['Version']} requiring {requires}; expected "
                             f"{name} {version} requiring {wanted}")
        extensions = [path for path in record if path.startswith(EXTENSION)]
        suffix = extension_suffix(platform)
        if extensions != [EXTENSION + suffix.removeprefix(".")]:
            raise ValueError(f"compiled extensions {extensions}; expected one, {EXTENSION}{suffix.removeprefix('.')}")
        if reference is not None:
            with zipfile.ZipFile(reference) as ref:
                expected = _record(ref, dist_info)
            skip = {f"{dist_info}/WHEEL", f"{dist_info}/RECORD"}
            ours = {p: h for p, h in record.items() if p not in skip and not p.startswith(EXTENSION)}
            theirs = {p: h for p, h in expected.items() if p not in skip and not p.startswith(EXTENSION)}
            if ours != theirs:
                differ = sorted(p for p in set(ours) | set(theirs) if ours.get(p) != theirs.get(p))
                raise ValueError(f"files missing, extra or different from {reference.name}'s (if that wheel is "
                                 f"older than this tree, rerun .ci/wheel): {differ}")
        return z.read(extensions[0])


def extension_suffix(platform: str) -> str:
    """CPython's extension suffix on `platform` for the running CPython's version (.cpython-311-darwin.so)."""
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    if platform.startswith("macosx_"):
        return f".cpython-{version}-darwin.so"
    for machine in ("x86_64", "aarch64"):
        if platform.startswith(("linux_", "manylinux")) and platform.endswith(machine):
            return f".cpython-{version}-{machine}-linux-gnu.so"
    raise ValueError(f"no extension suffix known for platform {platform}")


def install(python: str, wheel: Path, pip_args: list[str]) -> None:
    """`python -m pip install` of the wheel with every compiler on PATH (and $CC, $CXX) failing loudly: installing
    the wheel must not compile anything."""
    with tempfile.TemporaryDirectory(prefix="no-compiler-") as stubs:
        for tool in ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc"):
            stub = Path(stubs) / tool
            stub.write_text(f'#!/bin/sh\necho "{tool} called while installing a wheel" >&2\nexit 1\n')
            stub.chmod(0o755)
        env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "CC": "false", "CXX": "false"}
        subprocess.run([python, "-m", "pip", "install", "-q", *pip_args, str(wheel)], env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="a valid wheel of this package for PLATFORM")
    p.add_argument("wheel", type=Path)
    p.add_argument("platform")
    p.add_argument("--reference", type=Path, help="a wheel whose files this one must hold")
    p = sub.add_parser("install", help="PYTHON -m pip install -q [PIP_ARGS] WHEEL with the compilers stubbed")
    p.add_argument("python")
    p.add_argument("wheel", type=Path)
    p.add_argument("pip_args", nargs=argparse.REMAINDER)
    sub.add_parser("reference", help="the path of the host's wheel that .ci/wheel built; fails if there is none")
    args = parser.parse_args()
    if args.command == "check":
        try:
            check(args.wheel, args.platform, args.reference)
        except ValueError as e:
            sys.exit(f"wheels: FAIL: {args.wheel.name}: {e}")
        print(f"wheels: {args.wheel.name}: valid (RECORD, WHEEL, METADATA)")
    elif args.command == "install":
        install(args.python, args.wheel, args.pip_args)
    else:
        print(reference_wheel())


if __name__ == "__main__":
    main()
