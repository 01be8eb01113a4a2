"""MPS host code: compiles ``shaders/*.metal`` with ``torch.mps.compile_shader`` and registers the ``"mps"``
kernels of ``torch_sparse_metal::csr_linear`` and ``torch_sparse_metal::csr_linear_backward``.

All dispatch logic lives in :class:`MetalCsrLinear`, parameterised by the compile function, so the very same
code (argument order, scalar widths, grid and threadgroup sizes) runs in CI with CPU tensors under the
MSL-on-CPU executor (:func:`tsm_dev.msl.compile_shader`). Nothing here waits on the
device: checks look at metadata only and kernels are encoded on the current MPS stream.

Example (CPU, through the executor)::

    >>> from tsm_dev.msl import compile_shader
    >>> metal = MetalCsrLinear(compile_shader, device_type="cpu")
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> # one edge: input 1 -> output 0, weight 2
    >>> y = metal.forward(torch.tensor([[1.0, 3.0]]), torch.tensor([2.0]), i32(0, 0, 1), i32(0), i32(1),
    ...                   i32(0, 1), i32(1), i32(0))
    >>> y.tolist()
    [[6.0]]
"""

from __future__ import annotations

import importlib.resources
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torch_sparse_metal import settings, tuning
from torch_sparse_metal._checks import check_backward, check_forward
from torch_sparse_metal.backends import Backend
from torch_sparse_metal.backends import register as register_backend
from torch_sparse_metal.contract import DTYPES, INDEX_ARRAYS, STRATEGIES, Strategy

__all__ = [
    "BACKEND",
    "COMMON_HEADER",
    "KERNEL_DTYPES",
    "SHADER_FILES",
    "VALUES_PER_LANE",
    "VARIANTS",
    "MetalCsrLinear",
    "check_mps_support",
    "default",
    "kernel_names",
    "load_source",
    "register",
    "values_per_lane",
]

#: Shader files compiled into the library, and the header of ours joined in front of each.
SHADER_FILES = ("csr_linear.metal",)
COMMON_HEADER = "csr_linear_common.h"
#: Value dtypes with Metal kernels (the op contract, csrc/contract.h), and the Metal type that names their kernels
#: (``<stage>_<type>[_p<P>]``).
KERNEL_DTYPES = {dtype: spec.metal for dtype, spec in DTYPES.items() if "mps" in spec.devices}
#: Metal types that need a newer Metal language than the oldest torch compiles at (``__METAL_VERSION__``); the
#: shaders instantiate them under the same condition, and the host refuses them clearly where they are missing.
METAL_TYPE_VERSIONS = {"bfloat": (310, "macOS 14")}
#: Batch values per lane that the tiled kernels are instantiated for (``_p<P>``); a SIMD-group covers 32 * P
#: consecutive batch columns. The tuner times each (:data:`VARIANTS`); the static rule is :func:`values_per_lane`.
VALUES_PER_LANE = (1, 4)
#: The kernel variants ``auto`` chooses among on MPS (registered with :mod:`torch_sparse_metal.tuning`).
VARIANTS = {"values_per_lane": VALUES_PER_LANE}
#: Kernel stages, named as the CPU and CUDA kernels' (docs/architecture.md, "Where the contract lives"): the layout
#: conversion and the gather are instantiated per dtype, the tiled ones also per P.
PLAIN_STAGES = ("feature_major", "gather")
TILED_STAGES = ("spmm", "spmm_sddmm_atomic", "sddmm")
#: The SIMD-group width the tiled kernels are written for (every Apple GPU's threadExecutionWidth).
SIMD_WIDTH = 32
#: SIMD-groups per threadgroup the kernels aim for (capped by the pipeline's limits, see _rows).
TARGET_ROWS = 8
_MIN_TORCH = (2, 7)
#: The one macOS floor of the Metal kernels: Metal 3.1 (bfloat; atomic_float is Metal 3), which every supported
#: torch compiles at from macOS 14 on (torch's wheels from 2.12 on need macOS 14 anyway).
_MIN_MACOS = (14, 0)
#: Torch releases whose own MPS needs a newer macOS than ours: (first release, macOS).
_TORCH_MIN_MACOS = (((2, 15), (15, 0)),)
#: What ``torch.mps.compile_shader``'s library raises for a kernel it does not hold (a RuntimeError from
#: ``MetalShaderLibrary::getLibraryPipelineState``, aten/src/ATen/native/mps/OperationUtils.mm).
_MISSING_FUNCTION = "Failed to create function state object for"


def kernel_names() -> list[str]:
    """Every kernel the host code dispatches, as the shaders must instantiate them.

    Example:
        >>> kernel_names()[:3]
        ['feature_major_float', 'gather_float', 'spmm_float_p1']
    """
    names = []
    for suffix in KERNEL_DTYPES.values():
        names += [f"{stage}_{suffix}" for stage in PLAIN_STAGES]
        names += [f"{stage}_{suffix}_p{p}" for p in VALUES_PER_LANE for stage in TILED_STAGES]
    return names


def values_per_lane(batch: int) -> int:
    """The static rule for P (without tuning): 1 up to one SIMD-group's width of batch columns (less padding),
    else 4 (one 16-byte load per lane)."""
    return VALUES_PER_LANE[0] if batch <= SIMD_WIDTH * VALUES_PER_LANE[0] else VALUES_PER_LANE[-1]


def _shader_dir() -> Path:
    """``torch_sparse_metal/shaders`` when installed, else ``<repo>/shaders`` next to the package (editable)."""
    try:
        root = importlib.resources.files("torch_sparse_metal.shaders")
        if root.joinpath(SHADER_FILES[0]).is_file():
            return Path(str(root))
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve()
    candidates = (here.parents[1] / "shaders", here.parents[2] / "shaders")  # installed package, source tree
    for d in candidates:
        if (d / SHADER_FILES[0]).is_file():
            return d
    raise FileNotFoundError(f"cannot find {SHADER_FILES[0]} in the package torch_sparse_metal.shaders nor in "
                            f"{', '.join(map(str, candidates))} (reinstall torch_sparse_metal)")


def load_source() -> str:
    """The complete Metal source: our header, then every shader file (``#line`` keeps error positions).

    Example:
        >>> "kernel void spmm" in load_source()
        True
    """
    d = _shader_dir()
    parts = [f'#line 1 "{COMMON_HEADER}"\n' + (d / COMMON_HEADER).read_text()]
    parts += [f'#line 1 "{name}"\n' + (d / name).read_text() for name in SHADER_FILES]
    return "\n".join(parts)


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


class MetalCsrLinear:
    """Dispatches the Metal kernels of the sparse linear op; one compiled library per instance (lazily).

    ``compile_fn`` maps Metal source to a library object with one attribute per kernel, as
    ``torch.mps.compile_shader`` does. ``device_type`` is the device the tensors must be on (``"mps"``, or
    ``"cpu"`` under the executor). ``poison=True`` fills every output the kernels fully overwrite with NaN
    instead of leaving it uninitialised, so an element a kernel misses shows up in tests; by default it follows
    ``TORCH_SPARSE_METAL_POISON=1``, the switch the CPU kernels and tests/conftest.py use. ``values_per_lane``
    fixes P of the tiled kernels (one of VALUES_PER_LANE), e.g. to compare variants; by default each call takes
    the tuner's P for its size bucket (:func:`torch_sparse_metal.tuning.variant`), else the static rule
    :func:`values_per_lane`.
    """

    def __init__(self, compile_fn: Callable[[str], Any], device_type: str = "mps", *, poison: bool | None = None,
                 check_platform: Callable[[], None] | None = None, values_per_lane: int | None = None):
        if values_per_lane is not None and values_per_lane not in VALUES_PER_LANE:
            raise ValueError(f"values_per_lane must be one of {VALUES_PER_LANE}, got {values_per_lane}")
        self.values_per_lane = values_per_lane
        self._compile_fn = compile_fn
        self.device_type = device_type
        self.poison = settings.flag("TORCH_SPARSE_METAL_POISON", False) if poison is None else poison
        self._check_platform = check_platform
        self._library: Any = None
        self._lock = threading.Lock()
        self._error_words: dict[torch.device, torch.Tensor] = {}

    # -------------------------------------------------------------------------------------------- library
    @property
    def library(self) -> Any:
        """The compiled library (compiled on first use, once)."""
        if self._library is None:
            with self._lock:
                if self._library is None:
                    if self._check_platform is not None:
                        self._check_platform()
                    self._library = self._compile_fn(load_source())
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

    def _empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if self.poison:
            return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _feature_major(self, t: torch.Tensor, ldb: int) -> torch.Tensor:
        """``[batch, cols]`` -> ``[cols, ldb]``, zero beyond ``batch``: the layout of every gathered operand."""
        batch, cols = t.shape
        out = self._empty((cols, ldb), t)
        if cols:
            fn = self.kernel("feature_major", t.dtype)
            rows = self._rows(fn)
            fn(out, t, batch, cols, ldb, threads=(-(-cols // SIMD_WIDTH) * SIMD_WIDTH, ldb // SIMD_WIDTH * rows),
               group_size=(SIMD_WIDTH, rows))
        return out

    def _tiled(self, stage: str, outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
               sizes: tuple[int, ...], nrows: int, p: int, ldb: int) -> None:
        """One tiled kernel: a SIMD-group per CSR row and batch chunk of 32 * P columns; a threadgroup holds the
        rows of one chunk (whole groups: the tile moves through threadgroup memory between barriers)."""
        fn = self.kernel(stage, inputs[0].dtype, p)
        rows = self._rows(fn, p)
        chunks = ldb // (SIMD_WIDTH * p)
        fn(*outputs, *inputs, *sizes, ldb, threads=(-(-nrows // rows) * SIMD_WIDTH * rows, chunks),
           group_size=(SIMD_WIDTH * rows, 1))

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

    def forward(self, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor, dst: torch.Tensor,
                src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor, perm: torch.Tensor
                ) -> torch.Tensor:
        """``y[n, o] = sum_k weight[perm[k]] * x[n, src_by_dst[k]]``, arguments as in the op contract."""
        self._check_device(x)
        n, n_in, n_out, nnz = check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
        y = self._empty((n, n_out), x)
        if n == 0 or n_out == 0:
            return y
        if nnz == 0:
            return y.zero_()
        p = self._p(x, tuning.bucket_key(x.dtype, n_in, n_out, nnz, n, "forward"))
        ldb = _padded(n, p)
        w_by_dst = self._empty((nnz,), weight)
        gather = self.kernel("gather", weight.dtype)
        gather(w_by_dst, weight, perm, self._errors(x.device, "perm"), nnz, threads=nnz,
               group_size=min(nnz, SIMD_WIDTH * self._rows(gather)))
        self._tiled("spmm", (y,), (w_by_dst, self._feature_major(x, ldb), col_ptr, src_by_dst,
                                   self._errors(x.device, "col_ptr")), (n, n_out, n_in, nnz), n_out, p, ldb)
        return y

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor,
                 dst: torch.Tensor, src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor,
                 perm: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_x [N, in], grad_weight [E])`` with a concrete ``strategy`` of the contract.

        ``"auto"`` is resolved by the autograd rule (``strategy.resolve_strategy``) before any backend runs, so
        it is rejected here as by the CPU and CUDA kernels. The atomic strategy sums in a nondeterministic order.
        """
        self._check_device(x)
        n, n_in, n_out, nnz = check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm,
                                             strategy)
        run = _BACKWARD_KERNELS[Strategy(strategy)]  # every strategy of the contract has an entry (checked below)
        # fused_atomic adds into grad_w with float atomics, so for every dtype it sums into a zeroed float32
        # buffer (rounded once at the end for 16-bit values); atomic_free's pass 1 writes each element once.
        fused = run is MetalCsrLinear._fused_atomic
        grad_w = torch.zeros((nnz,), dtype=torch.float32 if fused else weight.dtype, device=weight.device) \
            if fused or n == 0 else self._empty((nnz,), weight)
        grad_x = self._empty((n, n_in), x)
        if n == 0 or n_in == 0:
            return grad_x, grad_w.to(weight.dtype)
        if nnz == 0:
            return grad_x.zero_(), grad_w.to(weight.dtype)
        p = self._p(x, tuning.bucket_key(x.dtype, n_in, n_out, nnz, n), strategy)
        ldb = _padded(n, p)
        run(self, grad_x, grad_w, self._feature_major(grad_out, ldb), x, weight, row_ptr, dst,
            self._errors(x.device, "row_ptr"), (n, n_in, n_out, nnz), p, ldb)
        return grad_x, grad_w.to(weight.dtype)

    def _fused_atomic(self, grad_x, grad_w, gt, x, weight, row_ptr, dst, errors, sizes, p, ldb) -> None:
        """One pass: a SIMD-group owns (source row, batch chunk) of grad_x and adds its edges' parts into the
        float32 grad_w atomically."""
        self._tiled("spmm_sddmm_atomic", (grad_x, grad_w), (weight, gt, x, row_ptr, dst, errors), sizes, sizes[1],
                    p, ldb)

    def _atomic_free(self, grad_x, grad_w, gt, x, weight, row_ptr, dst, errors, sizes, p, ldb) -> None:
        """Two passes with exclusive ownership: a SIMD-group per source row owns its edges' grad_w over the whole
        batch, then the SpMM over the same rows owns grad_x."""
        n, n_in, n_out, nnz = sizes
        fn = self.kernel("sddmm", x.dtype, p)
        fn(grad_w, gt, self._feature_major(x, ldb), row_ptr, dst, errors, n_in, n_out, nnz, ldb,
           threads=n_in * SIMD_WIDTH, group_size=SIMD_WIDTH * self._rows(fn))
        self._tiled("spmm", (grad_x,), (weight, gt, row_ptr, dst, errors), sizes, n_in, p, ldb)

    def _p(self, x: torch.Tensor, bucket: str, strategy: str | None = None) -> int:
        """P of a call: fixed at construction, else the tuner's for the bucket (a lookup, no device wait), else the
        static rule."""
        if self.values_per_lane is not None:
            return self.values_per_lane
        p = tuning.variant(x.device, bucket, "values_per_lane", strategy)
        return p if type(p) is int and p in VALUES_PER_LANE else values_per_lane(x.shape[0])

    # --------------------------------------------------------------------------------------------- checks
    def _check_device(self, x: torch.Tensor) -> None:
        """What only this backend requires; the op's own checks are the Python boundary's (_checks.py)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if x.device.type != self.device_type:
            raise RuntimeError(f"the Metal kernels run on {self.device_type} tensors, got x on {x.device}")
        if x.dtype not in KERNEL_DTYPES:
            names = ", ".join(str(d) for d in KERNEL_DTYPES)
            raise TypeError(f"x has dtype {x.dtype}; the Metal kernels support {names}")


def _exhaustive(table: dict[Strategy, Callable[..., None]]) -> dict[Strategy, Callable[..., None]]:
    """``table`` if it maps every strategy of the contract, else an ImportError naming the ones missing: a
    strategy added to csrc/contract.h fails here, at registration, instead of running another's kernels."""
    missing = sorted(set(STRATEGIES) - set(table))
    if missing:
        raise ImportError(f"torch_sparse_metal.backends.mps has no Metal kernels for strategies {missing}")
    return table


#: The kernels of each backward strategy.
_BACKWARD_KERNELS = _exhaustive({Strategy.FUSED_ATOMIC: MetalCsrLinear._fused_atomic,
                                 Strategy.ATOMIC_FREE: MetalCsrLinear._atomic_free})


def _padded(batch: int, p: int) -> int:
    """The feature-major operands' row length: the batch rounded up to whole chunks of 32 * P."""
    chunk = SIMD_WIDTH * p
    return -(-batch // chunk) * chunk


# ------------------------------------------------------------------------------------ MPS registration
_default: MetalCsrLinear | None = None


def default() -> MetalCsrLinear:
    """The process-wide instance on MPS, compiling with ``torch.mps.compile_shader`` on first use."""
    global _default
    if _default is None:
        _default = MetalCsrLinear(lambda src: torch.mps.compile_shader(src), "mps", check_platform=check_mps_support)
    return _default


def _csr_linear_mps(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    return default().forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)


def _csr_linear_backward_mps(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
    return default().backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)


_registered = False
BACKEND = register_backend(Backend(
    "mps",
    is_available=torch.backends.mps.is_available,
    synchronize=lambda device: torch.mps.synchronize(),
    describe=lambda device: f"mps {platform.machine()} macOS {platform.mac_ver()[0]}",
    records_index_errors=True,
    variants=VARIANTS,
))
tuning.register_variants("mps", VARIANTS)


def register() -> bool:
    """Register the ``"mps"`` kernels of both ops; idempotent. Harmless without MPS (nothing is compiled
    until an MPS tensor arrives). Returns False when the op schemas (the ``_C`` extension) are not loaded."""
    global _registered
    if _registered:
        return True
    ns = torch.ops.torch_sparse_metal
    try:
        ns.csr_linear, ns.csr_linear_backward  # noqa: B018 - raises if the schemas are not defined
    except (AttributeError, RuntimeError):
        return False
    torch.library.register_kernel("torch_sparse_metal::csr_linear", "mps", _csr_linear_mps)
    torch.library.register_kernel("torch_sparse_metal::csr_linear_backward", "mps", _csr_linear_backward_mps)
    torch.library.register_kernel("torch_sparse_metal::take_index_errors", "mps",
                                  lambda like: default().take_index_errors(like.device))
    _registered = True
    return True


register()
