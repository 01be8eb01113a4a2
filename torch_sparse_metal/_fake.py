"""Fake (meta) kernels: output shapes from argument sizes, never from tensor values. The argument checks are the
Python boundary's (:mod:`torch_sparse_metal._checks`), as for the Metal host code."""

from __future__ import annotations

import torch

from ._checks import check_backward, check_forward


@torch.library.register_fake("torch_sparse_metal::csr_linear")
def _csr_linear_fake(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
    return x.new_empty((x.shape[0], col_ptr.shape[0] - 1))


@torch.library.register_fake("torch_sparse_metal::csr_linear_backward")
def _csr_linear_backward_fake(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
    check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)
