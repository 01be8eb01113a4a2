"""The one autograd rule of ``csr_linear``, shared by every backend: it picks the backward strategy and
calls the ``csr_linear_backward`` op, whose kernels the backends supply.

The rule is registered for the op (``torch.library.register_autograd``), so calling
``torch.ops.torch_sparse_metal.csr_linear`` carries gradients. ``SparseLinear`` enters the same rule through
:class:`CSRLinearFunction` instead: torch.library's generic Python wrapper costs about 90 µs of host time per
call, which measurably slowed training steps of small layers (docs/training.md); the Function costs a few.
"""

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


class CSRLinearFunction(torch.autograd.Function):
    """``csr_linear`` with the rule above, entered directly: the forward runs the op below the autograd key.
    Takes the topology as one argument: ``apply`` inspects every argument (7 fewer tensors: ~2 µs less a call).

    Example:
        >>> from torch_sparse_metal import CSRTopology
        >>> topo = CSRTopology.random(6, 4, 0.5, generator=torch.Generator().manual_seed(0))
        >>> w = torch.randn(topo.nnz, requires_grad=True)
        >>> CSRLinearFunction.apply(torch.randn(3, 6), w, topo, "fused_atomic").sum().backward()
        >>> w.grad.shape == w.shape
        True
    """

    # ctx-style forward on purpose: a Function with a separate setup_context re-binds its arguments with
    # inspect.signature on every call, which costs as much as the wrapper this class avoids.
    @staticmethod
    def forward(ctx, x, weight, topology, strategy):
        inputs = (x, weight, *topology.kernel_args(), strategy)
        with torch._C._AutoDispatchBelowAutograd():
            output = _FORWARD(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = _backward(ctx, grad_out)[:2]
        return grad_x, grad_w, None, None


_FORWARD = torch.ops.torch_sparse_metal.csr_linear.default
