"""How the extension was built: properties whose absence once crashed the process far from their cause."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch_sparse_metal._C as ext


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("readelf") is None,
                    reason="needs Linux and binutils' readelf")
def test_extension_links_libstdcxx_dynamically():
    """A toolchain that links libstdc++ statically gives the extension its own copy beside torch's; formatting a
    number into an error message then segfaulted (docs/cuda.md, "Building")."""
    dynamic = subprocess.run(["readelf", "-d", ext.__file__], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert any(name.startswith("libstdc++.so") for name in needed), (
        f"{ext.__file__} does not load libstdc++.so (it needs {needed}): the compiler linked libstdc++ into it "
        "statically. Rebuild with the system compiler, e.g. CC=gcc CXX=g++ pip install -e . --no-build-isolation"
    )
