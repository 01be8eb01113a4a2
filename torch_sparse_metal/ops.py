"""Typed wrappers over the ``torch.ops.torch_sparse_metal`` ops (schemas in ``csrc/csr_linear.cpp``)."""

from __future__ import annotations

import torch

from .topology import CSRTopology

__all__ = ["csr_linear", "csr_linear_backward"]


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
