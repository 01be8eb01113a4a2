"""Guards for what only a Mac would otherwise catch: non-ASCII shader source (``torch.mps.compile_shader`` hands
it to Metal as ASCII), ``[[host_name]]`` instantiations of templates, and code behind
``#if __METAL_VERSION__`` at each Metal language version torch compiles at."""

from __future__ import annotations

from pathlib import Path

import pytest

from tsm_dev.msl import compile_shader
from tsm_dev.msl.clang_check import check_source, clang_path
from tsm_dev.msl.source import (
    DEFAULT_METAL_VERSION,
    METAL_LANGUAGE_VERSIONS,
    MslError,
    check_ascii,
    parse_kernels,
    preprocess,
)

SHADER_DIR = Path(__file__).resolve().parents[1] / "shaders"
SHADER_FILES = sorted(p for p in SHADER_DIR.iterdir() if p.suffix in (".metal", ".h"))
VERSIONS = pytest.mark.parametrize("metal_version", list(METAL_LANGUAGE_VERSIONS.values()),
                                   ids=[k.replace(" ", "") for k in METAL_LANGUAGE_VERSIONS])
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
    assert DEFAULT_METAL_VERSION == min(METAL_LANGUAGE_VERSIONS.values())
    assert f"int v = {DEFAULT_METAL_VERSION};" in preprocess("int v = __METAL_VERSION__;")


def test_unknown_metal_version_rejected():
    with pytest.raises(MslError, match="none torch compiles at"):
        preprocess("int v;", metal_version=31)


@needs_clang
def test_clang_pass_sees_each_version():
    # code behind `#if __METAL_VERSION__ >= N` is only checked when the pass runs at N or later
    old, new = METAL_LANGUAGE_VERSIONS["macOS 14"], METAL_LANGUAGE_VERSIONS["macOS 15"]
    source = f"#if __METAL_VERSION__ >= {new}\nint broken = ;\n#endif\n"
    check_source(source, "gated.metal", old)
    with pytest.raises(MslError, match=f"__METAL_VERSION__={new}"):
        check_source(source, "gated.metal", new)
