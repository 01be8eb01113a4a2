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


_SETUP_ARGS = """
import json, runpy, sys
import setuptools
captured = {}
setuptools.setup = lambda **kw: captured.update(kw)
runpy.run_path("setup.py", run_name="__main__")
ext = captured["ext_modules"][0]
cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else ext.extra_compile_args
print(json.dumps({"cxx": cxx, "readme": captured["long_description"],
                  "type": captured["long_description_content_type"], "description": captured["description"]}))
"""


@pytest.mark.parametrize("debug", [None, "1"])
def test_a_release_build_compiles_without_debug_information(debug, monkeypatch):
    """setup.py's compiler flags end in -g0 (after Python's own -g, so it wins) unless TORCH_SPARSE_METAL_DEBUG
    asks for debug information; the wheel's metadata carries the README as its description."""
    import json
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_SPARSE_METAL_")}
    env["TORCH_SPARSE_METAL_CUDA"] = "0"
    if debug is not None:
        env["TORCH_SPARSE_METAL_DEBUG"] = debug
    r = subprocess.run([sys.executable, "-c", _SETUP_ARGS], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    args = json.loads(r.stdout.strip().splitlines()[-1])
    debug_flags = [flag for flag in args["cxx"] if flag.startswith("-g")]
    assert debug_flags == (["-g"] if debug else ["-g0"]) and args["cxx"].index(debug_flags[0]) > 0
    assert args["readme"] == (root / "README.md").read_text(encoding="utf-8") and args["type"] == "text/markdown"
    assert args["description"]
