"""MPS host code: compiles ``shaders/*.metal`` with ``torch.mps.compile_shader`` and registers the ``"mps"``
kernels of ``torch_sparse_metal::csr_linear`` and ``torch_sparse_metal::csr_linear_backward``.

All dispatch logic lives in :class:`MetalCsrLinear`, parameterised by the compile function, so the very same
code (argument order, scalar widths, grid and threadgroup sizes) runs in CI with CPU tensors under the
MSL-on-CPU executor (:func:`torch_sparse_metal.testing.msl.compile_shader`). Nothing here waits on the
device: checks look at metadata only and kernels are encoded on the current MPS stream.

Example (CPU, through the executor)::

    >>> from torch_sparse_metal.testing.msl import compile_shader
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
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "COMMON_HEADER",
    "KERNEL_DTYPES",
    "SHADER_FILES",
    "STRATEGIES",
    "MetalCsrLinear",
    "check_mps_support",
    "default",
    "load_source",
    "register",
]

#: Shader files compiled into the library, and the header of ours joined in front of each.
SHADER_FILES = ("csr_linear.metal",)
COMMON_HEADER = "csr_linear_common.h"
#: Value dtypes with kernels, and the suffix of their kernel names (``<stage>_<suffix>``).
KERNEL_DTYPES = {torch.float32: "float"}
STRATEGIES = ("fused_atomic", "atomic_free")
#: Threads per threadgroup the kernels aim for (a multiple of the SIMD width; capped by the pipeline's max).
TARGET_GROUP_THREADS = 256
_INT32_MAX = 2**31 - 1
_MIN_TORCH = (2, 7)
_MIN_MACOS = (13, 0)


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
        >>> "kernel void csr_linear_forward" in load_source()
        True
    """
    d = _shader_dir()
    parts = [f'#line 1 "{COMMON_HEADER}"\n' + (d / COMMON_HEADER).read_text()]
    parts += [f'#line 1 "{name}"\n' + (d / name).read_text() for name in SHADER_FILES]
    return "\n".join(parts)


def check_mps_support() -> None:
    """Raise a clear error if this torch or macOS cannot run the Metal kernels (only called when MPS is used)."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if version < _MIN_TORCH or not hasattr(torch.mps, "compile_shader"):
        raise RuntimeError(f"torch_sparse_metal's Metal kernels need torch >= {'.'.join(map(str, _MIN_TORCH))} "
                           f"(torch.mps.compile_shader); this is torch {torch.__version__}")
    mac = platform.mac_ver()[0]
    if mac and tuple(int(p) for p in mac.split(".")[:2]) < _MIN_MACOS:
        raise RuntimeError(f"torch_sparse_metal's Metal kernels need macOS >= {'.'.join(map(str, _MIN_MACOS))} "
                           f"(Metal 3, atomic_float); this is macOS {mac}")
    if not torch.backends.mps.is_available():
        raise RuntimeError("MPS is not available on this machine (torch.backends.mps.is_available() is False)")


class MetalCsrLinear:
    """Dispatches the Metal kernels of the sparse linear op; one compiled library per instance (lazily).

    ``compile_fn`` maps Metal source to a library object with one attribute per kernel, as
    ``torch.mps.compile_shader`` does. ``device_type`` is the device the tensors must be on (``"mps"``, or
    ``"cpu"`` under the executor). ``poison=True`` fills every output the kernels fully overwrite with NaN
    instead of leaving it uninitialised, so an element a kernel misses shows up in tests; by default it follows
    ``TORCH_SPARSE_METAL_POISON=1``, the switch the CPU kernels and tests/conftest.py use.
    """

    def __init__(self, compile_fn: Callable[[str], Any], device_type: str = "mps", *, poison: bool | None = None,
                 check_platform: Callable[[], None] | None = None):
        self._compile_fn = compile_fn
        self.device_type = device_type
        self.poison = os.environ.get("TORCH_SPARSE_METAL_POISON") == "1" if poison is None else poison
        self._check_platform = check_platform
        self._library: Any = None
        self._lock = threading.Lock()

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

    def kernel(self, stage: str, dtype: torch.dtype) -> Any:
        """The kernel ``<stage>_<dtype suffix>``, e.g. ``kernel("csr_linear_forward", torch.float32)``."""
        return getattr(self.library, f"{stage}_{KERNEL_DTYPES[dtype]}")

    # ------------------------------------------------------------------------------------------ launches
    @staticmethod
    def _groups_2d(fn: Any, rows: int) -> tuple[int, int]:
        """(SIMD width, k): a SIMD-group spans 32 adjacent features of one batch row; k rows per group."""
        width = int(fn.thread_execution_width)
        limit = min(int(fn.max_threads_per_threadgroup), TARGET_GROUP_THREADS)
        return width, max(1, min(limit // width, rows))

    @staticmethod
    def _groups_1d(fn: Any) -> int:
        width = int(fn.thread_execution_width)
        limit = min(int(fn.max_threads_per_threadgroup), TARGET_GROUP_THREADS)
        return max(width, limit // width * width)

    def _empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if self.poison:
            return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor, dst: torch.Tensor,
                src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor, perm: torch.Tensor
                ) -> torch.Tensor:
        """``y[n, o] = sum_k weight[perm[k]] * x[n, src_by_dst[k]]``, arguments as in the op contract."""
        n, n_in, nnz = self._check_common(x, weight, row_ptr, dst, src)
        self._check_index("col_ptr", col_ptr, x)
        if col_ptr.numel() < 1:
            raise ValueError("col_ptr must have out_features + 1 >= 1 entries, got 0")
        n_out = col_ptr.numel() - 1
        _check_size("out_features", n_out)
        for name, t in (("src_by_dst", src_by_dst), ("perm", perm)):
            self._check_index(name, t, x, (nnz,))
        y = self._empty((n, n_out), x)
        if n and n_out:
            fn = self.kernel("csr_linear_forward", x.dtype)
            fn(y, x, weight, col_ptr, src_by_dst, perm, n, n_in, n_out,
               threads=(n_out, n), group_size=self._groups_2d(fn, n))
        return y

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor,
                 dst: torch.Tensor, src: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_x [N, in], grad_weight [E])`` with ``strategy`` ``"fused_atomic"`` or ``"atomic_free"``.

        ``"auto"`` is resolved by the autograd rule (``strategy.resolve_strategy``) before any backend runs, so
        it is rejected here as by the CPU and CUDA kernels. The atomic strategy sums in a nondeterministic order.
        """
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown backward strategy {strategy!r}; expected one of {STRATEGIES} "
                             "('auto' is resolved before the kernel is called)")
        n, n_in, nnz = self._check_common(x, weight, row_ptr, dst, src)
        self._check_values("grad_out", grad_out, x, ndim=2)
        if grad_out.shape[0] != n:
            raise ValueError(f"grad_out has {grad_out.shape[0]} rows but x has {n}")
        n_out = grad_out.shape[1]
        _check_size("out_features", n_out)
        if strategy == "fused_atomic":
            grad_w = torch.zeros((nnz,), dtype=weight.dtype, device=weight.device)  # atomically accumulated
            grad_x = self._empty((n, n_in), x)
            if n and n_in:
                fn = self.kernel("csr_linear_backward_fused_atomic", x.dtype)
                fn(grad_x, grad_w, grad_out, x, weight, row_ptr, dst, n, n_in, n_out,
                   threads=(n_in, n), group_size=self._groups_2d(fn, n))
            return grad_x, grad_w
        grad_w = self._empty((nnz,), weight)
        if nnz:
            fn = self.kernel("csr_linear_grad_w", x.dtype)
            fn(grad_w, grad_out, x, dst, src, n, n_in, n_out, nnz, threads=nnz, group_size=self._groups_1d(fn))
        grad_x = self._empty((n, n_in), x)
        if n and n_in:
            fn = self.kernel("csr_linear_grad_x", x.dtype)
            fn(grad_x, grad_out, weight, row_ptr, dst, n, n_in, n_out,
               threads=(n_in, n), group_size=self._groups_2d(fn, n))
        return grad_x, grad_w

    # --------------------------------------------------------------------------------------------- checks
    def _check_common(self, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor, dst: torch.Tensor,
                      src: torch.Tensor) -> tuple[int, int, int]:
        """Validate what every kernel binds (compile_shader checks nothing); returns (N, in, E)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if x.device.type != self.device_type:
            raise RuntimeError(f"the Metal kernels run on {self.device_type} tensors, got x on {x.device}")
        if x.dtype not in KERNEL_DTYPES:
            names = ", ".join(str(d) for d in KERNEL_DTYPES)
            raise TypeError(f"x has dtype {x.dtype}; the Metal kernels support {names}")
        self._check_values("x", x, x, ndim=2)
        self._check_values("weight", weight, x, ndim=1)
        n, n_in = x.shape
        nnz = weight.shape[0]
        for name, value in (("batch", n), ("in_features", n_in), ("nnz", nnz)):
            _check_size(name, value)
        self._check_index("row_ptr", row_ptr, x, (n_in + 1,))
        self._check_index("dst", dst, x, (nnz,))
        self._check_index("src", src, x, (nnz,))
        return n, n_in, nnz

    @staticmethod
    def _check_values(name: str, t: torch.Tensor, x: torch.Tensor, ndim: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise RuntimeError(f"{name} is on {t.device} but x is on {x.device}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels read raw row-major memory)")

    @staticmethod
    def _check_index(name: str, t: torch.Tensor, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise RuntimeError(f"{name} is on {t.device} but x is on {x.device}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (the kernels read 32-bit indices), got {t.dtype}")
        if t.dim() != 1 or (shape is not None and tuple(t.shape) != shape):
            want = f"shape {shape}" if shape is not None else "1-D"
            raise ValueError(f"{name} must have {want}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _check_size(name: str, value: int) -> None:
    if value > _INT32_MAX:
        raise ValueError(f"{name}={value} exceeds the 32-bit indexing of the Metal kernels ({_INT32_MAX})")


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


def _csr_linear_backward_mps(grad_out, x, weight, row_ptr, dst, src, strategy):
    return default().backward(grad_out, x, weight, row_ptr, dst, src, strategy)


_registered = False


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
    _registered = True
    return True


register()
