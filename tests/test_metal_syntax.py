"""Strict clang pass over every shader: address spaces are real clang address spaces, so mistakes that g++
(the executor) silently accepts are rejected, as the Metal compiler would. The shaders are checked at every Metal
language version the supported torch releases compile at on a supported macOS, so that each
`#if __METAL_VERSION__` path is seen."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from torch_sparse_metal.backends import mps
from torch_sparse_metal.backends.metal_source import shader_defines
from tsm_dev.msl import MslError, compile_shader
from tsm_dev.msl.clang_check import CLANG_APT_PACKAGE, check_source, clang_path
from tsm_dev.msl.source import METAL_LANGUAGE_VERSIONS

pytestmark = pytest.mark.skipif(clang_path() is None,
                                reason=f"clang++ not installed (apt-get install {CLANG_APT_PACKAGE})")

SHADERS = sorted((Path(__file__).resolve().parents[1] / "shaders").glob("*.metal"))
# the host's constants (every family's and the csr_linear family's: harmless to the others), then our header
HEADER = shader_defines(mps.CONSTANTS) + (SHADERS[0].parent / mps.COMMON_HEADER).read_text() if SHADERS else ""
# torch compiles at a Metal language that depends on its release and the running macOS: one run per version the
# supported releases use (source.METAL_LANGUAGE_RULES)
VERSIONS = pytest.mark.parametrize("metal_version", METAL_LANGUAGE_VERSIONS,
                                   ids=[f"metal{v // 100}.{v % 100 // 10}" for v in METAL_LANGUAGE_VERSIONS])

_K = "kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]])"
# (id, source, fragment of clang's diagnostic, also accepted by the g++ executor?)
WRONG = [
    ("store-through-constant",
     "kernel void k(constant float* c [[buffer(0)]], uint i [[thread_position_in_grid]]) { c[i] = 1.0f; }",
     "read-only", False),
    ("device-as-threadgroup-argument",
     "void helper(threadgroup float* p) { p[0] = 1.0f; }\n" + _K + " { helper(out); }",
     "no matching function", True),
    ("device-to-thread-pointer", _K + " { float* p = out; p[i] = 1.0f; }", "cannot initialize", True),
    ("threadgroup-to-device-pointer",
     _K + " { threadgroup float t[32]; device float* p = t; out[i] = p[0]; }", "cannot initialize", True),
    ("template-instantiation",
     ("template <typename T>\nkernel void k(device T* out [[buffer(0)]], uint i [[thread_position_in_grid]]) "
     "{ thread T* p = out; p[i] = T(1); }\n"
     'template [[host_name("k_float")]] [[kernel]] decltype(k<float>) k<float>;'), "cannot initialize", True),
]


@VERSIONS
@pytest.mark.parametrize("path", SHADERS, ids=[p.name for p in SHADERS])
def test_shaders_pass_strict_pass(path, metal_version):
    check_source(HEADER + "\n" + path.read_text(), path.name, metal_version)


@VERSIONS
def test_loaded_library_source_passes(metal_version):
    check_source(mps.load_source(), "csr_linear_library.metal", metal_version)


@VERSIONS
def test_executor_test_kernels_pass(metal_version):
    spec = importlib.util.spec_from_file_location("_executor_tests", Path(__file__).with_name("test_metal_executor.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    check_source(module.SOURCE, "executor_test.metal", metal_version)


@pytest.mark.parametrize("name,source,diagnostic,gxx_accepts", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_shader_rejected(name, source, diagnostic, gxx_accepts):
    with pytest.raises(MslError, match=diagnostic):
        check_source(source, f"{name}.metal")
    if gxx_accepts:  # why the pass exists: the executor's g++ build erases address spaces
        compile_shader(source, f"{name}.metal")


def test_good_threadgroup_usage_accepted():
    check_source("using namespace metal;\nvoid helper(threadgroup float* p, uint i) { p[i] = 1.0f; }\n" + _K +
                 " { threadgroup float t[32]; helper(t, i % 32); "
                 "threadgroup_barrier(mem_flags::mem_threadgroup); out[i] = t[i % 32]; }")
