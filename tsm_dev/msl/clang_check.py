"""Strict syntax pass: compile Metal source with ``clang++ -fsyntax-only``, address spaces mapped to clang
address spaces (``device`` = 1, ``constant`` = const 2, ``threadgroup`` = 3, ``thread`` = default).

g++ (the executor) erases address spaces, so it accepts e.g. a ``device float*`` passed where a
``threadgroup float*`` is expected, or a store through ``constant`` memory; the Metal compiler rejects both,
and so does this pass. Template kernels are checked through their ``[[host_name]]`` instantiations.

Example:
    >>> import shutil
    >>> bad = "kernel void k(constant float* c [[buffer(0)]], uint i [[thread_position_in_grid]]) { c[i] = 1; }"
    >>> if shutil.which("clang++"):
    ...     try:
    ...         check_source(bad)
    ...     except MslError as e:
    ...         print("rejected")
    rejected
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import tempfile
from pathlib import Path

from .source import DEFAULT_METAL_VERSION, HERE, MslError, preprocess, rewrite

__all__ = ["CLANG_APT_PACKAGE", "check_source", "clang_path"]

#: Debian/Ubuntu package providing clang++ (Debian 12: clang-14).
CLANG_APT_PACKAGE = "clang"

# An arm64 target, whatever the host: clang has _Float16 (Metal's half) there in every version, and on x86 only
# from clang 15 (Debian 12's clang is 14). Only types are checked, so no arm64 headers or libraries are needed;
# char stays signed, as in Metal.
_FLAGS = ["-fsyntax-only", "--target=aarch64-unknown-linux-gnu", "-fsigned-char", "-x", "c++", "-std=c++14",
          "-ffreestanding", "-nostdinc", "-fno-exceptions", "-DTSM_STRICT_ADDRESS_SPACES", "-Wno-ignored-attributes"]


def clang_path() -> str | None:
    """``clang++`` on PATH (or a versioned ``clang++-N``), else None."""
    found = shutil.which("clang++")
    if found:
        return found
    versioned = sorted(glob.glob("/usr/bin/clang++-[0-9]*"))
    return versioned[-1] if versioned else None


def check_source(source: str, filename: str = "shader.metal", metal_version: int = DEFAULT_METAL_VERSION) -> None:
    """Raise :class:`MslError` with clang's diagnostics unless ``source`` passes the strict pass, preprocessed at
    ``__METAL_VERSION__`` = ``metal_version`` (one of ``source.METAL_LANGUAGE_VERSIONS``: torch picks it by macOS
    release, so ``#if __METAL_VERSION__`` paths differ between Macs)."""
    clang = clang_path()
    if clang is None:
        raise MslError(f"clang++ not found (apt-get install {CLANG_APT_PACKAGE})")
    text = rewrite(preprocess(source, filename, metal_version), "static threadgroup", keep_instantiations=True)
    with tempfile.TemporaryDirectory(prefix="tsm_clang_") as tmp:
        path = Path(tmp) / (Path(filename).stem + ".cpp")
        path.write_text('#include "metal_compat.h"\n' + text)
        cmd = [clang, *_FLAGS, "-I", str(HERE), str(path)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MslError(f"strict clang pass rejected {filename} (__METAL_VERSION__={metal_version}):\n"
                       f"{proc.stderr.strip()}")
