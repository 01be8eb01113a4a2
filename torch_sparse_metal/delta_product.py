"""The fused product of a sparse delta over a dense weight: ``y = x @ (W + D)^T + b`` as one dense product, where
``W`` is the base layer's dense weight and ``D`` the delta's values at their connections.

A :class:`~torch_sparse_metal.SparseDelta` computes ``base(x) + delta(x)``: a dense product, a sparse product and
an add of the two outputs, and in the backward the same again plus the sum of the two input gradients. The
sparse product costs in proportion to ``rows * nnz`` (rows of ``x`` times connections); a copy of ``W`` with ``D``
added at its connections costs in proportion to ``out * in``. Where ``rows * nnz >= out * in``
(:func:`fused_pays`: a training batch of any usual size) the wrapper scatters the delta into a copy of the weight
and runs the one dense product instead; the copy lives for the forward only, never saved for the backward.

The backward (:class:`FusedDeltaLinear`) takes each gradient where it costs least:

- ``grad_D``, the delta's gradient: the one autograd rule of the ``csr_linear`` ops (``csr_linear_grads``): the
  sampled product ``grad_out^T x`` at the delta's connections, no dense ``[out, in]`` gradient. Its kernel makes
  the delta's share of ``grad_x``, ``grad_out @ D``, in the same pass.
- ``grad_x = grad_out @ W + grad_out @ D``: one ``addmm`` of the base weight onto that share.
- ``grad_W = grad_out^T x`` (as ``nn.Linear``'s) only when the base trains, and ``grad_b`` its row sum.

Under ``create_graph=True`` every one of these is built from differentiable ops (the rule's differentiable
gradients and ``addmm``), so higher-order gradients are exact as on the two-product path.

Example:
    >>> from torch_sparse_metal import CSRTopology
    >>> topo = CSRTopology.random(6, 4, 0.5, generator=torch.Generator().manual_seed(0))
    >>> weight, values = torch.randn(4, 6), torch.randn(topo.nnz, requires_grad=True)
    >>> x = torch.randn(3, 6)
    >>> y = FusedDeltaLinear.apply(x, weight, None, values, topo, flat_cells(topo), "auto")
    >>> dense = weight.clone()
    >>> dense[topo.dst.long(), topo.src.long()] += values.detach()
    >>> torch.allclose(y, x @ dense.T, atol=1e-6)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops._csr_linear import csr_linear_grads
from .strategy import parse_strategy
from .topology import CSRTopology

__all__ = ["FusedDeltaLinear", "flat_cells", "fused_pays"]


def fused_pays(rows: int, nnz: int, out_features: int, in_features: int) -> bool:
    """Whether the fused product costs less than the two products: ``rows * nnz >= out * in``, the sparse
    product's multiply-adds against the elements the weight copy writes (both a few cycles each).

    Example:
        >>> fused_pays(512, 3000, 256, 256), fused_pays(1, 3000, 256, 256)  # a training batch; one token
        (True, False)
    """
    return rows * nnz >= out_features * in_features


def flat_cells(topology: CSRTopology) -> torch.Tensor:
    """The delta's cells in the row-major flattened ``[out, in]`` weight, ``out_index * in_features + in_index``
    (int64, on the topology's device), aligned with the layer's 1-D values in either layout.

    Example:
        >>> topo = CSRTopology.random(3, 2, 0.5, generator=torch.Generator().manual_seed(0))
        >>> bool((flat_cells(topo) == topo.dst.long() * 3 + topo.src.long()).all())
        True
    """
    return topology.dst.long() * topology.in_features + topology.src.long()


class FusedDeltaLinear(torch.autograd.Function):
    """``y = x @ (weight + D)^T + bias`` with ``D`` the ``values`` at ``cells`` (:func:`flat_cells` of
    ``topology``, the delta's element-level topology); ``x`` is ``[rows, in]``, ``weight`` ``[out, in]``,
    ``values`` the delta layer's 1-D values, ``strategy`` the delta's backward strategy (``"auto"`` or a concrete
    one). Gradients for every tensor argument that requires one (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, values, topology, cells, strategy):
        merged = weight.clone(memory_format=torch.contiguous_format)
        # one add per cell (the cells are distinct): merge()'s rounding, in one op, deterministic on every device
        merged.view(-1).index_put_((cells,), values, accumulate=True)
        y = F.linear(x, merged, bias)
        ctx.save_for_backward(x, weight, values)
        ctx.topology = topology
        ctx.strategy = parse_strategy(strategy)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, values = ctx.saved_tensors
        need_x, need_w, need_b, need_d = ctx.needs_input_grad[:4]
        grad_out = grad_out.contiguous()
        topology = ctx.topology
        block = topology.block
        kernel = topology.vectors if block > 1 else topology  # the index arrays the op takes (functional.py)
        kernel_values = values.view(-1, block) if block > 1 else values
        share_x, grad_d = csr_linear_grads(
            grad_out, x, kernel_values, kernel.kernel_args(), ctx.strategy, topology.out_features, need_x, need_d
        )
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = grad_out @ weight if share_x is None else torch.addmm(share_x, grad_out, weight)
        if need_w:
            grad_w = grad_out.t() @ x
        if need_b:
            grad_b = grad_out.sum(0)
        if grad_d is not None:
            grad_d = grad_d.reshape(-1)
        return grad_x, grad_w, grad_b, grad_d, None, None, None
