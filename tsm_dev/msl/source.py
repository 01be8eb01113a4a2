"""Reading Metal Shading Language source for the CPU executor and the clang pass.

Only the kernel *signatures* are rewritten; kernel bodies are compiled unchanged. The steps:

1. :func:`preprocess` expands the preprocessor (instantiation macros, ``#include`` of our header) with the
   system C++ compiler, against empty stand-ins for ``<metal_stdlib>`` and friends;
2. :func:`parse_kernels` finds kernel definitions and ``[[host_name]]`` instantiations (MLX's
   ``template [[host_name("f_float")]] [[kernel]] decltype(f<float>) f<float>;``: the signature is the template's,
   written once) and their parameters;
3. :func:`rewrite` strips Metal attributes, turns ``threadgroup`` *storage* declarations into storage the
   target understands (``threadgroup float t[256];`` is a storage class, ``threadgroup float* p`` only a
   qualifier: a header alone cannot handle both) and drops or rewrites the instantiation declarations.

A guard catches what otherwise only a Mac would: :func:`check_ascii` (``torch.mps.compile_shader`` hands the
source to Metal as ASCII). :data:`METAL_LANGUAGE_RULES` says which Metal language each torch release compiles
at on each macOS, and :data:`METAL_LANGUAGE_VERSIONS` the versions the supported torch range uses on the
supported macOS releases, so that version-dependent code can be checked on every path.

Example:
    >>> ks = parse_kernels("kernel void f(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {}")
    >>> ks[0].host_name, [(p.kind, p.index, p.name) for p in ks[0].params]
    ('f', [('buffer', 0, 'y'), ('builtin', None, 'i')])
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DEFAULT_METAL_VERSION",
    "HERE",
    "METAL_LANGUAGE_RULES",
    "METAL_LANGUAGE_VERSIONS",
    "Kernel",
    "MetalLanguageRule",
    "MslCompileError",
    "MslError",
    "Param",
    "check_ascii",
    "kernel_names",
    "metal_language_version",
    "parse_kernels",
    "preprocess",
    "rewrite",
    "split_declaration",
]

HERE = Path(__file__).resolve().parent


class MslError(RuntimeError):
    """A shader the executor or the clang pass cannot accept, or a failed dispatch."""


class MslCompileError(SyntaxError, MslError):
    """Source the Metal compiler would reject too: a SyntaxError, as ``torch.mps.compile_shader`` raises for a
    compile failure (``MetalShaderLibrary::compileLibrary`` throws ``c10::SyntaxError``,
    aten/src/ATen/native/mps/OperationUtils.mm)."""


@dataclass(frozen=True)
class MetalLanguageRule:
    """The Metal language (``__METAL_VERSION__``) that torch releases ``first_torch`` to ``last_torch`` compile
    ``torch.mps.compile_shader`` source at: ``by_macos`` maps the first macOS major release of each step to its
    version (the oldest key is the oldest macOS these releases run MPS on). ``env`` releases let
    ``PYTORCH_MPS_METAL_VERSION`` (``"3.1"``, ``"3.2"`` or ``"4.0"``) choose instead; any other value is ignored
    with a warning. ``evidence`` says where the rule was read."""

    first_torch: tuple[int, int]
    last_torch: tuple[int, int]
    by_macos: dict[int, int]
    env: bool
    evidence: str


#: Per torch release range, in order and without gaps. The only place these numbers live. PyTorch picks the version
#: in ``MetalShaderLibrary::compileLibrary`` (``aten/src/ATen/native/mps/OperationUtils.mm``; from 2.15
#: ``at::mps::metal_language_version()``), with fast math off unless ``PYTORCH_MPS_FAST_MATH`` is set.
METAL_LANGUAGE_RULES = (
    MetalLanguageRule((2, 7), (2, 9), {13: 300, 14: 310}, False,
                      "read from the 2.7.0 macOS arm64 wheel; 2.8 and 2.9 assumed (not audited)"),
    MetalLanguageRule((2, 10), (2, 10), {13: 310}, False, "read from the 2.10.0 wheel: 3.1 on every macOS"),
    MetalLanguageRule((2, 11), (2, 14), {14: 310, 15: 320, 26: 400}, False,
                      "read from the 2.13.0 and 2.14.1 wheels; 2.11 and 2.12 from pytorch/pytorch#172230 (merged "
                      "2026-01-12, after the 2.10 branch), not audited"),
    MetalLanguageRule((2, 15), (2, 15), {15: 320, 26: 400}, True,
                      "read from the 2.15.0 wheel (its MPS needs macOS 15); PYTORCH_MPS_METAL_VERSION from "
                      "pytorch/pytorch#196881"),
)
_ENV_VERSIONS = {"3.1": 310, "3.2": 320, "4.0": 400}


def metal_language_version(torch_version: tuple[int, int], macos: int, env: str | None = None) -> int | None:
    """``__METAL_VERSION__`` torch ``torch_version`` compiles at on macOS ``macos`` (its major release) with
    ``PYTORCH_MPS_METAL_VERSION=env``; None where that torch runs no MPS on that macOS.

    Example:
        >>> metal_language_version((2, 13), 15), metal_language_version((2, 7), 13)
        (320, 300)
        >>> metal_language_version((2, 15), 26, env="3.1"), metal_language_version((2, 15), 14)
        (310, None)
    """
    rule = next((r for r in METAL_LANGUAGE_RULES if r.first_torch <= torch_version[:2] <= r.last_torch), None)
    if rule is None:
        raise MslError(f"no Metal language rule for torch {torch_version}: METAL_LANGUAGE_RULES covers "
                       f"{METAL_LANGUAGE_RULES[0].first_torch} to {METAL_LANGUAGE_RULES[-1].last_torch}")
    steps = [version for first, version in sorted(rule.by_macos.items()) if first <= macos]
    if not steps:
        return None
    if rule.env and env in _ENV_VERSIONS:
        return _ENV_VERSIONS[env]
    return steps[-1]


def _supported_versions() -> tuple[int, ...]:
    """Every version the supported torch range compiles at on the macOS releases the package supports (from
    ``MIN_MACOS`` in ``metal_contract.py`` on; every step of a rule from there, and what ``env`` can choose)."""
    from torch_sparse_metal.backends.metal_contract import MIN_MACOS

    found = set()
    for rule in METAL_LANGUAGE_RULES:
        for macos in {max(first, MIN_MACOS[0]) for first in rule.by_macos}:
            found.add(metal_language_version(rule.first_torch, macos))
        if rule.env:
            found |= {v for v in _ENV_VERSIONS.values() if v <= max(rule.by_macos.values())}
    return tuple(sorted(found - {None}))


#: The ``__METAL_VERSION__`` values to check shaders at: every one the supported torch range uses on a supported
#: macOS (3.1, 3.2, 4.0).
METAL_LANGUAGE_VERSIONS = _supported_versions()
#: The executor's version: the oldest, the one every supported macOS can compile at.
DEFAULT_METAL_VERSION = METAL_LANGUAGE_VERSIONS[0]

#: Thread-position built-ins the executor supplies (Metal attribute names).
BUILTINS = (
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "dispatch_threads_per_threadgroup",
    "threads_per_grid",
    "threadgroups_per_grid",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
    "thread_execution_width",
)
_ATTR_NAMES = BUILTINS + ("buffer", "host_name", "kernel", "max_total_threads_per_threadgroup", "function_constant")
_ATTR_RE = re.compile(r"\[\[\s*(" + "|".join(_ATTR_NAMES) + r")\b\s*(?:\(([^)\]]*)\))?\s*\]\]")
_HOST_NAME = r"\[\[\s*host_name\s*\(\s*(?P<host>(?:\"[^\"]*\"\s*)+)\)\s*\]\]"
_DEF_RE = re.compile(
    r"(?:template\s*<(?P<tparams>[^<>]*)>\s*)?(?:" + _HOST_NAME + r"\s*)?"
    r"(?:\[\[\s*kernel\s*\]\]|\bkernel)\s+void\s+(?P<name>\w+)\s*\("
)
# MLX's form: ``template [[host_name("f_float_4")]] [[kernel]] decltype(f<float, 4>) f<float, 4>;`` (the signature is
# written once, in the template).
_INST_RE = re.compile(
    r"template\s*" + _HOST_NAME + r"\s*\[\[\s*kernel\s*\]\]\s*decltype\s*\(\s*(?P<name>\w+)\s*<(?P<targs>[^<>]*)>\s*\)"
    r"\s*(?P=name)\s*<[^<>]*>\s*;"
)
_WRITTEN_OUT_INST_RE = re.compile(r"template\s*" + _HOST_NAME + r"\s*kernel\s+void\s+\w+\s*<")


def _host(m: re.Match) -> str | None:
    """The host name of a match, adjacent string literals joined (``"a_" "float"`` -> ``a_float``)."""
    raw = m.group("host")
    return None if raw is None else "".join(re.findall(r'"([^"]*)"', raw))


@dataclass
class Param:
    """One kernel parameter: a ``[[buffer(i)]]`` binding or a built-in such as ``[[thread_position_in_grid]]``."""

    kind: str  # "buffer" | "builtin"
    index: int | None  # buffer index
    attr: str  # attribute name ("buffer" or the built-in)
    type: str  # declared type, address-space qualifiers included, attributes removed
    name: str


@dataclass
class Kernel:
    """A callable kernel: a host name bound to a (possibly templated) kernel function."""

    host_name: str
    function: str
    template_args: str | None
    params: list[Param] = field(default_factory=list)
    threadgroup_decls: list[str] = field(default_factory=list)  # "type name[dims]" in the function body


_LINE_DIRECTIVE_RE = re.compile(r'^\s*#\s*line\s+(\d+)(?:\s+"([^"]*)")?')


def check_ascii(source: str, filename: str = "shader.metal") -> None:
    """Raise :class:`MslError` at the first non-ASCII character: ``torch.mps.compile_shader`` hands the source to
    Metal as ASCII, so e.g. a typographic quote in a comment fails only on a Mac. Positions follow ``#line``
    directives (``load_source`` joins our header and the shader files with them); columns count characters."""
    if source.isascii():
        return
    file, line_no = filename, 1
    for line in source.split("\n"):  # not splitlines(): it also splits at some non-ASCII characters
        col = next((i for i, c in enumerate(line) if not c.isascii()), None)
        if col is not None:
            raise MslError(f"{file}:{line_no}:{col + 1}: non-ASCII character {line[col]!r} (U+{ord(line[col]):04X}); "
                           "torch.mps.compile_shader hands shader source to Metal as ASCII")
        directive = _LINE_DIRECTIVE_RE.match(line)
        if directive:  # the next line is line N (of file F)
            file, line_no = directive.group(2) or file, int(directive.group(1))
        else:
            line_no += 1


def preprocess(source: str, filename: str = "shader.metal", metal_version: int = DEFAULT_METAL_VERSION) -> str:
    """Expand the C preprocessor over ``source`` with Metal's predefined macros (line markers kept);
    ``metal_version`` is ``__METAL_VERSION__``, one of :data:`METAL_LANGUAGE_VERSIONS`."""
    check_ascii(source, filename)
    if metal_version not in METAL_LANGUAGE_VERSIONS:
        raise MslError(f"__METAL_VERSION__={metal_version} is none the supported torch releases compile at on a "
                       f"supported macOS: {METAL_LANGUAGE_VERSIONS}")
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise MslError("the MSL executor needs a C++ compiler (g++ or clang++) on PATH")
    with tempfile.TemporaryDirectory(prefix="tsm_msl_") as tmp:
        path = Path(tmp) / Path(filename).name
        path.write_text(source)
        cmd = [cxx, "-E", "-x", "c++", "-std=c++14", "-nostdinc", "-I", str(HERE / "stubs"),
               "-D__METAL__=1", f"-D__METAL_VERSION__={metal_version}", str(path)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    # diagnostics and line markers name the shader, not the temporary folder it was written to
    proc.stdout, proc.stderr = (s.replace(f"{tmp}/", "") for s in (proc.stdout, proc.stderr))
    if proc.returncode != 0:
        hint = ""
        if "c10/metal" in proc.stderr:
            hint = ("\n(the executor has no stand-ins for torch's <c10/metal/...> headers: the shaders here use "
                    "plain Metal instead)")
        raise MslCompileError(f"preprocessing {filename} failed:\n{proc.stderr.strip()}{hint}")
    return proc.stdout


def _matching(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise MslCompileError(f"unbalanced {open_ch}{close_ch} in shader source near: {text[start:start + 80]!r}")


def _split_params(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_params(text: str, kernel: str) -> list[Param]:
    params: list[Param] = []
    next_buffer = 0
    for raw in _split_params(text):
        attrs = _ATTR_RE.findall(raw)
        decl = " ".join(_ATTR_RE.sub(" ", raw).split())
        m = re.match(r"^(?P<type>.*?[\s*&])(?P<name>\w+)$", decl)
        if not m:
            raise MslError(f"kernel {kernel}: cannot parse parameter {raw!r}")
        ptype, name = m.group("type").strip(), m.group("name")
        attr = attrs[0] if attrs else ("buffer", "")
        if attr[0] == "buffer":
            index = int(attr[1]) if attr[1].strip() else next_buffer
            next_buffer = index + 1
            spaces = set(re.findall(r"\b(device|constant|threadgroup|thread)\b", ptype))
            if not ("*" in ptype or "&" in ptype) or not spaces & {"device", "constant"}:
                raise MslCompileError(f"kernel {kernel}: buffer parameter {name!r} must be a `device` or `constant` "
                               f"pointer or reference, got {ptype!r}")
            params.append(Param("buffer", index, "buffer", ptype, name))
        else:
            params.append(Param("builtin", None, attr[0], ptype, name))
    indices = [p.index for p in params if p.kind == "buffer"]
    if len(set(indices)) != len(indices):
        raise MslCompileError(f"kernel {kernel}: duplicate [[buffer(i)]] indices {indices}")
    return params


def _statement_end(text: str, start: int) -> int:
    m = re.compile(r"[;{}]").search(text, start)
    return m.start() if m else len(text)


_TG_RE = re.compile(r"\bthreadgroup\b")
_ALIGNAS_RE = re.compile(r"\balignas\s*\([^()]*\)\s*$")


def _threadgroup_storage(text: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, int, str]]:
    """``(start, end, declaration)`` of each ``threadgroup`` storage declaration in ``text[lo:hi]``.

    A declaration whose statement has no ``* & ( ) ,`` outside its array sizes is storage
    (``threadgroup float t[256];``, ``threadgroup float t[R * (C + 1)];``);
    otherwise ``threadgroup`` only qualifies a pointer or reference type."""
    hi = len(text) if hi is None else hi
    found = []
    for m in _TG_RE.finditer(text, lo, hi):
        end = _statement_end(text, m.end())
        stmt = text[m.end():end]
        outside_brackets = re.sub(r"\[[^\]]*\]", "[]", stmt)  # array sizes may hold any expression
        if text[end:end + 1] == ";" and not re.search(r"[*&(),]", outside_brackets):
            found.append((m.start(), m.end(), " ".join(stmt.split())))
    return found


def _definitions(text: str) -> Iterator[tuple[re.Match, list[Param], list[str]]]:
    """Kernel definitions (declarations without a body skipped): the match, the parameters, and the
    ``threadgroup`` storage declarations of the body."""
    for m in _DEF_RE.finditer(text):
        if text[max(0, m.start() - 1):m.start()].isalnum():
            continue
        close = _matching(text, m.end() - 1, "(", ")")
        after = text[close + 1:].lstrip()
        if not after.startswith("{"):
            continue
        params = _parse_params(text[m.end():close], m.group("name"))
        body_start = text.index("{", close)
        body_end = _matching(text, body_start, "{", "}")
        yield m, params, [d for _, _, d in _threadgroup_storage(text, body_start, body_end)]


def _instantiations(text: str) -> Iterator[re.Match]:
    """``template [[host_name("...")]] [[kernel]] decltype(f<Args>) f<Args>;`` declarations."""
    return _INST_RE.finditer(text)


def parse_kernels(text: str) -> list[Kernel]:
    """Kernels callable by host name in (preprocessed) ``text``: non-template kernels under their own name or
    their ``[[host_name]]``, templates under each instantiation's host name, with the template's parameters
    (template arguments substituted)."""
    written_out = _WRITTEN_OUT_INST_RE.search(text)
    if written_out:  # its parameters could drift from the template's: Metal binds by the instantiation
        raise MslError(f'[[host_name("{_host(written_out)}")]] ({_location(text, written_out.start())}) repeats the '
                       "kernel's signature; instantiate with decltype as the shaders do: TSM_INSTANTIATE(name, func, "
                       "template arguments...)")
    templates: dict[str, tuple[str, list[Param], list[str]]] = {}
    kernels: list[Kernel] = []
    for m, params, tg in _definitions(text):
        name = m.group("name")
        if m.group("tparams") is None:
            kernels.append(Kernel(_host(m) or name, name, None, params, tg))
        else:
            templates[name] = (m.group("tparams"), params, tg)
    for m in _instantiations(text):
        name, host, targs = m.group("name"), _host(m), m.group("targs").strip()
        where = f'[[host_name("{host}")]] ({_location(text, m.start())})'
        if name not in templates:
            raise MslCompileError(f"{where} instantiates unknown kernel template {name!r}")
        tparams, params, tg = templates[name]
        bindings = _template_bindings(tparams, targs, where)
        params = [Param(p.kind, p.index, p.attr, _substitute(p.type, bindings), p.name) for p in params]
        kernels.append(Kernel(host, name, targs, params, tg))
    names = [k.host_name for k in kernels]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise MslCompileError(f"duplicate kernel host names: {sorted(dup)}")
    return kernels


_LINE_MARKER_RE = re.compile(r'^#\s*(\d+)\s+"([^"]*)"', re.M)


def _location(text: str, pos: int) -> str:
    """``file:line`` of ``pos`` in preprocessed ``text``, from the preprocessor's line markers."""
    file, line, start = "<source>", 1, 0
    for m in _LINE_MARKER_RE.finditer(text, 0, pos):
        file, line, start = m.group(2), int(m.group(1)), text.find("\n", m.end()) + 1
    return f"{file}:{line + text.count(chr(10), start, pos)}"


def _template_bindings(tparams: str, targs: str, where: str) -> dict[str, str]:
    """``{template parameter name: argument text}`` (``"typename T, int P"``, ``"float, 4"``), defaults filling
    missing trailing arguments."""
    names, defaults = [], []
    for p in _split_params(tparams):
        decl, has_default, default = p.partition("=")
        names.append(re.findall(r"\w+", decl)[-1])
        defaults.append(default.strip() if has_default else None)
    args = _split_params(targs)
    if len(args) > len(names) or any(d is None for d in defaults[len(args):]):
        raise MslError(f"{where}: template arguments <{targs}> do not bind every parameter of template <{tparams}> "
                       "(name every template argument explicitly)")
    return dict(zip(names, args + defaults[len(args):]))


def _substitute(ptype: str, bindings: dict[str, str]) -> str:
    """``ptype`` with template parameter names replaced, as whole words, by their argument text (one pass)."""
    if not bindings:
        return ptype
    pattern = r"\b(" + "|".join(map(re.escape, bindings)) + r")\b"
    return re.sub(pattern, lambda m: bindings[m.group(1)], ptype)


def template_params(text: str) -> dict[str, str]:
    """``{kernel function: template parameter list}`` of the kernel templates in ``text``."""
    return {m.group("name"): m.group("tparams") for m in _DEF_RE.finditer(text) if m.group("tparams") is not None}


def rewrite(text: str, storage: str | Callable[[int, str], str], keep_instantiations: bool) -> str:
    """Source the target compiler accepts, line numbers preserved.

    ``storage`` replaces ``threadgroup`` in storage declarations (``"static threadgroup"`` for the clang pass,
    ``"__shared__"`` for CUDA); a callable instead replaces the whole declaration statement, given a number
    unique to the declaration and its text (``"float t[256]"``). With ``keep_instantiations`` the
    ``[[host_name]]`` instantiations become plain explicit instantiations (so their bodies are type-checked),
    else blank lines.
    """
    out = text
    for m in reversed(list(_INST_RE.finditer(out))):
        span = m.group(0)
        repl = _ATTR_RE.sub(" ", span) if keep_instantiations else "\n" * span.count("\n")
        out = out[:m.start()] + repl + out[m.end():]
    declarations = _threadgroup_storage(out)
    for number, (start, end, decl) in reversed(list(enumerate(declarations))):
        if callable(storage):
            # ``alignas(16) threadgroup float t[...];``: the callable's replacement stands for the whole
            # declaration, the specifier included (the executor cannot observe alignment: docs/metal.md)
            aligned = _ALIGNAS_RE.search(out, max(0, start - 40), start)
            start = aligned.start() if aligned else start
            stop = _statement_end(out, end) + 1
            out = out[:start] + storage(number, decl) + "\n" * out.count("\n", start, stop) + out[stop:]
        else:
            out = out[:start] + storage + out[end:]
    return _ATTR_RE.sub(" ", out)


def split_declaration(decl: str) -> tuple[str, str, str]:
    """``"float t[32][33]"`` -> ``("float", "t", "[32][33]")``: type, name and array dimensions."""
    m = re.match(r"^(?P<type>.*?)\b(?P<name>\w+)\s*(?P<dims>(\[[^\]]*\]\s*)*)$", decl)
    if not m:
        raise MslError(f"cannot parse threadgroup declaration {decl!r}")
    return m.group("type").strip(), m.group("name"), m.group("dims").replace(" ", "")


def kernel_names(source: str, filename: str = "shader.metal") -> list[str]:
    """Host names of every kernel in an unpreprocessed source (the concatenated header included)."""
    return [k.host_name for k in parse_kernels(preprocess(source, filename))]
