"""Fake (meta) kernels: output shapes from argument sizes, never from tensor values."""

from __future__ import annotations

import torch


@torch.library.register_fake("torch_sparse_metal::csr_linear")
def _csr_linear_fake(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    torch._check(x.dim() == 2, lambda: f"x must be 2-D [batch, in_features], got {x.dim()}-D")
    torch._check(row_ptr.numel() == x.shape[1] + 1, lambda: "row_ptr must have in_features + 1 entries")
    torch._check(weight.dim() == 1 and weight.shape[0] == dst.shape[0], lambda: "weight and dst must align")
    return x.new_empty((x.shape[0], col_ptr.shape[0] - 1))


@torch.library.register_fake("torch_sparse_metal::csr_linear_backward")
def _csr_linear_backward_fake(grad_out, x, weight, row_ptr, dst, src, strategy):
    torch._check(grad_out.dim() == 2 and grad_out.shape[0] == x.shape[0], lambda: "grad_out must be [batch, out]")
    return x.new_empty(x.shape), weight.new_empty(weight.shape)
