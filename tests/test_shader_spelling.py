"""The shaders spell what the emulation cannot vet the way shipped Metal code (PyTorch, MLX, ggml) spells it
(issue #40; docs/metal.md, "What the emulation cannot see"): the executor and the clang pass accept the other
spellings too, so only these source-level rules keep them out."""

from __future__ import annotations

import re

import pytest

from torch_sparse_metal.backends import mps
from torch_sparse_metal.backends.metal_source import load_source

FAMILIES = [("csr_linear.metal",), ("vector_csr_linear.metal",)]

# templates as MLX writes them; the instantiation macro (csr_linear_common.h TSM_INSTANTIATE) says [[kernel]] too
_KERNEL_KEYWORD_RE = re.compile(r"(?<!\[\[)\bkernel\s+(void|decltype)\b")
_KERNEL_ATTR_RE = re.compile(r"\[\[\s*kernel\s*\]\]\s*(void|decltype)\b")
_ENUM_RE = re.compile(r"\benum\s*(:|\{)")
# `(threadgroup vec4<T>*)panel`, `(threadgroup const float4*)tile`: a threadgroup array read through a vector pointer
_VECTOR_CAST_RE = re.compile(r"\(\s*threadgroup\s+(?:const\s+)?(?:[\w:]*vec\w*<[^>]*>|\w+[234])\s*\*\s*\)\s*(\w+)")


_LANE_CALL_RE = re.compile(r"\bsimd_(?:broadcast|shuffle(?:_xor|_up|_down)?)\s*\(")


def _lane_arguments(code: str) -> list[str]:
    """The last argument (the lane, mask or delta) of each simd_broadcast / simd_shuffle* call."""
    found = []
    for m in _LANE_CALL_RE.finditer(code):
        depth, start = 1, m.end()
        last = start
        for i in range(start, len(code)):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            if code[i] == "," and depth == 1:
                last = i + 1
            if depth == 0:
                found.append(code[last:i].strip())
                break
    return found


def _code(source: str) -> str:
    """``source`` without comments (they may quote the old spellings)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)


def violations(source: str) -> list[str]:
    """What breaks the spelling rules in ``source`` (a family's assembled source)."""
    code, found = _code(source), []
    if "atomic_float" in code:
        found.append("atomic_float: write atomic<float>, as PyTorch's c10/metal/atomic.h and MLX do")
    if _ENUM_RE.search(code):
        found.append("unnamed enum: write constant constexpr uint (namespace) / constexpr uint (function scope)")
    keyword, attr = _KERNEL_KEYWORD_RE.search(code), _KERNEL_ATTR_RE.search(code)
    if keyword and attr:
        found.append(f"kernel attribute spelled both {keyword.group(0)!r} and {attr.group(0)!r}")
    for arg in _lane_arguments(code):
        if not arg.startswith("ushort("):
            found.append(f"simd_* lane argument {arg!r}: pass ushort(...), Metal's parameter type")
    for m in _VECTOR_CAST_RE.finditer(code):
        name = m.group(1)
        if not re.search(r"\balignas\s*\(\s*16\s*\)\s*threadgroup\s+[\w:<>, ]+?\b" + name + r"\s*\[", code):
            found.append(f"threadgroup array {name!r} is read as a vector but not declared alignas(16)")
    return found


@pytest.mark.parametrize("files", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_shaders_follow_the_spelling_rules(files):
    source = load_source(files, mps.CONSTANTS)
    assert violations(source) == []
    assert _KERNEL_ATTR_RE.search(_code(source))  # the rules saw the kernels


def test_mps_family_is_checked():
    assert all((f,) in FAMILIES for f in mps.SHADER_FILES)


# The spellings before issue #40 (abridged from the shaders at that time): each must be caught.
_OLD = {
    "atomic_float": "kernel void k(device atomic_float* g [[buffer(0)]]) {}",
    "enum": "namespace tsm { enum : uint { kSimdWidth = 32 }; }",
    "function-enum": "template <int V> [[kernel]] void k() { enum : uint { C = V / 8 }; }",
    "mixed-kernel": "template <typename T> kernel void f() {}\n"
                    'template [[host_name("f")]] [[kernel]] decltype(f<float>) f<float>;',
    "unaligned-panel": "threadgroup float panel[4096];\n"
                       "threadgroup tsm::vec4<T>* staged = (threadgroup tsm::vec4<T>*)panel;",
    "lane-uint": "float v = simd_shuffle(x, uint(lane));",
    "unaligned-float4": "threadgroup float t[64]; float4 v = ((threadgroup const float4*)t)[0];",
}


@pytest.mark.parametrize("case", sorted(_OLD))
def test_old_spellings_are_caught(case):
    assert len(violations(_OLD[case])) == 1


def test_new_spellings_pass():
    ok = ("constant constexpr uint kSimdWidth = 32;\n"
          "template <typename T> [[kernel]] void f(device atomic<float>* g [[buffer(0)]]) {\n"
          "  constexpr uint C = 4;\n"
          "  float v = simd_broadcast(min(x, y), ushort(lane + 1));\n"
          "  alignas(16) threadgroup float panel[4096];\n"
          "  threadgroup tsm::vec4<T>* staged = (threadgroup tsm::vec4<T>*)panel;\n}\n"
          'template [[host_name("f")]] [[kernel]] decltype(f<float>) f<float>;')
    assert violations(ok) == []
