"""vmap rules of the two ops (``torch.vmap`` and the ``torch.func`` transforms built on it: ``jacrev``,
per-sample gradients). A batch of inputs over the same weights is one call on the stacked rows; anything batched
per sample that the kernels cannot merge (the weights, or the weight gradient, which is a sum over rows) is one
call per sample. The topology cannot be batched: each call has one layer.
"""

from __future__ import annotations

import torch

_OPS = torch.ops.torch_sparse_metal


def _at(t: torch.Tensor | None, dim: int | None, i: int) -> torch.Tensor | None:
    """Sample ``i`` of ``t`` along its vmapped dimension (``t`` itself when it is not batched)."""
    return t if dim is None or t is None else t.select(dim, i)


def _check_topology_unbatched(in_dims: tuple, first_index: int) -> None:
    if any(d is not None for d in in_dims[first_index:]):
        raise NotImplementedError("torch_sparse_metal: vmap over the topology (the index tensors) is not supported; "
                                  "vmap over the inputs or weights of one layer instead")


def _size(args: tuple, in_dims: tuple) -> int:
    return next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)


@torch.library.register_vmap("torch_sparse_metal::csr_linear")
def _csr_linear_vmap(info, in_dims, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    _check_topology_unbatched(in_dims, 2)
    index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
    x_dim, w_dim = in_dims[0], in_dims[1]
    if w_dim is None:  # one layer, more rows: stack the samples' rows
        xb = x.movedim(x_dim, 0)
        rows = xb.reshape(-1, xb.shape[-1]).contiguous()
        y = _OPS.csr_linear(rows, weight, *index, backward)
        return y.view(*xb.shape[:-1], y.shape[-1]), 0
    n = _size((x, weight), (x_dim, w_dim))
    return torch.stack([_OPS.csr_linear(_at(x, x_dim, i).contiguous(), _at(weight, w_dim, i).contiguous(), *index,
                                        backward) for i in range(n)]), 0


@torch.library.register_vmap("torch_sparse_metal::csr_linear_backward")
def _csr_linear_backward_vmap(info, in_dims, grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm,
                              strategy):
    _check_topology_unbatched(in_dims, 3)
    index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
    n = _size((grad_out, x, weight), in_dims[:3])
    outs = [_OPS.csr_linear_backward(_at(grad_out, in_dims[0], i).contiguous(), _at(x, in_dims[1], i).contiguous(),
                                     _at(weight, in_dims[2], i).contiguous(), *index, strategy)
            for i in range(n)]
    return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)
