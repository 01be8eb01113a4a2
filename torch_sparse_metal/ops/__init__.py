"""Typed wrappers over the ``torch.ops.torch_sparse_metal`` ops (schemas in ``csrc/csr_linear.cpp``)."""

from __future__ import annotations

import torch

from . import backends
from .contract import INDEX_ARRAYS
from .topology import CSRTopology

__all__ = ["check_index_errors", "csr_linear", "csr_linear_backward"]


def csr_linear(x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology, backward: str = "auto") -> torch.Tensor:
    """``y[n, o] = sum_e weight[e] * x[n, src[e]]`` over the edges into ``o``; differentiable.

    ``x`` is ``[batch, in_features]``; returns ``[batch, out_features]``.

    Example:
        >>> topo = CSRTopology.random(8, 4, 0.5, generator=torch.Generator().manual_seed(0))
        >>> csr_linear(torch.randn(3, 8), torch.randn(topo.nnz), topo).shape
        torch.Size([3, 4])
    """
    return torch.ops.torch_sparse_metal.csr_linear(x, weight, *topology.kernel_args(), backward)


def csr_linear_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology, strategy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of :func:`csr_linear` with a concrete strategy (not ``"auto"``)."""
    return torch.ops.torch_sparse_metal.csr_linear_backward(grad_out, x, weight, *topology.kernel_args(), strategy)


def check_index_errors(device: torch.device | str | None = None) -> None:
    """Raise if a CUDA or Metal kernel on ``device`` met an out-of-range index since the last check.

    The GPU kernels do not read index values on the host (that would wait for the device in every call): they
    clamp each index they read into its tensor, so that a malformed topology cannot reach other memory, and
    record the index array it came from. This reads and clears those records, waiting for the device; call it
    where the program synchronises anyway (``DynamicSparsity`` and the training loop do). The CPU kernels check
    index values before they run, so on the CPU this never raises. ``None``: the first available device whose
kernels record errors (CUDA, else MPS), else the CPU.

    Example:
        >>> check_index_errors("cpu")
    """
    if device is None:
        device = next((name for name in backends.available() if backends.get(name).records_index_errors), "cpu")
    like = torch.empty(0, device=device)
    backend = backends.get(like.device.type)
    if backend is None or not backend.records_index_errors:  # no kernels there, or none that record errors
        return
    bad = [name for name, word in zip(INDEX_ARRAYS, torch.ops.torch_sparse_metal.take_index_errors(like)) if word]
    if bad:
        raise RuntimeError(f"torch_sparse_metal: a kernel on {like.device} read out-of-range values of "
                           f"{', '.join(bad)} (a malformed topology given to the ops: pointer arrays must start at "
                           "0, never decrease and end at nnz; indices must lie inside the dimension they index). "
                           "The results computed with it are meaningless; build index tensors with CSRTopology, "
                           "which validates them")
