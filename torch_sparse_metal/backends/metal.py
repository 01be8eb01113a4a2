"""The Metal machinery every MPS host shares (``backends/mps.py``: the ops and the unstructured layout's host;
``backends/mps_vector_csr_linear.py``: the vector layout's): the shader files joined behind the host's constants and
our common header, the platform checks, the Metal type of each dtype, :func:`strategy_methods` (a host's kernels of
each backward strategy), and :class:`MetalHost`, one compiled library per instance with its kernel lookup, launch
sizes, poisoned outputs and index-error words.

Example (on CPU tensors, with the MSL-on-CPU executor as ``compile_shader``, as the tests run it; on a Mac,
``torch.mps.compile_shader`` and ``device_type="mps"``)::

    >>> host = MetalHost(compile_shader, ("vector_csr_linear.metal",), device_type="cpu")
    >>> host.kernel("vector_spmm_v8", torch.float32).thread_execution_width
    32
"""

from __future__ import annotations

import importlib.resources
import platform
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_sparse_metal import settings
from torch_sparse_metal.contract import DTYPES, INDEX_ARRAYS, STRATEGY_SPECS, Strategy

__all__ = [
    "COMMON_HEADER",
    "KERNEL_DTYPES",
    "METAL_TYPE_VERSIONS",
    "MPS_ERROR_WORDS",
    "SHADER_CONSTANTS",
    "SIMD_WIDTH",
    "TARGET_ROWS",
    "MetalHost",
    "check_mps_support",
    "load_source",
    "shader_defines",
    "strategy_methods",
]

#: The header of ours joined in front of every op family's shader files.
COMMON_HEADER = "csr_linear_common.h"
#: Value dtypes with Metal kernels (the op contract, csrc/contract.h), and the Metal type that names their kernels
#: (``<stage>_<type>[_p<P>]``).
KERNEL_DTYPES = {dtype: spec.metal for dtype, spec in DTYPES.items() if "mps" in spec.devices}
#: The first macOS whose Metal has a language version (``__METAL_VERSION__``) a Metal type may need.
_METAL_VERSION_MACOS = {310: "macOS 14", 320: "macOS 15", 400: "macOS 26"}
#: Metal types that need a newer Metal language than the oldest torch compiles at (the contract's dtype rows):
#: ``{type: (__METAL_VERSION__, the first macOS with it)}``. The shaders instantiate them only there
#: (:func:`shader_defines`), and the host refuses them clearly where they are missing.
METAL_TYPE_VERSIONS = {spec.metal: (spec.metal_version, _METAL_VERSION_MACOS[spec.metal_version])
                       for spec in DTYPES.values() if spec.metal and spec.metal_version}
#: The SIMD-group width the kernels are written for (every Apple GPU's threadExecutionWidth).
SIMD_WIDTH = 32
#: SIMD-groups per threadgroup the kernels aim for (capped by the pipeline's limits, see MetalHost.rows), and the
#: most their threadgroup tiles hold.
TARGET_ROWS = 8
#: The layout numbers every family's shaders are compiled with (:func:`shader_defines`; ``tsm::kSimdWidth`` and
#: ``tsm::kMaxRows`` in csr_linear_common.h).
SHADER_CONSTANTS = {"SIMD_WIDTH": SIMD_WIDTH, "MAX_ROWS": TARGET_ROWS}
_MIN_TORCH = (2, 7)
#: The one macOS floor of the Metal kernels: Metal 3.1 (bfloat; atomic<float> is Metal 3), which every supported
#: torch compiles at from macOS 14 on (torch's wheels from 2.12 on need macOS 14 anyway).
_MIN_MACOS = (14, 0)
#: Torch releases whose own MPS needs a newer macOS than ours: (first release, macOS).
_TORCH_MIN_MACOS = (((2, 15), (15, 0)),)
#: What ``torch.mps.compile_shader``'s library raises for a kernel it does not hold (a RuntimeError from
#: ``MetalShaderLibrary::getLibraryPipelineState``, aten/src/ATen/native/mps/OperationUtils.mm).
_MISSING_FUNCTION = "Failed to create function state object for"
#: The MPS devices' error words, shared by every process-wide host, so that ``take_index_errors`` (and
#: :func:`torch_sparse_metal.check_index_errors`) sees every layout's kernels.
MPS_ERROR_WORDS: dict[torch.device, torch.Tensor] = {}


def _shader_dir(first: str) -> Path:
    """``torch_sparse_metal/shaders`` when installed, else ``<repo>/shaders`` next to the package (editable)."""
    try:
        found = importlib.resources.files("torch_sparse_metal.shaders").joinpath(first)
        if found.is_file():  # shaders/ is a namespace package: its root is a MultiplexedPath, the file a real one
            return Path(str(found)).parent
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve()
    candidates = (here.parents[1] / "shaders", here.parents[2] / "shaders")  # installed package, source tree
    for d in candidates:
        if (d / first).is_file():
            return d
    raise FileNotFoundError(f"cannot find {first} in the package torch_sparse_metal.shaders nor in "
                            f"{', '.join(map(str, candidates))} (reinstall torch_sparse_metal)")


def shader_defines(constants: Mapping[str, int] | None = None) -> str:
    """The host's tables as the shaders read them: ``#define TSM_<NAME> <value>`` for :data:`SHADER_CONSTANTS` and a
    host's own ``constants``, so that a kernel's tiles and the host's grids come from one table; and
    ``TSM_FOR_EACH_METAL_TYPE(X)``, ``X(<type>)`` for each Metal type of :data:`KERNEL_DTYPES` (the contract's), a
    type of :data:`METAL_TYPE_VERSIONS` only where the Metal language has it, which the shaders instantiate their
    kernels over.

    Example:
        >>> shader_defines({"TILE_WIDTH": 32}).splitlines()[:3]
        ['#define TSM_SIMD_WIDTH 32', '#define TSM_MAX_ROWS 8', '#define TSM_TILE_WIDTH 32']
        >>> shader_defines().splitlines()[-1]
        '#define TSM_FOR_EACH_METAL_TYPE(X) X(float) X(half) TSM_IF_METAL_310(X(bfloat))'
    """
    table = {**SHADER_CONSTANTS, **(constants or {})}
    return "".join(f"#define TSM_{name} {int(value)}\n" for name, value in table.items()) + _METAL_TYPE_DEFINES


def _metal_type_defines() -> str:
    """``TSM_IF_METAL_<N>(x)`` (``x`` where ``__METAL_VERSION__ >= N``, else nothing) for each version a type needs,
    and ``TSM_FOR_EACH_METAL_TYPE``."""
    versions = sorted({version for version, _ in METAL_TYPE_VERSIONS.values()})
    guards = "".join(f"#if __METAL_VERSION__ >= {v}\n#define TSM_IF_METAL_{v}(x) x\n#else\n"
                     f"#define TSM_IF_METAL_{v}(x)\n#endif\n" for v in versions)
    types = [f"TSM_IF_METAL_{METAL_TYPE_VERSIONS[t][0]}(X({t}))" if t in METAL_TYPE_VERSIONS else f"X({t})"
             for t in KERNEL_DTYPES.values()]
    return guards + f"#define TSM_FOR_EACH_METAL_TYPE(X) {' '.join(types)}\n"


_METAL_TYPE_DEFINES = _metal_type_defines()


def load_source(shader_files: Sequence[str], constants: Mapping[str, int] | None = None,
                directory: Path | None = None) -> str:
    """The complete Metal source of an op family: the host's constants (:func:`shader_defines`), our header, then
    its shader files (``#line`` keeps error positions); read from the package's shaders, or from ``directory``
    (an earlier design's copy of them, as tsm_dev.metal_bench compares).

    Example:
        >>> "[[kernel]] void vector_spmm" in load_source(("vector_csr_linear.metal",))
        True
    """
    d = _shader_dir(shader_files[0]) if directory is None else Path(directory)
    parts = [shader_defines(constants) + f'#line 1 "{COMMON_HEADER}"\n' + (d / COMMON_HEADER).read_text()]
    parts += [f'#line 1 "{name}"\n' + (d / name).read_text() for name in shader_files]
    return "\n".join(parts)


def strategy_methods(host: type) -> dict[Strategy, Callable[..., Any]]:
    """The backward of each strategy of the contract on ``host``: its method named after the strategy (as the C++
    layouts name theirs, run_strategy in csrc/contract.h). A strategy added to csrc/contract.h that the host lacks is
    an ImportError naming it, at registration, instead of another strategy's kernels running.

    Example:
        >>> class Host:
        ...     def fused_atomic(self): ...
        >>> strategy_methods(Host)
        Traceback (most recent call last):
        ...
        ImportError: Host has no Metal kernels for strategies ['atomic_free'] (a method each, named after it)
    """
    missing = [s.value for s in STRATEGY_SPECS if not callable(getattr(host, s.value, None))]
    if missing:
        raise ImportError(f"{host.__name__} has no Metal kernels for strategies {missing} (a method each, named after "
                          "it)")
    return {s: getattr(host, s.value) for s in STRATEGY_SPECS}


def _release(text: str) -> tuple[int, int]:
    """``"2.15.0a0+git1"`` -> ``(2, 15)``, ``"26.1"`` -> ``(26, 1)``."""
    parts = (text.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def check_mps_support(torch_version: str | None = None, mac_version: str | None = None) -> None:
    """Raise a clear error if this torch or macOS cannot run the Metal kernels (only called when MPS is used).
    ``torch_version`` and ``mac_version`` default to this process's (``torch.__version__``,
    ``platform.mac_ver()``)."""
    torch_version = torch.__version__ if torch_version is None else torch_version
    mac = platform.mac_ver()[0] if mac_version is None else mac_version
    release = _release(torch_version)
    if release < _MIN_TORCH or not hasattr(torch.mps, "compile_shader"):
        raise RuntimeError(f"torch_sparse_metal's Metal kernels need torch >= {'.'.join(map(str, _MIN_TORCH))} "
                           f"(torch.mps.compile_shader); this is torch {torch_version}")
    if mac and _release(mac) < _MIN_MACOS:
        raise RuntimeError(f"torch_sparse_metal's Metal kernels need macOS >= {'.'.join(map(str, _MIN_MACOS))} "
                           f"(Metal 3.1); this is macOS {mac}")
    newer = [(first, macos) for first, macos in _TORCH_MIN_MACOS if release >= first]
    if mac and newer and _release(mac) < newer[-1][1]:
        first, macos = newer[-1]
        raise RuntimeError(f"torch {torch_version} runs MPS on macOS >= {'.'.join(map(str, macos))} only; this is "
                           f"macOS {mac}: update macOS, or install torch < {'.'.join(map(str, first))}")
    if not torch.backends.mps.is_available():
        raise RuntimeError("MPS is not available on this machine (torch.backends.mps.is_available() is False)")


class MetalHost:
    """What an op family's Metal host is built on: one compiled library per instance (lazily, once).

    ``compile_fn`` maps Metal source to a library object with one attribute per kernel, as
    ``torch.mps.compile_shader`` does; ``shader_files`` are the family's files in ``shaders/``. ``device_type`` is
    the device the tensors must be on (``"mps"``, or ``"cpu"`` under the executor). ``poison=True`` fills every
    output the kernels fully overwrite with NaN instead of leaving it uninitialised, so an element a kernel misses
    shows up in tests; by default it follows ``TORCH_SPARSE_METAL_POISON=1``, the switch the CPU kernels and
    tests/conftest.py use. ``error_words``: the per-device index-error words the kernels set (a fresh set by
    default; the process-wide MPS hosts share :data:`MPS_ERROR_WORDS`).
    """

    def __init__(self, compile_fn: Callable[[str], Any], shader_files: Sequence[str], device_type: str = "mps", *,
                 poison: bool | None = None, check_platform: Callable[[], None] | None = None,
                 error_words: dict[torch.device, torch.Tensor] | None = None):
        self.shader_files = tuple(shader_files)
        self._compile_fn = compile_fn
        self.device_type = device_type
        self.poison = settings.flag("TORCH_SPARSE_METAL_POISON", False) if poison is None else poison
        self._check_platform = check_platform
        self._library: Any = None
        self._lock = threading.Lock()
        self._error_words = {} if error_words is None else error_words

    # -------------------------------------------------------------------------------------------- library
    def source(self) -> str:
        """The Metal source this host compiles."""
        return load_source(self.shader_files)

    @property
    def library(self) -> Any:
        """The compiled library (compiled on first use, once)."""
        if self._library is None:
            with self._lock:
                if self._library is None:
                    if self._check_platform is not None:
                        self._check_platform()
                    self._library = self._compile_fn(self.source())
        return self._library

    def kernel(self, stage: str, dtype: torch.dtype, p: int | None = None) -> Any:
        """The kernel ``<stage>_<Metal type>[_p<P>]``, e.g. ``kernel("spmm", torch.float32, 4)``."""
        name = f"{stage}_{KERNEL_DTYPES[dtype]}" + ("" if p is None else f"_p{p}")
        try:
            return getattr(self.library, name)
        except RuntimeError as e:  # torch's answer for a kernel the library lacks
            if _MISSING_FUNCTION not in str(e):
                raise
            version, mac = METAL_TYPE_VERSIONS.get(KERNEL_DTYPES[dtype], (None, None))
            if version is None:
                raise RuntimeError(f"the compiled Metal library has no kernel {name}: the shaders and the host code "
                                   "disagree (reinstall torch_sparse_metal)") from e
            raise RuntimeError(f"this Mac's Metal compiler built no {dtype} kernels (they need Metal "
                               f"{version // 100}.{version % 100 // 10}, {mac} or newer); use float32 or "
                               "float16") from e

    # ------------------------------------------------------------------------------------------ launches
    @staticmethod
    def _rows(fn: Any, p: int | None = None) -> int:
        """SIMD-groups per threadgroup: TARGET_ROWS, within the pipeline's thread limit and, for the tiled
        kernels, the rows their threadgroup tile holds (its static length: (32 * P + 1) floats a row)."""
        width = int(fn.thread_execution_width)
        if width != SIMD_WIDTH:
            raise RuntimeError(f"the Metal kernels are written for {SIMD_WIDTH}-wide SIMD-groups; this GPU's "
                               f"threadExecutionWidth is {width}")
        rows = min(TARGET_ROWS, int(fn.max_threads_per_threadgroup) // width)
        tile_bytes = int(getattr(fn, "static_thread_group_memory_length", 0) or 0)
        if p is not None and tile_bytes:  # a pipeline that reports no length: the shaders' tile holds TARGET_ROWS
            rows = min(rows, tile_bytes // ((SIMD_WIDTH * p + 1) * 4))
        if rows < 1:
            raise RuntimeError(f"kernel {fn} allows too few threads per threadgroup "
                               f"({fn.max_threads_per_threadgroup}) for one SIMD-group")
        return rows

    def _empty(self, shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An output on ``like``'s device, of ``like``'s dtype unless ``dtype`` is given: uninitialised, or NaN
        when poisoning."""
        dtype = like.dtype if dtype is None else dtype
        if self.poison:
            return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
        return torch.empty(shape, dtype=dtype, device=like.device)

    # -------------------------------------------------------------------------------------- index errors
    def _errors(self, device: torch.device, first: str) -> torch.Tensor:
        """The error words from index array ``first`` on (a kernel's pointer array, then its index array)."""
        words = self._error_words.get(device)
        if words is None:
            words = self._error_words[device] = torch.zeros(len(INDEX_ARRAYS), dtype=torch.int32, device=device)
        return words[INDEX_ARRAYS.index(first):]

    def take_index_errors(self, device: torch.device) -> list[int]:
        """Reads and clears ``device``'s error words (one per index array of ``INDEX_ARRAYS``; nonzero where a
        kernel met an out-of-range index). Waits for the device."""
        words = self._error_words.get(torch.device(device))
        if words is None:
            return [0] * len(INDEX_ARRAYS)
        seen = words.tolist()
        words.zero_()
        return seen

    # --------------------------------------------------------------------------------------------- checks
    def _check_device(self, x: torch.Tensor) -> None:
        """What only this backend requires; the op's own checks are the Python boundary's (ops/_csr_linear.py)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if x.device.type != self.device_type:
            raise RuntimeError(f"the Metal kernels run on {self.device_type} tensors, got x on {x.device}")
        if x.dtype not in KERNEL_DTYPES:
            names = ", ".join(str(d) for d in KERNEL_DTYPES)
            raise TypeError(f"x has dtype {x.dtype}; the Metal kernels support {names}")
