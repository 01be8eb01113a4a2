"""Independent references for tests: float64 dense math and ``torch.sparse``, never our kernels."""

from __future__ import annotations

import torch

from torch_sparse_metal.topology import CSRTopology

__all__ = ["dense_weight", "reference_forward", "reference_backward", "reference_outputs", "torch_sparse_forward",
           "random_topology", "vector_dense_weight", "reference_vector_outputs"]


def dense_weight(weight: torch.Tensor, topology: CSRTopology) -> torch.Tensor:
    """``[out, in]`` float64 matrix with ``W[dst[e], src[e]] = weight[e]``."""
    w = torch.zeros(topology.out_features, topology.in_features, dtype=torch.float64)
    w[topology.dst.long().cpu(), topology.src.long().cpu()] = weight.detach().double().cpu()
    return w


def reference_forward(x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology) -> torch.Tensor:
    """``x @ W.T`` in float64 on the CPU."""
    return x.detach().double().cpu() @ dense_weight(weight, topology).t()


def reference_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` in float64: dense matmuls, then the weight gradient sampled at the edges."""
    g, xd = grad_out.detach().double().cpu(), x.detach().double().cpu()
    grad_x = g @ dense_weight(weight, topology)
    grad_dense = g.t() @ xd
    return grad_x, grad_dense[topology.dst.long().cpu(), topology.src.long().cpu()]


def reference_outputs(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, grad_x, grad_weight)`` in float64 on the CPU: :func:`reference_forward` and :func:`reference_backward`.

    Example:
        >>> topo = CSRTopology.from_mask(torch.tensor([[True, False], [True, True]]))
        >>> y, grad_x, grad_w = reference_outputs(torch.ones(1, 2), torch.ones(1, 2), torch.ones(3), topo)
        >>> y.tolist(), grad_x.tolist(), grad_w.tolist()
        ([[1.0, 2.0]], [[2.0, 1.0]], [1.0, 1.0, 1.0])
    """
    return (reference_forward(x, weight, topology), *reference_backward(grad_out, x, weight, topology))


def torch_sparse_forward(x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology) -> torch.Tensor:
    """``x @ W.T`` through ``torch.sparse`` (a CSR matrix by output row), in float64."""
    t = topology.to("cpu")
    w = torch.sparse_csr_tensor(t.col_ptr.long(), t.src_by_dst.long(), weight.detach().double().cpu()[t.perm.long()],
                                (t.out_features, t.in_features))
    return torch.sparse.mm(w, x.detach().double().cpu().t()).t()


def random_topology(in_features: int, out_features: int, density: float, seed: int,
                    empty_rows: bool = False) -> CSRTopology:
    """A random topology; with ``empty_rows`` a third of inputs and outputs get no edges at all."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(out_features, in_features, generator=g) < density
    if empty_rows and in_features and out_features:
        mask[:, torch.randperm(in_features, generator=g)[: in_features // 3]] = False
        mask[torch.randperm(out_features, generator=g)[: out_features // 3]] = False
    return CSRTopology.from_mask(mask)


def vector_dense_weight(weight: torch.Tensor, groups: CSRTopology) -> torch.Tensor:
    """``[groups.out_features * V, in]`` float64 matrix of the vector ops' arguments: ``weight`` ``[vectors, V]``
    and the topology over vectors ``groups`` (``dst`` a vector's group):
    ``W[dst[j] * V + l, src[j]] = weight[j, l]``."""
    v = weight.shape[1]
    w = torch.zeros(groups.out_features * v, groups.in_features, dtype=torch.float64)
    rows = groups.dst.long().cpu()[:, None] * v + torch.arange(v)
    w[rows, groups.src.long().cpu()[:, None].expand(-1, v)] = weight.detach().double().cpu()
    return w


def reference_vector_outputs(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, groups: CSRTopology
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, grad_x, grad_weight [vectors, V])`` of the ops in the vector layout in float64 on the CPU, from dense
    matmuls (see :func:`vector_dense_weight`).

    Example:
        >>> groups = CSRTopology.from_mask(torch.tensor([[True, False]]))  # 2 inputs -> 1 group
        >>> y, gx, gw = reference_vector_outputs(torch.ones(1, 8), torch.ones(1, 2), torch.ones(1, 8), groups)
        >>> y.shape, gx.tolist(), gw.shape
        (torch.Size([1, 8]), [[8.0, 0.0]], torch.Size([1, 8]))
    """
    v = weight.shape[1]
    w = vector_dense_weight(weight, groups)
    g, xd = grad_out.detach().double().cpu(), x.detach().double().cpu()
    rows = groups.dst.long().cpu()[:, None] * v + torch.arange(v)
    grad_w = (g.t() @ xd)[rows, groups.src.long().cpu()[:, None].expand(-1, v)]
    return xd @ w.t(), g @ w, grad_w
