"""The one autograd rule of ``csr_linear``, shared by every backend: it picks the backward strategy and
calls the ``csr_linear_backward`` op, whose kernels the backends supply."""

from __future__ import annotations

import torch

from .strategy import resolve_strategy


def _setup_context(ctx, inputs, output):
    x, weight, row_ptr, dst, src, col_ptr, _src_by_dst, _perm, backward = inputs
    ctx.save_for_backward(x, weight, row_ptr, dst, src)
    ctx.backward = backward
    ctx.out_features = col_ptr.shape[0] - 1


def _backward(ctx, grad_out):
    x, weight, row_ptr, dst, src = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x = grad_w = None
    if need_x or need_w:
        strategy = resolve_strategy(ctx.backward, x.device, x.shape[1], ctx.out_features, weight.shape[0], x.shape[0])
        grad_x, grad_w = torch.ops.torch_sparse_metal.csr_linear_backward(
            grad_out.contiguous(), x, weight, row_ptr, dst, src, strategy
        )
    return (grad_x if need_x else None, grad_w if need_w else None) + (None,) * 7


torch.library.register_autograd("torch_sparse_metal::csr_linear", _backward, setup_context=_setup_context)
