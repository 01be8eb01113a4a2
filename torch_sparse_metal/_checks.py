"""Argument checks shared by the op families' Python-boundary checks (``ops/<op>.py``), which the Metal host code
and the fake (meta) kernels run (the C++ backends run ``csrc/<op>_checks.cpp``). Metadata only (shapes, dtypes,
devices, contiguity): a check never reads a tensor's values, so it costs no device synchronisation and works on
fake tensors."""

from __future__ import annotations

import torch

from .contract import INT32_MAX

__all__ = ["INT32_MAX", "check_index", "check_size", "check_strided", "check_tensor_beside", "check_values"]

_LAYOUTS = {torch.sparse_coo: "sparse COO", torch.sparse_csr: "sparse CSR", torch.sparse_csc: "sparse CSC",
            torch.sparse_bsr: "sparse BSR", torch.sparse_bsc: "sparse BSC", torch._mkldnn: "MKL-DNN"}


def check_strided(name: str, t: torch.Tensor) -> None:
    """``t`` is a dense (strided) tensor: the kernels read raw row-major memory, which sparse layouts do not have.
    The one check of layouts, before any other look at ``t`` (a sparse tensor fails most of them obscurely)."""
    if t.layout != torch.strided:
        kind = _LAYOUTS.get(t.layout, str(t.layout))
        raise TypeError(f"{name} is a {kind} tensor (layout {t.layout}); the sparse layers and their ops take dense "
                        f"(strided) tensors: pass {name}.to_dense()")


def check_tensor_beside(name: str, t, x: torch.Tensor) -> None:
    """``t`` is a dense tensor on ``x``'s device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    check_strided(name, t)
    if t.device != x.device:
        raise RuntimeError(f"{name} is on {t.device} but x is on {x.device}")


def check_values(name: str, t, x: torch.Tensor, ndim: int) -> None:
    """``t`` holds values beside ``x``: its device and dtype, ``ndim`` dimensions, contiguous."""
    check_tensor_beside(name, t, x)
    if t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels read raw row-major memory)")


def check_index(name: str, t, x: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """``t`` is an index array beside ``x``: int32, 1-D (of ``shape`` when given), contiguous."""
    check_tensor_beside(name, t, x)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (the kernels read 32-bit indices), got {t.dtype}")
    if t.dim() != 1 or (shape is not None and tuple(t.shape) != shape):
        want = f"shape {shape}" if shape is not None else "1-D"
        raise ValueError(f"{name} must have {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_size(name: str, value: int) -> None:
    """A size within the kernels' 32-bit indexing."""
    if isinstance(value, torch.SymInt):  # tracing (torch.export, dynamic shapes): a bound here would become a guard
        return  # the user must restate; the kernels check the real size when they run
    if value > INT32_MAX:
        raise ValueError(f"{name}={value} exceeds the 32-bit indexing of the kernels ({INT32_MAX})")
