"""The ``vector_csr_linear`` op family's Python side (schemas: ``csrc/vector_csr_linear.cpp``; C++ checks:
``csrc/csr_linear_checks.cpp``; kernels: ``csrc/cpu/vector_csr_linear_cpu.cpp``,
``csrc/cuda/vector_csr_linear_cuda.cu``, ``shaders/vector_csr_linear.metal`` with
:mod:`torch_sparse_metal.backends.mps_vector_csr_linear`): typed wrappers, Python-boundary checks, fake kernels, vmap
rules and the autograd rule.

A vector layer's connections are vectors of ``V`` consecutive outputs (``V`` in ``contract.VECTOR_BLOCKS``). The ops
take the index arrays of a topology over vectors (``CSRTopology.vectors``: a layer ``in_features -> groups`` whose
``dst`` is a vector's group ``g``, feeding outputs ``g*V .. g*V+V-1``) and a weight ``[vectors, V]``, a view of the
layer's 1-D weight (a vector's ``V`` values are consecutive in the element-level edge order).

The autograd rule is :mod:`._csr_linear`'s, over the same strategies: without ``create_graph`` it calls
``vector_csr_linear_backward`` with the resolved strategy; under ``create_graph=True`` (or forward mode) it builds
the gradients from the element-level differentiable ops of ``csr_linear`` on the expanded topology
(:func:`torch_sparse_metal.topology.element_index`), which compute the same sums edge by edge, so derivatives of
every order exist.
"""

from __future__ import annotations

import torch

from .._checks import check_size, check_values
from ..contract import VECTOR_BLOCKS
from ..strategy import check_deterministic, parse_strategy, resolve_vector_strategy
from ..topology import element_index
from . import _csr_linear

__all__ = ["VectorCSRLinearFunction", "check_vector_backward", "check_vector_forward", "vector_csr_linear",
           "vector_csr_linear_backward"]

_OPS = torch.ops.torch_sparse_metal
_FORWARD = _OPS.vector_csr_linear.default
_BACKWARD = _OPS.vector_csr_linear_backward.default


# ------------------------------------------------------------------------------------------------ wrappers
def vector_csr_linear(x: torch.Tensor, weight: torch.Tensor, vectors, backward: str = "auto") -> torch.Tensor:
    """``y[n, g*V + l] = sum_j weight[j, l] * x[n, src[j]]`` over the vectors ``j`` of group ``g``; differentiable.

    ``x`` is ``[batch, in_features]``, ``weight`` ``[vectors, V]``, ``vectors`` the topology over vectors
    (a :class:`~torch_sparse_metal.CSRTopology` ``in_features -> groups``); returns ``[batch, groups * V]``.

    Example:
        >>> from torch_sparse_metal import CSRTopology
        >>> groups = CSRTopology.random(8, 2, 0.5, generator=torch.Generator().manual_seed(0))
        >>> vector_csr_linear(torch.randn(3, 8), torch.randn(groups.nnz, 16), groups).shape
        torch.Size([3, 32])
    """
    return _OPS.vector_csr_linear(x, weight, *vectors.kernel_args(), backward)


def vector_csr_linear_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, vectors,
                               strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of :func:`vector_csr_linear` with a concrete strategy (not ``"auto"``)."""
    return _OPS.vector_csr_linear_backward(grad_out, x, weight, *vectors.kernel_args(), strategy)


# ------------------------------------------------------------------------------ Python-boundary checks
# The Metal host code and the fake kernels run these (the C++ backends run check_vector_* in C++).
def check_vector_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm) -> tuple[int, int, int, int, int]:
    """Checks of ``vector_csr_linear``'s arguments; returns ``(batch, in_features, groups, vectors, V)``."""
    _csr_linear.check_x(x)
    check_values("weight", weight, x, ndim=2)
    vectors, block = weight.shape
    if block not in VECTOR_BLOCKS:
        raise ValueError(f"weight has vectors of {block} values; the vector ops take blocks of {VECTOR_BLOCKS} "
                         "(block 1 is csr_linear)")
    n, n_in = x.shape
    for name, value in (("batch", n), ("in_features", n_in), ("vectors", vectors)):
        check_size(name, value)
    _csr_linear.check_by_source(x, vectors, row_ptr, dst, src)
    groups = _csr_linear._check_by_destination(x, vectors, col_ptr, src_by_dst, perm)
    check_size("out_features", groups * block)
    return n, n_in, groups, vectors, block


def check_vector_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm,
                          strategy: str) -> tuple[int, int, int, int, int]:
    """Checks of ``vector_csr_linear_backward``'s arguments; returns ``(batch, in_features, groups, vectors, V)``."""
    _csr_linear.check_strategy(strategy)
    sizes = check_vector_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
    n, _, groups, _, block = sizes
    check_values("grad_out", grad_out, x, ndim=2)
    if tuple(grad_out.shape) != (n, groups * block):
        raise ValueError(f"grad_out must be [batch, out_features] = ({n}, {groups * block}), got "
                         f"{tuple(grad_out.shape)}")
    return sizes


# ------------------------------------------------------------------------------------ fake (meta) kernels
@torch.library.register_fake("torch_sparse_metal::vector_csr_linear")
def _vector_csr_linear_fake(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    n, _, groups, _, block = check_vector_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
    return x.new_empty((n, groups * block))


@torch.library.register_fake("torch_sparse_metal::vector_csr_linear_backward")
def _vector_csr_linear_backward_fake(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
    check_vector_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# --------------------------------------------------------------------------------------------- vmap rules
torch.library.register_vmap("torch_sparse_metal::vector_csr_linear",
                            _csr_linear.forward_vmap_rule(_OPS.vector_csr_linear))
torch.library.register_vmap("torch_sparse_metal::vector_csr_linear_backward",
                            _csr_linear.backward_vmap_rule(_OPS.vector_csr_linear_backward))


# ------------------------------------------------------------------------------------------ autograd rule
def _setup_context(ctx, inputs, output):
    x, weight, *index, backward = inputs
    ctx.save_for_backward(x, weight)
    ctx.index = tuple(index)
    ctx.backward = parse_strategy(backward)


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    index = ctx.index
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x = grad_w = None
    if need_x or need_w:
        grad_out = grad_out.contiguous()
        tracked = grad_out.requires_grad or x.requires_grad or weight.requires_grad
        differentiable = (torch.is_grad_enabled() and tracked) or _csr_linear._forward_mode_active()
        strategy = resolve_vector_strategy(ctx.backward)
        if differentiable:  # create_graph=True or forward mode: the element-level differentiable ops
            grad_x, grad_w = _csr_linear._differentiable_backward(
                grad_out, x, weight.reshape(-1), element_index(index, weight.shape[1]), strategy.value, need_x, need_w)
            grad_w = None if grad_w is None else grad_w.view(weight.shape)
        else:
            check_deterministic(strategy, x.device)
            grad_x, grad_w = _BACKWARD(grad_out, x, weight, *index, strategy.value)
    return (grad_x if need_x else None, grad_w if need_w else None) + (None,) * 7


# torch.library.register_autograd's kernel, for the reverse rule. As for csr_linear (ops/_csr_linear.py), its
# generated Function has no forward mode and cannot run under a torch.func transform that differentiates: dual
# tensors go to the element-level FuncCSRLinear on the same edges (its jvp), and those transforms are refused
# (sparse_linear and SparseLinear send them to the element-level ops before the op is reached).
_library_rule = torch._library.autograd.make_autograd_impl(_FORWARD, torch._library.autograd.Info(_backward,
                                                                                                  _setup_context))


def _op_autograd(keyset, *args):
    _csr_linear.check_layouts(args)
    _csr_linear.refuse_differentiating_transforms("vector_csr_linear", args)
    if _csr_linear._eager_tangents():
        x, weight, *index, backward = args
        return _csr_linear.FuncCSRLinear.apply(x, weight.reshape(-1), *element_index(tuple(index), weight.shape[1]),
                                               backward)
    return _library_rule(keyset, *args)


_LIB = torch.library.Library("torch_sparse_metal", "IMPL")
_LIB.impl("vector_csr_linear", _op_autograd, "Autograd", with_keyset=True)


class VectorCSRLinearFunction(torch.autograd.Function):
    """``vector_csr_linear`` with the rule above, entered directly (no torch.library wrapper, as
    ``CSRLinearFunction``); takes the topology over vectors as one argument.

    Example:
        >>> from torch_sparse_metal import CSRTopology
        >>> groups = CSRTopology.random(6, 2, 0.5, generator=torch.Generator().manual_seed(0))
        >>> w = torch.randn(groups.nnz, 8, requires_grad=True)
        >>> VectorCSRLinearFunction.apply(torch.randn(3, 6), w, groups, "atomic_free").sum().backward()
        >>> w.grad.shape == w.shape
        True
    """

    @staticmethod
    def forward(ctx, x, weight, vectors, strategy):
        inputs = (x, weight, *vectors.kernel_args(), strategy)
        with torch._C._AutoDispatchBelowAutograd():
            output = _FORWARD(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = _backward(ctx, grad_out)[:2]
        return grad_x, grad_w, None, None
