"""Stand-in libraries for the CUDA libraries that PyPI's Linux aarch64 torch wheel links, so that it loads under
qemu with no GPU (.ci/aarch64_tests).

That wheel is a CUDA build: even libtorch_cpu.so needs libcudart and libcupti, and the CUDA wheels it names
are not all on the package registry. Each missing soname becomes a small shared library with that soname, the
symbol versions its users require, and every symbol they import from it (functions return 100,
cudaErrorNoDevice, so torch.cuda.is_available() is False; objects are zeroed). Nothing here is a CUDA library:
it only lets the dynamic loader finish; no test that uses it may touch CUDA.

    python .ci/cuda_stubs.py SITE_PACKAGES/torch SYSROOT OUT_DIR
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import defaultdict
from pathlib import Path

CROSS_CC = "aarch64-linux-gnu-gcc"
NO_DEVICE = 100  # cudaErrorNoDevice: c10's device count reads it as zero devices
OBJECT_BYTES = 256
# readelf -W --dyn-syms: "num: value size type bind visibility [other] ndx name[@version (n)]"
_SYMBOL = re.compile(r"^\s*\d+:\s+\S+\s+\S+\s+(\w+)\s+(\w+)\s+\w+(?:\s+\[[^\]]*\])?\s+(\w+)\s+(\S+)")


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def _is_shared_object(path: Path) -> bool:
    if not path.is_file() or path.is_symlink():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def _symbols(lib: Path) -> list[tuple[str, str | None, str, str, bool]]:
    """(name, version or None, type, binding, undefined) of each dynamic symbol."""
    out = []
    for line in _readelf("--dyn-syms", str(lib)).splitlines():
        m = _SYMBOL.match(line)
        if not m:
            continue
        kind, bind, ndx, full = m.groups()
        name, _, version = full.partition("@")
        version = version.lstrip("@").split(" ")[0] or None
        if name:
            out.append((name, version, kind, bind, ndx == "UND"))
    return out


def _needed(lib: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _readelf("-d", str(lib)))


def _version_needs(lib: Path) -> dict[str, set[str]]:
    """For each library named in the version-needs section, the version names required of it."""
    needs: dict[str, set[str]] = defaultdict(set)
    current = None
    text = _readelf("-V", str(lib))
    section = text.split("Version needs section", 1)[1] if "Version needs section" in text else ""
    for line in section.splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif (m := re.search(r"Name: (\S+)", line)) and current:
            needs[current].add(m.group(1))
    return needs


def _assembly(functions: set[str], objects: set[str], trace: bool) -> str:
    lines = ["\t.text"]
    for i, name in enumerate(sorted(functions)):
        lines += [f'\t.globl "{name}"', f'\t.type "{name}", %function', f'"{name}":']
        if trace:  # write(2, name, len): which stand-in a crash follows
            lines += [f"\tadr x1, .Lname{i}", f"\tmov x2, #{len(name) + 1}", "\tmov x0, #2", "\tmov x8, #64",
                      "\tsvc #0"]
        lines += [f"\tmov w0, #{NO_DEVICE}", "\tret"]
        if trace:
            lines += [f'.Lname{i}:\t.ascii "{name}\\n"', "\t.balign 4"]
    lines.append("\t.data")
    for name in sorted(objects):
        lines += [f'\t.globl "{name}"', f'\t.type "{name}", %object', f'\t.size "{name}", {OBJECT_BYTES}',
                  f'"{name}":', f"\t.zero {OBJECT_BYTES}"]
    return "\n".join(lines) + "\n"


def _version_script(by_version: dict[str | None, set[str]], versions: set[str]) -> str | None:
    if not versions:
        return None
    first = sorted(versions)[0]
    nodes = {v: set(by_version.get(v, ())) for v in versions}
    nodes[first] |= by_version.get(None, set())
    return "".join(f"{v} {{ global: {''.join(f'{n}; ' for n in sorted(s))}}};\n" for v, s in sorted(nodes.items()))


def build(torch_dir: Path, sysroot: Path, out: Path, trace: bool = False) -> list[str]:
    """Writes one stand-in per soname that torch's libraries need and neither torch nor the sysroot has."""
    search = [torch_dir / "lib", sysroot / "lib/aarch64-linux-gnu", sysroot / "usr/lib/aarch64-linux-gnu"]
    present = {p.name for d in search if d.is_dir() for p in d.iterdir()}
    users = sorted(p for p in [*(torch_dir / "lib").glob("*.so*"), *torch_dir.glob("_C*.so")] if _is_shared_object(p))
    providers = [p for d in search[1:] for p in sorted(d.glob("*.so*")) if _is_shared_object(p)]
    providers += sorted(sysroot.glob("usr/bin/python3*"))  # the interpreter exports the C API
    defined = {name for lib in {*users, *providers} for name, _, _, _, undefined in _symbols(lib) if not undefined}

    functions: dict[str, set[str]] = defaultdict(set)
    objects: dict[str, set[str]] = defaultdict(set)
    by_version: dict[str, dict[str | None, set[str]]] = defaultdict(lambda: defaultdict(set))
    versions: dict[str, set[str]] = defaultdict(set)
    for user in users:
        missing = [n for n in _needed(user) if n not in present]
        if not missing:
            continue
        needs = _version_needs(user)
        version_owner = {v: lib for lib in missing for v in needs.get(lib, ())}
        for lib in missing:
            versions[lib] |= needs.get(lib, set())
            functions.setdefault(lib, set())  # every missing soname gets a library, with or without symbols
        for name, version, kind, bind, undefined in _symbols(user):
            if not undefined or bind == "WEAK":
                continue
            if version in version_owner:
                lib = version_owner[version]
            elif version is None and name not in defined:
                lib = missing[0]  # unversioned: any library in the user's own scope resolves it
            else:
                continue
            (objects if kind in ("OBJECT", "TLS") else functions)[lib].add(name)
            by_version[lib][version].add(name)

    out.mkdir(parents=True, exist_ok=True)
    for lib in sorted(functions):
        source = out / f"{lib}.S"
        source.write_text(_assembly(functions[lib], objects[lib], trace))
        command = [CROSS_CC, "-shared", "-nostdlib", "-o", str(out / lib), str(source), f"-Wl,-soname,{lib}"]
        if script := _version_script(by_version[lib], versions[lib]):
            (out / f"{lib}.map").write_text(script)
            command.append(f"-Wl,--version-script,{out / f'{lib}.map'}")
        subprocess.run(command, check=True)
    return sorted(functions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("torch_dir", type=Path, help="the aarch64 wheel's installed torch/ folder")
    parser.add_argument("sysroot", type=Path, help="the aarch64 root holding libc, libstdc++ and python3.11")
    parser.add_argument("out", type=Path)
    parser.add_argument("--trace", action="store_true", help="each stand-in writes its name to stderr when called")
    args = parser.parse_args()
    libs = build(args.torch_dir, args.sysroot, args.out, args.trace)
    print(f"cuda_stubs: {len(libs)} stand-ins in {args.out}: {' '.join(libs)}")


if __name__ == "__main__":
    main()
