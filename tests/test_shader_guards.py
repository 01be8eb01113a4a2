"""Guards for what only a Mac would otherwise catch: non-ASCII shader source (``torch.mps.compile_shader`` hands
it to Metal as ASCII), ``[[host_name]]`` instantiations of templates, and code behind
``#if __METAL_VERSION__`` at each Metal language version torch compiles at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torch_sparse_metal.backends import metal_contract
from tsm_dev.msl import compile_shader
from tsm_dev.msl.clang_check import check_source, clang_path
from tsm_dev.msl.source import (
    DEFAULT_METAL_VERSION,
    METAL_LANGUAGE_RULES,
    METAL_LANGUAGE_VERSIONS,
    MslError,
    check_ascii,
    metal_language_version,
    parse_kernels,
    preprocess,
)

SHADER_DIR = Path(__file__).resolve().parents[1] / "shaders"
SHADER_FILES = sorted(p for p in SHADER_DIR.iterdir() if p.suffix in (".metal", ".h"))
VERSIONS = pytest.mark.parametrize("metal_version", METAL_LANGUAGE_VERSIONS,
                                   ids=[f"metal{v // 100}.{v % 100 // 10}" for v in METAL_LANGUAGE_VERSIONS])
needs_clang = pytest.mark.skipif(clang_path() is None, reason="clang++ not installed (apt-get install clang)")

# ------------------------------------------------------------------------------------------------- ASCII


def test_shader_files_found():
    assert any(p.suffix == ".metal" for p in SHADER_FILES), SHADER_DIR


@pytest.mark.parametrize("path", SHADER_FILES, ids=[p.name for p in SHADER_FILES])
def test_shader_file_is_ascii(path):
    # surrogateescape: bytes that are not even UTF-8 still reach check_ascii, which names their position
    check_ascii(path.read_text(encoding="utf-8", errors="surrogateescape"), path.name)


def test_check_ascii_reports_line_and_column():
    with pytest.raises(MslError, match=r"k\.metal:2:7: non-ASCII character '\u2019' \(U\+2019\)"):
        check_ascii("kernel\n// don\u2019t", "k.metal")


def test_check_ascii_follows_line_directives():
    # load_source() joins our header and the shader files with #line: report the shader's own position
    source = '#line 1 "h.h"\nint a;\n#line 1 "k.metal"\nint b;\n// caf\u00e9'
    with pytest.raises(MslError, match=r"k\.metal:2:7: "):
        check_ascii(source, "library.metal")


NON_ASCII = "// caf\u00e9: the executor and clang accept this, Metal does not\n" + (
    "kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) { out[i] = 1.0f; }")


def test_executor_refuses_non_ascii_source():
    with pytest.raises(MslError, match=r"non_ascii\.metal:1:7: non-ASCII"):
        compile_shader(NON_ASCII, "non_ascii.metal")


@needs_clang
def test_clang_pass_refuses_non_ascii_source():
    with pytest.raises(MslError, match=r"non_ascii\.metal:1:7: non-ASCII"):
        check_source(NON_ASCII, "non_ascii.metal")


# ---------------------------------------------------------------------------------------- instantiations

TEMPLATE = """template <typename T, int P>
kernel void scale(device T* out [[buffer(0)]], device const T* x [[buffer(1)]], constant T& factor [[buffer(2)]],
                  uint i [[thread_position_in_grid]]) {
  out[i] = x[i] * factor * T(P);
}
"""
INSTANCE = 'template [[host_name("scale_float_4")]] [[kernel]] decltype(scale<float, 4>) scale<float, 4>;\n'


def test_instantiation_takes_the_templates_signature_and_runs():
    import torch

    (kernel,) = parse_kernels(preprocess(TEMPLATE + INSTANCE))
    assert (kernel.host_name, kernel.function, kernel.template_args) == ("scale_float_4", "scale", "float, 4")
    assert [(p.index, p.type) for p in kernel.params[:3]] == [
        (0, "device float*"), (1, "device const float*"), (2, "constant float&")]
    x = torch.arange(5, dtype=torch.float32)
    out = torch.full_like(x, float("nan"))
    compile_shader(TEMPLATE + INSTANCE, "scale.metal").scale_float_4(out, x, 0.5, threads=5)
    assert torch.equal(out, x * 2.0)


def test_missing_template_argument_rejected():
    with pytest.raises(MslError, match="do not bind every parameter"):
        parse_kernels(preprocess(TEMPLATE + INSTANCE.replace("scale<float, 4>", "scale<float>")))


def test_default_template_argument_binds():
    text = TEMPLATE.replace("int P>", "int P = 4>") + INSTANCE.replace("scale<float, 4>", "scale<float>")
    (kernel,) = parse_kernels(preprocess(text))
    assert kernel.template_args == "float"


def test_unknown_template_rejected():
    with pytest.raises(MslError, match="unknown kernel template 'scal'"):
        parse_kernels(preprocess(TEMPLATE + INSTANCE.replace("(scale<", "(scal<").replace(") scale<", ") scal<")))


def test_instantiation_with_a_written_out_signature_refused():
    written = 'template [[host_name("scale_float_4")]] kernel void scale<float, 4>(device float* out [[buffer(0)]]);'
    with pytest.raises(MslError, match="decltype"):
        parse_kernels(preprocess(TEMPLATE + written))


# --------------------------------------------------------------------------------------- Metal versions


@VERSIONS
def test_metal_version_reaches_source(metal_version):
    assert f"int v = {metal_version};" in preprocess("int v = __METAL_VERSION__;", metal_version=metal_version)


def test_executor_default_is_oldest_version():
    assert DEFAULT_METAL_VERSION == min(METAL_LANGUAGE_VERSIONS)
    assert f"int v = {DEFAULT_METAL_VERSION};" in preprocess("int v = __METAL_VERSION__;")


@pytest.mark.parametrize("metal_version", [31, 300])
def test_unknown_metal_version_rejected(metal_version):
    # 300: torch 2.7 on macOS 13, below the supported floor
    with pytest.raises(MslError, match="none the supported torch releases compile at"):
        preprocess("int v;", metal_version=metal_version)


@needs_clang
def test_clang_pass_sees_each_version():
    # code behind `#if __METAL_VERSION__ >= N` is only checked when the pass runs at N or later
    old, new = METAL_LANGUAGE_VERSIONS[:2]
    source = f"#if __METAL_VERSION__ >= {new}\nint broken = ;\n#endif\n"
    check_source(source, "gated.metal", old)
    with pytest.raises(MslError, match=f"__METAL_VERSION__={new}"):
        check_source(source, "gated.metal", new)


# ------------------------------------------------------------------------------- the Metal language table
ROOT = SHADER_DIR.parent


def _torch_range(requirement: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``"torch>=2.7,<2.16"`` -> ((2, 7), (2, 15)): the first and the last supported release."""
    low = re.search(r">=\s*(\d+)\.(\d+)", requirement)
    high = re.search(r"<\s*(\d+)\.(\d+)", requirement)
    assert low and high, requirement
    return (int(low[1]), int(low[2])), (int(high[1]), int(high[2]) - 1)


def test_table_covers_the_supported_torch_range():
    """The rules run without gaps from the oldest torch the host accepts (metal_contract.MIN_TORCH) to the newest that
    setup.py and pyproject.toml allow."""
    setup_py = re.search(r'SUPPORTED_TORCH = "(torch[^"]*)"', (ROOT / "setup.py").read_text())[1]
    build = re.search(r'"(torch[^"]*)"', (ROOT / "pyproject.toml").read_text().split("[build-system]")[1])[1]
    assert _torch_range(setup_py) == _torch_range(build)
    first, last = _torch_range(setup_py)
    assert METAL_LANGUAGE_RULES[0].first_torch == first == metal_contract.MIN_TORCH
    assert METAL_LANGUAGE_RULES[-1].last_torch == last
    for before, after in zip(METAL_LANGUAGE_RULES, METAL_LANGUAGE_RULES[1:]):
        assert after.first_torch == (before.last_torch[0], before.last_torch[1] + 1)
    with pytest.raises(MslError, match="no Metal language rule"):
        metal_language_version((last[0], last[1] + 1), 26)


@pytest.mark.parametrize("torch_version,macos,env,want", [
    ((2, 7), 13, None, 300), ((2, 7), 14, None, 310), ((2, 7), 26, None, 310), ((2, 9), 15, None, 310),
    ((2, 10), 14, None, 310), ((2, 10), 26, None, 310),
    ((2, 13), 14, None, 310), ((2, 13), 15, None, 320), ((2, 13), 26, None, 400), ((2, 14), 26, "3.1", 400),
    ((2, 15), 14, None, None), ((2, 15), 15, None, 320), ((2, 15), 26, None, 400),
    ((2, 15), 26, "3.1", 310), ((2, 15), 26, "3.2", 320), ((2, 15), 15, "5.0", 320),
])
def test_metal_language_per_torch_and_macos(torch_version, macos, env, want):
    """What the macOS arm64 wheels compile compile_shader source at (MetalShaderLibrary::compileLibrary,
    aten/src/ATen/native/mps/OperationUtils.mm; from 2.15 at::mps::metal_language_version(), which reads
    PYTORCH_MPS_METAL_VERSION: "3.1", "3.2" or "4.0", anything else ignored with a warning)."""
    assert metal_language_version(torch_version, macos, env) == want


def test_versions_checked_are_those_of_supported_macos():
    """One macOS floor (metal_contract.MIN_MACOS): the versions the shaders are checked at are every one a supported
    torch uses from there on; bfloat (Metal 3.1) is in all of them, and torch releases whose MPS needs a newer macOS
    are the ones metal.check_mps_support names."""
    floor = metal_contract.MIN_MACOS[0]
    assert floor == 14
    used = {metal_language_version(rule.first_torch, macos, env)
            for rule in METAL_LANGUAGE_RULES for macos in range(floor, 30) for env in (None, "3.1", "3.2", "4.0")}
    assert METAL_LANGUAGE_VERSIONS == tuple(sorted(used - {None})) == (310, 320, 400)
    assert all(v >= metal_contract.METAL_TYPE_VERSIONS["bfloat"][0] for v in METAL_LANGUAGE_VERSIONS)
    newer = {rule.first_torch: min(rule.by_macos) for rule in METAL_LANGUAGE_RULES if min(rule.by_macos) > floor}
    assert newer == {first: macos[0] for first, macos in metal_contract.TORCH_MIN_MACOS}
