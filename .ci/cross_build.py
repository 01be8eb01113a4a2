"""Builds csrc/ for another platform with the sources and flags that setup.py passes there, against a torch wheel
unpacked for that platform (.ci/macos_cross_build, .ci/aarch64_tests).

setup.py itself is run with `sys.platform` set to the target and `setuptools.setup` recording its arguments, so
its platform logic is the one source of the flags. What torch's BuildExtension adds at build time (the defines
and the C++ standard, torch/utils/cpp_extension.py) and what the target's CPython adds (its CFLAGS) come from
the caller.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import setuptools
import setuptools.command.build_ext  # noqa: F401  (loaded with the real sys.platform: it reads sysconfig)
import torch
import torch.utils.cpp_extension  # noqa: F401  (likewise; setup.py imports BuildExtension from it)

REPO = Path(__file__).resolve().parent.parent
# torch.utils.cpp_extension.BuildExtension: added to every C++ compile of an extension named torch_sparse_metal._C.
BUILD_EXTENSION_FLAGS = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C", "-std=c++20"]


def setup_extension(platform: str, cuda_home: str | None = None) -> setuptools.Extension:
    """The extension that setup.py builds on `platform` (a `sys.platform` value), its paths still the host
    torch's (see `retarget`): the CPU extension, or with `cuda_home` the CUDA one (as for a CUDA build of torch)."""
    recorded: dict = {}
    env = {"TORCH_SPARSE_METAL_CUDA": "1" if cuda_home else "0", "TORCH_SPARSE_METAL_SANITIZE": "0"}
    cuda = (mock.patch.object(torch.version, "cuda", "13.0"),
            mock.patch.object(torch.utils.cpp_extension, "CUDA_HOME", cuda_home)) if cuda_home else ()
    cwd = Path.cwd()
    os.chdir(REPO)  # setup.py globs csrc/ relative to the working directory, as pip runs it
    try:
        with (
            mock.patch.dict(os.environ, env),
            mock.patch.object(setuptools, "setup", lambda **kw: recorded.update(kw)),
            mock.patch.object(sys, "platform", platform),
            contextlib.ExitStack() as stack,
        ):
            for patch in cuda:
                stack.enter_context(patch)
            runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    finally:
        os.chdir(cwd)
    (extension,) = recorded["ext_modules"]
    return extension


def retarget(paths: list[str], torch_dir: Path) -> list[str]:
    """Host torch paths (include and library folders) moved to the same places in the target's torch."""
    host = Path(torch.__file__).resolve().parent
    return [str(torch_dir / Path(p).resolve().relative_to(host)) for p in paths]


def compile_sources(
    compiler: list[str], extension: setuptools.Extension, torch_dir: Path, out_dir: Path, cflags: list[str]
) -> list[Path]:
    """Compiles the extension's sources (in parallel) to objects in `out_dir`; fails on the first error."""
    out_dir.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{p}" for p in retarget(extension.include_dirs, torch_dir)]
    cxx = extension.extra_compile_args["cxx"]

    def compile_one(source: str) -> Path:
        obj = out_dir / Path(source).with_suffix(".o").name
        subprocess.run([*compiler, "-c", str(REPO / source), "-o", str(obj), *cflags, *includes, *cxx,
                        *BUILD_EXTENSION_FLAGS], check=True)
        return obj

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return list(pool.map(compile_one, extension.sources))


def link(
    compiler: list[str], extension: setuptools.Extension, torch_dir: Path, objects: list[Path], output: Path,
    ldflags: list[str],
) -> None:
    """Links the objects with the extension's torch libraries and link flags."""
    libdirs = [f"-L{p}" for p in retarget(extension.library_dirs, torch_dir)]
    libs = [f"-l{name}" for name in extension.libraries]
    subprocess.run([*compiler, *ldflags, *map(str, objects), "-o", str(output), *libdirs, *libs,
                    *extension.extra_link_args], check=True)
