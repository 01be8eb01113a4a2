"""MSL-on-CPU executor with the calling convention of ``torch.mps.compile_shader``.

``compile_shader(source)`` compiles unchanged Metal source as C++14 (``metal_compat.h`` + ``runtime.cpp``)
into a shared library, cached by a hash of everything that goes into it, and returns a library whose
attributes are the kernels. It follows torch's ``torch/csrc/mps/Module.cpp`` and ``MetalKernelFunction`` in
``aten/src/ATen/native/mps/OperationUtils.mm`` (the tests cite each point):

- ``__METAL_VERSION__`` is ``metal_version`` (default: the oldest the supported torch releases compile at on a
  supported macOS, :data:`source.METAL_LANGUAGE_VERSIONS`); fast math is off, as in torch;
- a source Metal would reject raises :class:`MslCompileError`, a ``SyntaxError`` as torch's compile failures are;
  a kernel the library lacks raises ``RuntimeError("Failed to create function state object for: <name>")``;
- positional argument ``i`` binds ``[[buffer(i)]]``; a tensor binds its data pointer (storage plus byte
  offset) with no dtype, device or contiguity check, exactly like Metal (a float16 tensor binds a
  ``device half*``, a bfloat16 one a ``device bfloat*``); a Python ``int`` (a ``bool`` too) binds 8 bytes (int64)
  and a ``float`` a 4-byte float32, a non-empty list of ints an int64 array and one of floats a float32 array,
  unless ``arg_casts`` (one name for every scalar, or ``{i: name}``) names one of torch's casts: ``"fp16"``,
  ``"bf16"``, ``"int32"``, ``"int16"``, ``"int8"``, ``"uint8"`` (:func:`bindings.scalar_bytes`);
- ``threads=`` is an int or a sequence of 1 to 3 ints (default: the first tensor's numel); ``group_size=`` has the
  same length (an int is a sequence of one); without it a 1-D grid gets ``min(threads,
  max_threads_per_threadgroup)`` threads per group and a 2-D or 3-D grid ``(max_threads_per_threadgroup, 1, 1)``;
  a group over the pipeline's ``max_threads_per_threadgroup`` raises ``ValueError`` from torch 2.13 on (the
  installed torch decides; a RuntimeError before);
- every pipeline reports ``max_threads_per_threadgroup`` (``compile_shader``'s argument, 1024 by default, as
  Apple GPUs allow; a real pipeline may report less, so host code reads it), ``thread_execution_width`` (32)
  and ``static_thread_group_memory_length``;
- dispatch follows Metal's ``dispatchThreads``: the grid need not be a multiple of the group; the last group
  along an axis is partial, and its lanes see ``[[threads_per_threadgroup]]`` = the partial size (Apple:
  "Metal ... can generate smaller threadgroups along the edges of your grid"), while
  ``[[dispatch_threads_per_threadgroup]]`` is the requested size;
- stricter than torch: a zero-size grid or group raises (Metal's validation layer rejects them), and so does a
  value an ``arg_casts`` integer type cannot hold (torch wraps it).

What a GPU punishes raises :class:`MslError` naming the kernel, thread and argument (``checker.cpp``): each
argument is bound as a private copy of exactly its bytes (a tensor: its elements from its data pointer, an empty
one a valid zero-length buffer), so a load or store out of bounds is an error, not a write into a neighbour;
two threads of a threadgroup conflicting on one element within a barrier interval, or two threadgroups within
the dispatch, is a data race (atomics excepted); a barrier reached at different calls is divergent; a dispatch
running past ``watchdog`` seconds (default ``$TORCH_SPARSE_METAL_MSL_WATCHDOG_S`` or 60) is a hang.

Every kernel that ran at least one thread is recorded in :data:`EXECUTED` (process-wide). ``traffic=True`` (or a
``traffic.record()`` block) adds the memory-traffic model to a dispatch (:mod:`.traffic`).

Example:
    >>> import torch
    >>> lib = compile_shader('''
    ... kernel void fill(device float* out [[buffer(0)]], constant float& v [[buffer(1)]],
    ...                  uint i [[thread_position_in_grid]]) { out[i] = v; }''')
    >>> out = torch.zeros(5)
    >>> lib.fill(out, 2.5)
    >>> out.tolist()
    [2.5, 2.5, 2.5, 2.5, 2.5]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from .bindings import arg_cast, kernel_call, scalar_bytes
from .source import (
    DEFAULT_METAL_VERSION,
    HERE,
    Kernel,
    MslCompileError,
    MslError,
    parse_kernels,
    preprocess,
    rewrite,
    split_declaration,
    template_params,
)
from .traffic import DispatchTraffic, TrafficStruct, recorder

__all__ = [
    "EXECUTED",
    "MAX_THREADGROUP_MEMORY",
    "MAX_THREADS_PER_THREADGROUP",
    "OVERSIZED_GROUP_ERROR",
    "THREAD_EXECUTION_WIDTH",
    "KernelFunction",
    "KernelLibrary",
    "ShaderLibrary",
    "cache_dir",
    "compile_shader",
    "dispatch_shape",
]

#: What Apple GPUs allow per threadgroup; the executor's pipelines report it unless compile_shader is told less.
MAX_THREADS_PER_THREADGROUP = 1024
THREAD_EXECUTION_WIDTH = 32
MAX_THREADGROUP_MEMORY = 32 * 1024
#: What an oversized threadgroup raises: torch 2.13 checks it with TORCH_CHECK_VALUE, older releases with
#: TORCH_CHECK (``MetalKernelFunction::dispatch``).
OVERSIZED_GROUP_ERROR: type[Exception] = (
    ValueError if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13) else MslError)

#: Host names of every kernel that executed at least one thread in this process.
EXECUTED: set[str] = set()

# No fast math: torch.mps.compile_shader compiles without it, and the executor must round (and keep NaNs,
# infinities and subnormals) as Metal does. No contraction of a * b + c into one fma: plain IEEE float math, the
# same whatever the host CPU offers. Metal has no errno, so math built-ins need not set it.
# The checks (checker.cpp implements the hooks; libtsan is not linked): -fsanitize=thread calls __tsan_* on every
# memory access, -fsanitize-coverage=trace-pc calls a hook per basic block (the watchdog's clock). Frame pointers
# let the runtime tell barrier calls apart by call stack; no cross-jumping keeps the barriers of two arms of an
# if/else two calls.
_CXX_KERNEL_FLAGS = ["-std=c++14", "-O1", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-fno-exceptions",
                     "-fno-rtti", "-nostdinc", "-ffreestanding", "-Wno-attributes", "-Wno-ignored-attributes",
                     "-fsanitize=thread", "-fsanitize-coverage=trace-pc", "--param=tsan-instrument-func-entry-exit=0",
                     "-fno-omit-frame-pointer", "-fno-crossjumping"]
_CXX_RUNTIME_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-fno-omit-frame-pointer"]
_RUNTIME_SOURCES = ("runtime.cpp", "checker.cpp", "traffic.cpp")
_RUNTIME_HEADERS = ("tsm_abi.h", "checker.h", "traffic.h")
#: Seconds a dispatch may run before the watchdog calls it a hang.
DEFAULT_WATCHDOG_S = 60.0
_BUILD_LOCK = threading.Lock()
_LIB_CACHE: dict[tuple[str, int], ShaderLibrary] = {}
_PREPROCESSED: dict[tuple[str, str, int], str] = {}


def cache_dir() -> Path:
    """Where compiled libraries live: ``$TORCH_SPARSE_METAL_MSL_CACHE`` or a per-user temp folder."""
    root = os.environ.get("TORCH_SPARSE_METAL_MSL_CACHE")
    path = Path(root) if root else Path(tempfile.gettempdir()) / f"torch_sparse_metal_msl_{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def _compiler() -> tuple[str, str]:
    """The C++ compiler and its version line (part of every cache key)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise MslError("the MSL executor needs g++ on PATH (apt-get install g++)")
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True).stdout
    return cxx, version.splitlines()[0] if version else cxx


def _run(cmd: list[str], what: str, error: type[MslError] = MslError) -> None:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise error(f"{what} failed:\n$ {' '.join(cmd)}\n{proc.stderr.strip()}")


def _atomic_write_build(out: Path, build) -> None:
    """Build into a temporary name, then rename: concurrent test processes never see half a file."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    build(tmp)
    os.replace(tmp, out)


def _runtime_objects(cxx: str, version: str) -> list[Path]:
    headers = "".join((HERE / h).read_text() for h in _RUNTIME_HEADERS)
    objects = []
    for name in _RUNTIME_SOURCES:
        src = (HERE / name).read_text() + headers
        key = hashlib.sha256("\0".join([src, version, *_CXX_RUNTIME_FLAGS]).encode()).hexdigest()[:20]
        out = cache_dir() / f"{Path(name).stem}_{key}.o"
        if not out.exists():
            _atomic_write_build(out, lambda tmp, name=name: _run(
                [cxx, *_CXX_RUNTIME_FLAGS, "-I", str(HERE), "-c", str(HERE / name), "-o", str(tmp)],
                f"compiling the executor runtime ({name})"))
        objects.append(out)
    return objects


def _entry_source(kernels: list[Kernel], tparams: dict[str, str]) -> str:
    lines = ["", "// ---- generated by tsm_dev.msl: one entry point per [[host_name]]"]
    for i, k in enumerate(kernels):
        call = kernel_call(k, lambda p: f"tsm_bind::arg<{p.type}>::get(b[{p.index}])", "ids.")
        # Unchecked: it reads the runtime's tables. The built-ins are copied to the lane's stack, where the
        # kernel's reads of them are its own.
        lines.append(f'extern "C" __attribute__((no_sanitize_thread)) void tsm_entry_{i}(void* const* b, '
                     "const tsm_ids* t) { (void)b; const tsm_ids ids = *t; (void)ids;")
        lines.append(f"  {call}")
        lines.append("}")
        sizes = " + ".join(f"sizeof({_decl_as_type(d)})" for d in k.threadgroup_decls) or "0"
        if k.template_args is not None and k.threadgroup_decls:
            lines.append(f"template <{tparams[k.function]}> unsigned long tsm_tgmem_fn_{i}() {{ return {sizes}; }}")
            sizes = f"tsm_tgmem_fn_{i}<{k.template_args}>()"
        lines.append(f'extern "C" unsigned long tsm_tgmem_{i}(void) {{ return {sizes}; }}')
    return "\n".join(lines) + "\n"


def _decl_as_type(decl: str) -> str:
    """``"float t[256]"`` -> ``"float[256]"`` (a type whose sizeof is the declaration's storage)."""
    ctype, _, dims = split_declaration(decl)
    return f"{ctype}{dims}"


def _threadgroup_reference(number: int, decl: str) -> str:
    """``threadgroup float t[256];`` as a reference to the runtime's checked storage for the running group."""
    ctype, name, dims = split_declaration(decl)
    return (f"{ctype} (&{name}){dims} = *reinterpret_cast<{ctype} (*){dims}>(tsm_threadgroup_storage({number}u, "
            f'sizeof({ctype}{dims}), tsm_bind::element<{ctype}{dims}>::size, "{name}"));')


class KernelFunction:
    """One kernel of a :class:`ShaderLibrary`; call it like a ``torch.mps.compile_shader`` kernel."""

    thread_execution_width = THREAD_EXECUTION_WIDTH

    def __init__(self, library: ShaderLibrary, kernel: Kernel, index: int, max_threads_per_threadgroup: int):
        self.name = kernel.host_name
        self.max_threads_per_threadgroup = max_threads_per_threadgroup
        self._kernel = kernel
        self._entry = getattr(library._dll, f"tsm_entry_{index}")
        self._dispatch = library._dispatch
        tg = getattr(library._dll, f"tsm_tgmem_{index}")
        tg.restype = ctypes.c_ulong
        self.static_thread_group_memory_length = int(tg())
        if self.static_thread_group_memory_length > MAX_THREADGROUP_MEMORY:
            raise MslError(f"kernel {self.name} uses {self.static_thread_group_memory_length} bytes of threadgroup "
                           f"memory; Metal allows {MAX_THREADGROUP_MEMORY}")
        self._nbuffers = max((p.index + 1 for p in kernel.params if p.kind == "buffer"), default=0)
        self._names = {p.index: p.name for p in kernel.params if p.kind == "buffer"}
        # const or constant pointee: reads never race with reads, so these skip race tracking
        self._read_only = {p.index for p in kernel.params
                           if p.kind == "buffer" and re.search(r"\bconst(ant)?\b", re.split(r"[*&]", p.type)[0])}

    def __repr__(self) -> str:
        return f"<msl executor kernel {self.name}>"

    def __call__(self, *args: Any, threads: int | tuple[int, ...] | list[int] | None = None,
                 group_size: int | tuple[int, ...] | list[int] | None = None,
                 arg_casts: str | dict[int, str] | None = None, seed: int | None = None,
                 watchdog: float | None = None, traffic: bool = False) -> DispatchTraffic | None:
        """Run the grid (synchronously; there is no stream on the CPU). ``seed`` fixes the order of threadgroups
        and lanes; ``watchdog`` is the time budget in seconds. With ``traffic=True``, or inside a
        ``traffic.record()`` block, the dispatch also runs the traffic model, and its report is returned (and
        collected by the block)."""
        if len(args) < self._nbuffers:
            raise MslError(f"kernel {self.name} binds {self._nbuffers} buffers but got {len(args)} arguments")
        keep: list[Any] = []
        specs = (_ArgSpec * max(len(args), 1))()
        first_numel = None
        for i, a in enumerate(args):
            specs[i] = self._bind(i, a, arg_cast(arg_casts, i), keep)
            if first_numel is None and isinstance(a, torch.Tensor):
                first_numel = a.numel()
        grid, group = dispatch_shape(self.name, threads, group_size, first_numel, self.max_threads_per_threadgroup)
        grid_c = (ctypes.c_uint * 3)(*grid)
        group_c = (ctypes.c_uint * 3)(*group)
        err = ctypes.create_string_buffer(4096)
        workers = int(os.environ.get("TORCH_SPARSE_METAL_MSL_WORKERS", min(os.cpu_count() or 1, 4)))
        lane_seed = random.getrandbits(63) if seed is None else seed
        if watchdog is None:
            watchdog = float(os.environ.get("TORCH_SPARSE_METAL_MSL_WATCHDOG_S", DEFAULT_WATCHDOG_S))
        collect = recorder()
        model = TrafficStruct() if traffic or collect is not None else None
        rc = self._dispatch(self._entry, specs, len(args), grid_c, group_c, lane_seed, workers, watchdog,
                            None if model is None else ctypes.byref(model), err, len(err))
        EXECUTED.add(self.name)
        if rc != 0:
            raise MslError(f"kernel {self.name}: {err.value.decode(errors='replace')}")
        if model is None:
            return None
        scalars = {i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        report = DispatchTraffic.from_struct(model, self.name, grid, group, self.static_thread_group_memory_length,
                                             self._names, scalars, len(args))
        if collect is not None:
            collect.append(report)
        return report

    def _bind(self, i: int, a: Any, cast: str | None, keep: list[Any]) -> _ArgSpec:
        name = self._names.get(i, "?")
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                raise MslError(f"argument {i}: the MSL executor runs on CPU tensors, got one on {a.device}")
            label = f"argument {i} '{name}' ({str(a.dtype).removeprefix('torch.')})".encode()
            keep.append(label)
            flags = _COPY_BACK | (0 if i in self._read_only else _WRITABLE)
            return _ArgSpec(a.data_ptr() if a.numel() else None, _extent_bytes(a), a.element_size(), flags, label,
                            a.storage_offset() * a.element_size())
        data = scalar_bytes(i, a, cast)
        buf = ctypes.create_string_buffer(data, len(data))
        label = f"argument {i} '{name}'".encode()
        keep += [buf, label]
        count = len(a) if isinstance(a, (list, tuple)) else 1
        flags = _SCALAR | (0 if i in self._read_only else _WRITABLE)
        return _ArgSpec(ctypes.addressof(buf), len(data), len(data) // max(count, 1), flags, label, 0)


class _ArgSpec(ctypes.Structure):
    """``tsm_check::ArgSpec`` (checker.h)."""

    _fields_ = [("data", ctypes.c_void_p), ("bytes", ctypes.c_uint64), ("elem", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("label", ctypes.c_char_p), ("view_offset", ctypes.c_uint64)]


_COPY_BACK, _WRITABLE, _SCALAR = 1, 2, 4  # tsm_check::kCopyBack, kWritable, kScalar


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel may touch from ``t``'s data pointer: its elements, as Metal binds a contiguous tensor, never
    past the end of its storage (an expanded or strided view binds only what its storage holds from there)."""
    if t.numel() == 0:
        return 0
    own = t.numel() * t.element_size()
    left = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    return own if t.is_contiguous() else min(own, left)


def dispatch_shape(name: str, threads: Any, group_size: Any, first_numel: int | None,
                   max_threads: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(grid, group)`` of a dispatch as 3-tuples, as torch forms them (torch/csrc/mps/Module.cpp,
    ``MetalKernelFunction::dispatch``) and Metal validates them; shared by every target."""
    grid = _dims(threads if threads is not None else first_numel, "threads")
    if group_size is None:
        group = (min(grid[0], max_threads),) if len(grid) == 1 else (max_threads,) + (1,) * (len(grid) - 1)
    else:
        group = _dims(group_size, "group_size")
        if len(group) != len(grid):
            raise MslError(f"kernel {name}: size and group_size must have same number of dimensions "
                           f"(threads {threads!r}, group_size {group_size!r})")
    grid3, group3 = (grid + (1, 1))[:3], (group + (1, 1))[:3]
    if 0 in grid3:
        raise MslError(f"kernel {name}: cannot dispatch an empty grid {grid3} (skip the dispatch instead)")
    if 0 in group3:
        raise MslError(f"kernel {name}: group size {group3} must be non-empty")
    if group3[0] * group3[1] * group3[2] > max_threads:
        raise OVERSIZED_GROUP_ERROR(f"kernel {name}: Threadgroup size exceeds {max_threads} limit (group {group3})")
    return grid3, group3  # type: ignore[return-value]


def _dims(v: Any, what: str) -> tuple[int, ...]:
    if v is None:
        raise MslError(f"Number of threads is undefined: {what} not given and no tensor argument to take it from")
    t = (v,) if isinstance(v, int) else tuple(v)
    if not 1 <= len(t) <= 3 or not all(isinstance(x, int) and x >= 0 for x in t):
        raise MslError(f"{what} must be a non-negative int or a sequence of 1 to 3 of them, got {v!r}")
    if any(x >= 2**32 for x in t):
        raise MslError(f"{what} {v!r} exceeds 32 bits per dimension")
    return t


class KernelLibrary:
    """Kernels by name, as a ``torch.mps.compile_shader`` library: ``dir(lib)`` lists them, ``lib.<name>`` is one.
    Subclasses fill ``_functions``."""

    _functions: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        functions = self.__dict__.get("_functions", {})
        if name in functions:
            return functions[name]
        if name.startswith("__"):  # Python's own protocol lookups (copy, pickle, inspect) expect AttributeError
            raise AttributeError(name)
        # torch raises this RuntimeError (MetalShaderLibrary::getLibraryPipelineState, OperationUtils.mm), so
        # getattr(lib, name, None) and hasattr() propagate it rather than answer None or False
        raise RuntimeError(f"Failed to create function state object for: {name}")

    def __dir__(self) -> list[str]:
        return sorted(self._functions)

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self._functions)


class ShaderLibrary(KernelLibrary):
    """Kernels compiled from one source for the CPU executor."""

    def __init__(self, dll: ctypes.CDLL, kernels: list[Kernel], max_threads_per_threadgroup: int):
        self._dll = dll
        self._dispatch = dll.tsm_dispatch
        self._dispatch.restype = ctypes.c_int
        self._dispatch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_ulonglong, ctypes.c_int, ctypes.c_double, ctypes.c_void_p, ctypes.c_char_p,
                                   ctypes.c_int]
        self._functions = {k.host_name: KernelFunction(self, k, i, max_threads_per_threadgroup)
                           for i, k in enumerate(kernels)}


def compile_shader(source: str, filename: str = "shader.metal", *, metal_version: int = DEFAULT_METAL_VERSION,
                   max_threads_per_threadgroup: int = MAX_THREADS_PER_THREADGROUP) -> ShaderLibrary:
    """Compile Metal source for the CPU at ``__METAL_VERSION__`` = ``metal_version``; the same preprocessed source
    is compiled once per process and cached on disk. Every pipeline reports ``max_threads_per_threadgroup`` and
    refuses larger groups (a GPU's pipelines may allow fewer than 1024 threads)."""
    if not 1 <= max_threads_per_threadgroup <= MAX_THREADS_PER_THREADGROUP:
        raise MslError(f"max_threads_per_threadgroup must be 1 to {MAX_THREADS_PER_THREADGROUP}, got "
                       f"{max_threads_per_threadgroup}")
    cxx, version = _compiler()
    seen = (source, filename, metal_version)
    text = _PREPROCESSED.get(seen)
    if text is None:
        text = _PREPROCESSED[seen] = preprocess(source, filename, metal_version)
    # keyed by the preprocessed text: versions that preprocess alike share one build
    inputs = ("metal_compat.h", "msl_common.h", *_RUNTIME_HEADERS, *_RUNTIME_SOURCES, "source.py", "bindings.py",
              "traffic.py")
    pieces = [text, *((HERE / f).read_text() for f in inputs), Path(__file__).read_text(), version,
              *_CXX_KERNEL_FLAGS]
    key = hashlib.sha256("\0".join(pieces).encode()).hexdigest()[:24]
    with _BUILD_LOCK:
        if (key, max_threads_per_threadgroup) in _LIB_CACHE:
            return _LIB_CACHE[key, max_threads_per_threadgroup]
        kernels = parse_kernels(text)
        so = cache_dir() / f"kernels_{key}.so"
        if not so.exists():
            runtime = _runtime_objects(cxx, version)
            code = ('#include "metal_compat.h"\n' + rewrite(text, _threadgroup_reference, keep_instantiations=False)
                    + _entry_source(kernels, template_params(text)))

            def build(tmp: Path) -> None:
                cpp = tmp.with_suffix(".cpp")
                obj = tmp.with_suffix(".o")
                cpp.write_text(code)
                try:
                    _run([cxx, *_CXX_KERNEL_FLAGS, "-I", str(HERE), "-c", str(cpp), "-o", str(obj)],
                         f"compiling {filename} for the CPU executor (generated source kept at {cpp})",
                         MslCompileError)
                    _run([cxx, "-shared", str(obj), *map(str, runtime), "-o", str(tmp), "-lpthread", "-Wl,-z,defs",
                          "-Wl,-Bsymbolic"],
                         f"linking {filename} for the CPU executor")
                    cpp.unlink()
                finally:
                    obj.unlink(missing_ok=True)

            _atomic_write_build(so, build)
        lib = ShaderLibrary(ctypes.CDLL(str(so)), kernels, max_threads_per_threadgroup)
        _LIB_CACHE[key, max_threads_per_threadgroup] = lib
        return lib
