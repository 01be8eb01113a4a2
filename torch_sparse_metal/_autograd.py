"""The one autograd rule of ``csr_linear``, shared by every backend: it picks the backward strategy and
calls the ``csr_linear_backward`` op, whose kernels the backends supply. Under ``create_graph=True`` it builds
the gradients from differentiable ops instead (the forward op over the transposed layer, and a sampled product),
so second- and higher-order gradients are exact.

The rule is registered for the op (the kernel ``torch.library.register_autograd`` makes, inside
``_op_autograd``), so calling ``torch.ops.torch_sparse_metal.csr_linear`` carries gradients. ``SparseLinear``
enters the same rule through :class:`CSRLinearFunction` instead: torch.library's generic Python wrapper costs
about 90 µs of host time per call, which measurably slowed training steps of small layers (docs/training.md); the
Function costs a few.
It is also where the forward's kernel variants are tuned (:mod:`torch_sparse_metal.tuning`), on devices whose
backend declares some (MPS): at the first eager forward of a size bucket, on real tensors.

Forward mode (``torch.func.jvp``, ``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``) goes through
:class:`FuncCSRLinear`, whose ``jvp`` uses that the op is bilinear in ``(x, weight)``. torch.library's rule has no
forward mode, and its generated Function has no ``setup_context``, which ``torch.func`` transforms need: the
gradients built from differentiable ops therefore call :class:`FuncCSRLinear` too, and the op itself sends dual
tensors there and refuses ``torch.func``'s differentiating transforms (``sparse_linear`` enters FuncCSRLinear
before the op for them).
"""

from __future__ import annotations

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad

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
        tracked = grad_out.requires_grad or x.requires_grad or weight.requires_grad
        differentiable = (torch.is_grad_enabled() and tracked) or _forward_mode_active()

        def measure(s: Strategy) -> object:  # a candidate backward, for tuning "auto" on real tensors
            return _OPS.csr_linear_backward(grad_out, x, weight, *index, s.value)

        tunable = not differentiable and _tunable(x, weight)
        strategy = resolve_strategy(ctx.backward, x.device, x.shape[1], ctx.out_features, weight.shape[0], x.shape[0],
                                    dtype=x.dtype, measure=measure if tunable else None)
        if differentiable:
            # create_graph=True or forward mode over this backward: gradients that are themselves differentiable
            # (gradient penalties, Hessian-vector products, hessian), built from ops that carry autograd, instead
            # of the backward kernels, which do not
            grad_x, grad_w = _differentiable_backward(grad_out, x, weight, index, strategy.value, need_x, need_w)
        else:
            check_deterministic(strategy, x.device)  # torch's contract: raise (or warn) before a nondeterministic sum
            grad_x, grad_w = _BACKWARD(grad_out, x, weight, *index, strategy.value)
    return (grad_x if need_x else None, grad_w if need_w else None) + (None,) * 7


def _forward_mode_active() -> bool:
    """Whether forward-mode AD may push tangents through the ops called here: inside a dual level of
    ``torch.autograd.forward_ad``, or under a ``torch.func`` jvp (``jvp``, ``jacfwd``, ``hessian``) at any level.
    ``requires_grad`` does not show tangents, so the backward asks this before choosing its kernels."""
    if forward_ad._current_level >= 0:
        return True
    return torch._C._are_functorch_transforms_active() and any(
        interpreter.key() == TransformType.Jvp for interpreter in retrieve_all_functorch_interpreters())


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
    product below. Both are Functions with reverse and forward rules, so derivatives of any order and mode exist."""
    grad_x = grad_w = None
    if need_x:
        weight_t = weight.index_select(0, index[5].long())
        grad_x = _linear(grad_out, weight_t, _transposed(index), strategy)
    if need_w:
        grad_w = _sampled_product(grad_out, x, index, strategy)
    return grad_x, grad_w


class _SampledProduct(torch.autograd.Function):
    """``g[e] = sum_n grad_out[n, dst[e]] * x[n, src[e]]``: the weight gradient as a differentiable function.

    Its gradients are sparse products of the same layer: for ``gg`` (the gradient of ``g``), ``d grad_out =
    x @ W(gg).T`` (the forward op with edge values ``gg``) and ``d x = grad_out @ W(gg)`` (the forward op over the
    transposed layer). It is bilinear in ``(grad_out, x)``, so its tangent is ``g(d grad_out, x) + g(grad_out, dx)``."""

    generate_vmap_rule = True

    # The index tensors are separate arguments: torch.func pairs tangents and vmap dimensions with the arguments.
    @staticmethod
    def forward(grad_out, x, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
        values = grad_out.new_zeros(dst.shape[0])  # grad_x of the call is not used
        return _OPS.csr_linear_backward(grad_out, x, values, row_ptr, dst, src, col_ptr, src_by_dst, perm,
                                        Strategy.ATOMIC_FREE.value)[1]

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, *index, strategy = inputs
        ctx.save_for_backward(grad_out, x)
        ctx.save_for_forward(grad_out, x)
        ctx.index, ctx.strategy = tuple(index), strategy

    @staticmethod
    def jvp(ctx, grad_out_t, x_t, *_index_and_strategy_t):
        grad_out, x = ctx.saved_tensors
        terms = [_sampled_product(a.contiguous(), b.contiguous(), ctx.index, ctx.strategy)
                 for a, b in ((grad_out_t, x), (grad_out, x_t)) if a is not None and b is not None]
        return _sum(terms) if terms else grad_out.new_zeros(ctx.index[1].shape[0])

    @staticmethod
    def backward(ctx, gg):
        grad_out, x = ctx.saved_tensors
        index, strategy = ctx.index, ctx.strategy
        gg = gg.contiguous()
        d_grad_out = d_x = None
        if ctx.needs_input_grad[0]:
            d_grad_out = _linear(x, gg, index, strategy)
        if ctx.needs_input_grad[1]:
            d_x = _linear(grad_out, gg.index_select(0, index[5].long()), _transposed(index), strategy)
        return d_grad_out, d_x, *(None,) * 7


def _sampled_product(grad_out: torch.Tensor, x: torch.Tensor, index: tuple[torch.Tensor, ...],
                     strategy: str) -> torch.Tensor:
    return _SampledProduct.apply(grad_out, x, *index, strategy)


def _eager_tangents() -> bool:
    """Whether dual tensors of ``torch.autograd.forward_ad`` may reach an op called here (a Function's forward runs
    with forward gradients off)."""
    return forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled()


# torch.library.register_autograd's kernel, for the reverse rule. Its generated Function has no forward mode and
# would drop tangents silently (dual inputs need no grad): dual tensors enter FuncCSRLinear instead. Nor can it
# (or any Function) be applied here inside a torch.func grad or jvp, which reach this kernel after their
# transform has begun: those are refused, and sparse_linear enters FuncCSRLinear before the op for them.
_library_rule = torch._library.autograd.make_autograd_impl(
    torch.ops.torch_sparse_metal.csr_linear.default, torch._library.autograd.Info(_backward, _setup_context))


def _op_autograd(keyset, *args):
    top = torch._C._functorch.peek_interpreter_stack()
    if top is not None and _func_transform_differentiates(top.key(), args):
        raise NotImplementedError(
            "torch_sparse_metal: torch.func transforms that differentiate (grad, vjp, jacrev, jvp, jacfwd, hessian) "
            "are not supported through the raw op torch.ops.torch_sparse_metal.csr_linear (torch.library's rule "
            "cannot run under them, and a tangent would be lost); call torch_sparse_metal.sparse_linear or "
            "SparseLinear instead, which carry the same rule in a form these transforms accept")
    if _eager_tangents():
        return FuncCSRLinear.apply(*args)
    return _library_rule(keyset, *args)


def _func_transform_differentiates(key: TransformType, args: tuple) -> bool:
    if key == TransformType.Jvp:  # tangents are not visible here: refused whether or not there are any
        return True
    return key == TransformType.Grad and torch.is_grad_enabled() and torch._C._any_requires_grad(*args)


_LIB = torch.library.Library("torch_sparse_metal", "IMPL")
_LIB.impl("csr_linear", _op_autograd, "Autograd", with_keyset=True)


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


def _func_setup_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.save_for_forward(inputs[0], inputs[1])


def _jvp(ctx, x_t, w_t, *_index_and_strategy_t):
    """The forward-mode rule: ``csr_linear`` is bilinear in ``(x, weight)``, so its tangent is
    ``csr_linear(dx, weight) + csr_linear(x, dweight)``, each term itself differentiable in every mode."""
    x, weight = ctx.saved_tensors
    strategy = ctx.backward.value
    terms = [_linear(a.contiguous(), b.contiguous(), ctx.index, strategy)
             for a, b in ((x_t, weight), (x, w_t)) if a is not None and b is not None]
    return _sum(terms) if terms else x.new_zeros(x.shape[0], ctx.out_features)


def _sum(terms: list[torch.Tensor]) -> torch.Tensor:
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


class FuncCSRLinear(torch.autograd.Function):
    """The same rule in the form ``torch.func`` transforms need (``setup_context``; vmap through the ops' vmap
    rules), with a forward-mode rule (``jvp``): ``sparse_linear`` enters it when a transform (``grad``, ``vjp``,
    ``jacrev``, ``jvp``, ``jacfwd``, ``hessian``, ``vmap``) or a ``torch.autograd.forward_ad`` dual level is active.

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

    setup_context = staticmethod(_func_setup_context)
    backward = staticmethod(_backward)
    jvp = staticmethod(_jvp)


def _linear(x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...], strategy: str) -> torch.Tensor:
    """``csr_linear`` as a differentiable function under every transform and mode (through :class:`FuncCSRLinear`)."""
    return FuncCSRLinear.apply(x, weight, *index, strategy)


_OPS = torch.ops.torch_sparse_metal
_FORWARD = _OPS.csr_linear.default
_BACKWARD = _OPS.csr_linear_backward.default
