"""The one autograd rule of ``csr_linear``, shared by every backend: it picks the backward strategy and
calls the ``csr_linear_backward`` op, whose kernels the backends supply. Under ``create_graph=True`` it builds
the gradients from differentiable ops instead (the forward op over the transposed layer, and a sampled product),
so second- and higher-order gradients are exact.

The rule is registered for the op (``torch.library.register_autograd``), so calling
``torch.ops.torch_sparse_metal.csr_linear`` carries gradients. ``SparseLinear`` enters the same rule through
:class:`CSRLinearFunction` instead: torch.library's generic Python wrapper costs about 90 µs of host time per
call, which measurably slowed training steps of small layers (docs/training.md); the Function costs a few.
It is also where the forward's kernel variants are tuned (:mod:`torch_sparse_metal.tuning`), on devices whose
backend declares some (MPS): at the first eager forward of a size bucket, on real tensors.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from . import tuning
from .strategy import Strategy, check_deterministic, parse_strategy, resolve_strategy


def _setup_context(ctx, inputs, output):
    x, weight, *index, backward = inputs
    ctx.save_for_backward(x, weight)
    ctx.index = tuple(index)  # the topology's index tensors: never modified in place (CSRTopology is immutable)
    ctx.backward = parse_strategy(backward)
    ctx.out_features = index[3].shape[0] - 1


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    index = ctx.index
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_x = grad_w = None
    if need_x or need_w:
        grad_out = grad_out.contiguous()
        differentiable = torch.is_grad_enabled() and (grad_out.requires_grad or x.requires_grad or weight.requires_grad)

        def measure(s: Strategy) -> object:  # a candidate backward, for tuning "auto" on real tensors
            return _OPS.csr_linear_backward(grad_out, x, weight, *index, s.value)

        tunable = not differentiable and _tunable(x, weight)
        strategy = resolve_strategy(ctx.backward, x.device, x.shape[1], ctx.out_features, weight.shape[0], x.shape[0],
                                    dtype=x.dtype, measure=measure if tunable else None)
        if differentiable:
            # create_graph=True: gradients that are themselves differentiable (gradient penalties, Hessian-vector
            # products), built from ops that carry autograd, instead of the backward kernels, which do not
            grad_x, grad_w = _differentiable_backward(grad_out, x, weight, index, strategy.value, need_x, need_w)
        else:
            check_deterministic(strategy, x.device)  # torch's contract: raise (or warn) before a nondeterministic sum
            grad_x, grad_w = _BACKWARD(grad_out, x, weight, *index, strategy.value)
    return (grad_x if need_x else None, grad_w if need_w else None) + (None,) * 7


def _tunable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call on these tensors may be timed to tune a bucket: real tensors with work to time."""
    return _real(x) and x.shape[0] > 0 and weight.shape[0] > 0  # sizes last: symbolic while tracing


def _real(t: torch.Tensor) -> bool:
    """Tensors that can be timed: not meta, fake (torch.compile tracing) or functorch-wrapped, and not inside a
    CUDA graph capture (timing synchronises, which a capture forbids)."""
    return (t.device.type != "meta" and not torch.compiler.is_compiling() and not is_fake(t)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t)
            and not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))


# -------------------------------------------------------------------------------- second-order gradients
def _transposed(index: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The op's index tensors for the transposed layer (inputs and outputs swapped). Its edge k is edge
    ``perm[k]`` here: by-destination order becomes by-source order, so every array is one we have, except the
    per-edge sources (``dst[perm]``) and the inverse permutation."""
    row_ptr, dst, src, col_ptr, src_by_dst, perm = index
    p = perm.long()
    inverse = torch.empty_like(p).scatter_(0, p, torch.arange(p.numel(), device=p.device))
    return col_ptr, src_by_dst, dst.long()[p].to(torch.int32), row_ptr, dst, inverse.to(torch.int32)


def _differentiable_backward(grad_out, x, weight, index, strategy, need_x, need_w):
    """``(grad_x, grad_w)`` as differentiable functions of ``grad_out``, ``x`` and ``weight``:
    ``grad_x`` is the forward op over the transposed layer (weights in its edge order), ``grad_w`` the sampled
    product below. Both call ops with autograd rules, so derivatives of any order exist."""
    grad_x = grad_w = None
    if need_x:
        weight_t = weight.index_select(0, index[5].long())
        grad_x = _OPS.csr_linear(grad_out, weight_t, *_transposed(index), strategy)
    if need_w:
        grad_w = _SampledProduct.apply(grad_out, x, index, strategy)
    return grad_x, grad_w


class _SampledProduct(torch.autograd.Function):
    """``g[e] = sum_n grad_out[n, dst[e]] * x[n, src[e]]``: the weight gradient as a differentiable function.

    Its gradients are sparse products of the same layer: for ``gg`` (the gradient of ``g``), ``d grad_out =
    x @ W(gg).T`` (the forward op with edge values ``gg``) and ``d x = grad_out @ W(gg)`` (the forward op over the
    transposed layer)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_out, x, index, strategy):
        values = grad_out.new_zeros(index[1].shape[0])  # grad_x of the call is not used
        return _OPS.csr_linear_backward(grad_out, x, values, *index, Strategy.ATOMIC_FREE.value)[1]

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, index, strategy = inputs
        ctx.save_for_backward(grad_out, x)
        ctx.index, ctx.strategy = index, strategy

    @staticmethod
    def backward(ctx, gg):
        grad_out, x = ctx.saved_tensors
        index, strategy = ctx.index, ctx.strategy
        gg = gg.contiguous()
        d_grad_out = d_x = None
        if ctx.needs_input_grad[0]:
            d_grad_out = _OPS.csr_linear(x, gg, *index, strategy)
        if ctx.needs_input_grad[1]:
            d_x = _OPS.csr_linear(grad_out, gg.index_select(0, index[5].long()), *_transposed(index), strategy)
        return d_grad_out, d_x, None, None


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
            if x.device.type in tuning.VARIANTS and _tunable(x, weight):  # eager: the forward's variants are tuned
                tuning.tune_forward(x.device, x.dtype, topology.in_features, topology.out_features, topology.nnz,
                                    x.shape[0], lambda: _FORWARD(*inputs))
            output = _FORWARD(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = _backward(ctx, grad_out)[:2]
        return grad_x, grad_w, None, None


class FuncCSRLinear(torch.autograd.Function):
    """The same rule in the form ``torch.func`` transforms need (``setup_context``; vmap through the ops' vmap
    rules): ``sparse_linear`` enters it when a transform (``grad``, ``vjp``, ``jacrev``, ``vmap``) is active.

    Example:
        >>> from torch_sparse_metal import CSRTopology
        >>> topo = CSRTopology.random(6, 4, 0.5, generator=torch.Generator().manual_seed(0))
        >>> f = lambda w, x: FuncCSRLinear.apply(x, w, *topo.kernel_args(), "auto").sum()
        >>> torch.func.grad(f)(torch.randn(topo.nnz), torch.randn(3, 6)).shape == (topo.nnz,)
        True
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
        return _OPS.csr_linear(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


_OPS = torch.ops.torch_sparse_metal
_FORWARD = _OPS.csr_linear.default
_BACKWARD = _OPS.csr_linear_backward.default
