"""The ops' argument checks at the Python boundary: the Metal host code and the fake (meta) kernels run them
(the C++ backends run csrc/csr_linear_checks.cpp). Metadata only (shapes, dtypes, devices, contiguity): a check
never reads a tensor's values, so it costs no device synchronisation and works on fake tensors."""

from __future__ import annotations

import torch

from .contract import DTYPES, INT32_MAX, Strategy

__all__ = ["INT32_MAX", "check_backward", "check_forward", "check_strategy"]


def check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm) -> tuple[int, int, int, int]:
    """Checks of ``csr_linear``'s arguments; returns ``(batch, in_features, out_features, nnz)``."""
    n, n_in, nnz = _check_common(x, weight, row_ptr, dst, src)
    n_out = _check_by_destination(x, nnz, col_ptr, src_by_dst, perm)
    return n, n_in, n_out, nnz


def check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm,
                   strategy: str) -> tuple[int, int, int, int]:
    """Checks of ``csr_linear_backward``'s arguments; returns ``(batch, in_features, out_features, nnz)``."""
    check_strategy(strategy)
    n, n_in, nnz = _check_common(x, weight, row_ptr, dst, src)
    n_out = _check_by_destination(x, nnz, col_ptr, src_by_dst, perm)
    _check_values("grad_out", grad_out, x, ndim=2)
    if grad_out.shape[0] != n:
        raise ValueError(f"grad_out has {grad_out.shape[0]} rows but x has {n}")
    if grad_out.shape[1] != n_out:
        raise ValueError(f"grad_out has {grad_out.shape[1]} columns but the topology has out_features={n_out}")
    return n, n_in, n_out, nnz


def check_strategy(strategy: str) -> None:
    """A concrete strategy of the contract (``auto`` is resolved by the autograd rule before a kernel runs)."""
    if strategy == Strategy.AUTO.value or strategy not in Strategy.__members__.values():
        concrete = [s.value for s in Strategy if s is not Strategy.AUTO]
        raise ValueError(f"unknown backward strategy {strategy!r}; expected one of {concrete} "
                         "('auto' is resolved before the kernel is called)")


def _check_common(x, weight, row_ptr, dst, src) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"x has dtype {x.dtype}; the kernels support {names}")
    _check_values("x", x, x, ndim=2)
    _check_values("weight", weight, x, ndim=1)
    n, n_in = x.shape
    nnz = weight.shape[0]
    for name, value in (("batch", n), ("in_features", n_in), ("nnz", nnz)):
        _check_size(name, value)
    _check_index("row_ptr", row_ptr, x, (n_in + 1,))
    _check_index("dst", dst, x, (nnz,))
    _check_index("src", src, x, (nnz,))
    return n, n_in, nnz


def _check_by_destination(x, nnz, col_ptr, src_by_dst, perm) -> int:
    _check_index("col_ptr", col_ptr, x)
    if col_ptr.shape[0] < 1:
        raise ValueError("col_ptr must have out_features + 1 >= 1 entries, got 0")
    n_out = col_ptr.shape[0] - 1
    _check_size("out_features", n_out)
    _check_index("src_by_dst", src_by_dst, x, (nnz,))
    _check_index("perm", perm, x, (nnz,))
    if nnz and not (x.shape[1] and n_out):  # the kernels' index guards rely on both ranges being non-empty
        raise ValueError(f"{nnz} edges but in_features={x.shape[1]} and out_features={n_out}; a layer with no "
                         "inputs or no outputs has no edges")
    return n_out


def _check_tensor_beside(name: str, t, x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device != x.device:
        raise RuntimeError(f"{name} is on {t.device} but x is on {x.device}")


def _check_values(name: str, t, x: torch.Tensor, ndim: int) -> None:
    _check_tensor_beside(name, t, x)
    if t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read raw row-major memory)")


def _check_index(name: str, t, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    _check_tensor_beside(name, t, x)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (the kernels read 32-bit indices), got {t.dtype}")
    if t.dim() != 1 or (shape is not None and tuple(t.shape) != shape):
        want = f"shape {shape}" if shape is not None else "1-D"
        raise ValueError(f"{name} must have {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_size(name: str, value: int) -> None:
    if isinstance(value, torch.SymInt):  # tracing (torch.export, dynamic shapes): a bound here would become a guard
        return  # the user must restate; the kernels check the real size when they run
    if value > INT32_MAX:
        raise ValueError(f"{name}={value} exceeds the 32-bit indexing of the kernels ({INT32_MAX})")
