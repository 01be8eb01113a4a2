"""The ``csr_linear`` op family's Python side (schemas and C++ checks: ``csrc/csr_linear.cpp``; kernels:
``csrc/cpu/`` and ``csrc/cuda/``, the ops in ``csr_linear_cpu.cpp`` / ``csr_linear_cuda.cu`` and a file per layout,
``shaders/*.metal`` with :mod:`torch_sparse_metal.backends.mps`): the typed wrappers, the Python-boundary argument
checks, the fake kernels, the vmap rules and the one autograd rule.

The ops take either layout of a layer, told apart by the weight's rank: unstructured, a weight ``[nnz]`` over the
topology's edges; vector (``SparseLinear(block=V)``, V in ``contract.VECTOR_BLOCKS``), a weight ``[vectors, V]``
over the topology over vectors (``CSRTopology.vectors``: a layer ``in_features -> groups`` whose ``dst`` is a
vector's group ``g``, feeding outputs ``g*V .. g*V+V-1``), a view of the layer's 1-D weight (a vector's ``V``
values are consecutive in the element-level edge order).

The autograd rule is shared by every backend: it picks the backward strategy and calls the ``csr_linear_backward``
op, whose kernels the backends supply. Under ``create_graph=True`` it builds the gradients from differentiable ops
instead (the forward op over the transposed layer, and a sampled product; for the vector layout over its element-level
edges, :func:`torch_sparse_metal.topology.element_index`, which compute the same sums edge by edge), so second- and
higher-order gradients are exact.

The rule has three entries (docs/architecture.md, "Why the autograd rule has three entries", says what each
serves and what the others would cost). It is registered for the op (the kernel ``torch.library.register_autograd``
makes, inside ``_op_autograd``), so calling ``torch.ops.torch_sparse_metal.csr_linear`` carries gradients:
``sparse_linear`` calls the op under ``torch.compile`` and ``torch.jit.trace``. Eager calls of ``sparse_linear``
(``SparseLinear``) enter the same rule through :class:`CSRLinearFunction`, which runs the op below the Autograd key
and so skips the dispatcher's call into a Python kernel and torch.library's generic wrapper.
With tuning on (opt-in, :mod:`torch_sparse_metal.tuning`), it is also where the forward's kernel variants are tuned,
on devices whose backend declares some (MPS): at the first eager forward of a size bucket, on real tensors.

Forward mode (``torch.func.jvp``, ``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``) goes through
:class:`FuncCSRLinear`, whose ``jvp`` uses that the op is bilinear in ``(x, weight)``. torch.library's rule has no
forward mode, and its generated Function has no ``setup_context``, which ``torch.func`` transforms need: the
gradients built from differentiable ops therefore call :class:`FuncCSRLinear` too, and the op itself sends dual
tensors there and refuses ``torch.func``'s differentiating transforms (``sparse_linear`` enters FuncCSRLinear
before the op for them).

The vmap rules serve ``torch.vmap`` and the ``torch.func`` transforms built on it (``jacrev``, per-sample
gradients). A batch of inputs over the same weights is one call on the stacked rows; anything batched per sample
that the kernels cannot merge (the weights, or the weight gradient, which is a sum over rows) is one call per
sample. The topology cannot be batched: each call has one layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _autotune, tuning
from .._checks import check_index, check_size, check_strided, check_tensor_beside, check_values
from .._torch_private import (
    AutoDispatchBelowAutograd,
    AutogradInfo,
    TransformType,
    any_requires_grad,
    forward_ad_level,
    forward_grad_enabled,
    functorch_transforms_active,
    is_fake,
    is_functorch_wrapped_tensor,
    make_autograd_impl,
    peek_interpreter_stack,
    retrieve_all_functorch_interpreters,
)
from ..contract import DTYPES, Strategy, layout_block, layout_of
from ..strategy import DETERMINISTIC, check_deterministic, parse_strategy, resolve_strategy
from ..topology import CSRTopology, element_index

__all__ = ["CSRLinearFunction", "FuncCSRLinear", "Sizes", "check_backward", "check_backward_argument", "check_forward",
           "csr_linear_grads",
           "check_strategy", "csr_linear", "csr_linear_backward"]

_OPS = torch.ops.torch_sparse_metal
_FORWARD = _OPS.csr_linear.default
_BACKWARD = _OPS.csr_linear_backward.default


# ------------------------------------------------------------------------------------------------ wrappers
def csr_linear(x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology, backward: str = "auto") -> torch.Tensor:
    """``y[n, o] = sum_e weight[e] * x[n, src[e]]`` over the edges into ``o``; differentiable.

    ``x`` is ``[batch, in_features]``; returns ``[batch, out_features]``. With a weight ``[vectors, V]`` and
    ``topology`` a topology over vectors (``in_features -> groups``), the vector layout: ``y[n, g*V + l] = sum_j
    weight[j, l] * x[n, src[j]]`` over the vectors ``j`` of group ``g``, ``[batch, groups * V]``.

    Example:
        >>> topo = CSRTopology.random(8, 4, 0.5, generator=torch.Generator().manual_seed(0))
        >>> csr_linear(torch.randn(3, 8), torch.randn(topo.nnz), topo).shape
        torch.Size([3, 4])
        >>> csr_linear(torch.randn(3, 8), torch.randn(topo.nnz, 16), topo).shape  # 4 groups of 16 outputs
        torch.Size([3, 64])
    """
    return torch.ops.torch_sparse_metal.csr_linear(x, weight, *topology.kernel_args(), backward)


def csr_linear_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, topology: CSRTopology, strategy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of :func:`csr_linear` with a concrete strategy (not ``"auto"``)."""
    return torch.ops.torch_sparse_metal.csr_linear_backward(grad_out, x, weight, *topology.kernel_args(), strategy)


# ------------------------------------------------------------------------------ Python-boundary checks
# The Metal host code and the fake kernels run these (the C++ backends run csrc/csr_linear_checks.cpp).
class Sizes(NamedTuple):
    """A call's sizes: ``connections`` are the edges (unstructured) or vectors, ``block`` 1 or V, so that the index
    arrays have ``out_features // block`` rows of ``col_ptr``."""

    batch: int
    in_features: int
    out_features: int
    connections: int
    block: int


def check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm) -> Sizes:
    """Checks of ``csr_linear``'s arguments, either layout; returns the call's :class:`Sizes`."""
    _check_x(x)
    block = _check_weight(x, weight)
    n, n_in = x.shape
    connections = weight.shape[0]
    for name, value in (("batch", n), ("in_features", n_in), ("nnz" if block == 1 else "vectors", connections)):
        check_size(name, value)
    _check_weight_fits(weight, block, dst, src, src_by_dst, perm)
    check_index("row_ptr", row_ptr, x, (x.shape[1] + 1,))
    check_index("dst", dst, x, (connections,))
    check_index("src", src, x, (connections,))
    rows = _check_by_destination(x, connections, col_ptr, src_by_dst, perm)
    check_size("out_features", rows * block)
    return Sizes(n, n_in, rows * block, connections, block)


def check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy: str) -> Sizes:
    """Checks of ``csr_linear_backward``'s arguments, either layout; returns the call's :class:`Sizes`."""
    check_strategy(strategy)
    sizes = check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
    check_values("grad_out", grad_out, x, ndim=2)
    if grad_out.shape[0] != sizes.batch:
        raise ValueError(f"grad_out has {grad_out.shape[0]} rows but x has {sizes.batch}")
    if grad_out.shape[1] != sizes.out_features:
        raise ValueError(f"grad_out has {grad_out.shape[1]} columns but the topology has out_features="
                         f"{sizes.out_features}")
    return sizes


def check_strategy(strategy: str) -> None:
    """A concrete strategy of the contract (``auto`` is resolved by the autograd rule before a kernel runs)."""
    if strategy == Strategy.AUTO.value or strategy not in Strategy.__members__.values():
        concrete = ", ".join(repr(s.value) for s in Strategy if s is not Strategy.AUTO)
        raise ValueError(f"unknown backward strategy {strategy!r}; expected one of {concrete}, lower case ('auto' is "
                         "resolved by the autograd rule before a kernel is called)")


def check_backward_argument(backward: str) -> None:
    """The forward op's ``backward``: ``auto`` or a concrete strategy of the contract. The forward kernels do not read
    it (the autograd rule does, when a gradient is needed), so every forward checks it first: a value no backward
    could take is refused with or without gradients (the C++ forwards' ``check_backward_argument``, contract.h)."""
    if backward not in Strategy.__members__.values():
        concrete = ", ".join(repr(s.value) for s in Strategy if s is not Strategy.AUTO)
        raise ValueError(f"unknown backward strategy {backward!r}; expected 'auto' or one of {concrete}, lower case")


def _check_x(x) -> None:
    """``x`` is a 2-D dense contiguous tensor of a value dtype of the contract."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    check_strided("x", x)
    if x.dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"x has dtype {x.dtype}; the kernels support {names}")
    check_values("x", x, x, ndim=2)


def _check_weight(x, weight) -> int:
    """``weight`` of a layout of the contract beside ``x`` (``[nnz]``: unstructured, ``[vectors, V]``: vector);
    returns its block."""
    check_tensor_beside("weight", weight, x)
    layout = layout_of(weight)
    check_values("weight", weight, x, ndim=layout.rank)
    return layout_block(weight)


def _check_weight_fits(weight, block: int, *per_connection) -> None:
    """A weight whose length differs from a topology whose per-connection arrays (``dst``, ``src``, ``src_by_dst``,
    ``perm``) agree with each other is the weight's fault, named here; an array that disagrees with the others is
    named by the index checks."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in per_connection):
        return
    edges = per_connection[0].shape[0]
    if any(t.shape[0] != edges for t in per_connection) or weight.shape[0] == edges:
        return
    held, connection, entry = ("vectors", "vectors", "row") if block > 1 else ("values", "edges", "value")
    raise ValueError(f"weight has shape {tuple(weight.shape)}, {weight.shape[0]} {held}, but the topology has {edges} "
                     f"{connection} (dst, src, src_by_dst and perm have {edges} elements): the weight needs one "
                     f"{entry} per connection of the topology")


def _check_by_destination(x, connections, col_ptr, src_by_dst, perm) -> int:
    check_index("col_ptr", col_ptr, x)
    if col_ptr.shape[0] < 1:
        raise ValueError("col_ptr must have out_features + 1 >= 1 entries, got 0")
    rows = col_ptr.shape[0] - 1
    check_size("out_features", rows)
    check_index("src_by_dst", src_by_dst, x, (connections,))
    check_index("perm", perm, x, (connections,))
    if connections and not (x.shape[1] and rows):  # the kernels' index guards rely on both ranges being non-empty
        raise ValueError(f"{connections} edges but in_features={x.shape[1]} and out_features={rows}; a layer with no "
                         "inputs or no outputs has no edges")
    return rows


# ------------------------------------------------------------------------------------ fake (meta) kernels
# Output shapes from argument sizes, never from tensor values.
@torch.library.register_fake("torch_sparse_metal::csr_linear")
def _csr_linear_fake(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    check_backward_argument(backward)
    sizes = check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
    return x.new_empty((sizes.batch, sizes.out_features))


@torch.library.register_fake("torch_sparse_metal::csr_linear_backward")
def _csr_linear_backward_fake(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
    check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# --------------------------------------------------------------------------------------------- vmap rules
def _at(t: torch.Tensor | None, dim: int | None, i: int) -> torch.Tensor | None:
    """Sample ``i`` of ``t`` along its vmapped dimension (``t`` itself when it is not batched)."""
    return t if dim is None or t is None else t.select(dim, i)


def _check_topology_unbatched(in_dims: tuple, first_index: int) -> None:
    if any(d is not None for d in in_dims[first_index:]):
        raise NotImplementedError("torch_sparse_metal: vmap over the topology (the index tensors) is not supported; "
                                  "vmap over the inputs or weights of one layer instead")


def _size(args: tuple, in_dims: tuple) -> int:
    return next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)


def _forward_vmap_rule(op):
    """The vmap rule of the forward op ``op(x, weight, <6 index arrays>, backward)``, either layout."""
    def rule(info, in_dims, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
        _check_topology_unbatched(in_dims, 2)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        x_dim, w_dim = in_dims[0], in_dims[1]
        if w_dim is None:  # one layer, more rows: stack the samples' rows
            xb = x.movedim(x_dim, 0)
            rows = xb.reshape(-1, xb.shape[-1]).contiguous()
            y = op(rows, weight, *index, backward)
            return y.view(*xb.shape[:-1], y.shape[-1]), 0
        n = _size((x, weight), (x_dim, w_dim))
        return torch.stack([op(_at(x, x_dim, i).contiguous(), _at(weight, w_dim, i).contiguous(), *index, backward)
                            for i in range(n)]), 0
    return rule


def _backward_vmap_rule(op):
    """The vmap rule of a backward op ``op(grad_out, x, weight, <6 index arrays>, strategy)``: one call a sample."""
    def rule(info, in_dims, grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
        _check_topology_unbatched(in_dims, 3)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        n = _size((grad_out, x, weight), in_dims[:3])
        outs = [op(_at(grad_out, in_dims[0], i).contiguous(), _at(x, in_dims[1], i).contiguous(),
                   _at(weight, in_dims[2], i).contiguous(), *index, strategy) for i in range(n)]
        return (torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])), (0, 0)
    return rule


torch.library.register_vmap("torch_sparse_metal::csr_linear", _forward_vmap_rule(_OPS.csr_linear))
torch.library.register_vmap("torch_sparse_metal::csr_linear_backward", _backward_vmap_rule(_OPS.csr_linear_backward))


# ------------------------------------------------------------------------------------------ autograd rule
def _setup_context(ctx, inputs, output):
    x, weight, *index, backward = inputs
    ctx.save_for_backward(x, weight)
    ctx.index = tuple(index)  # the topology's index tensors: never modified in place (CSRTopology is immutable)
    ctx.backward = parse_strategy(backward)
    ctx.block = layout_block(weight)
    ctx.out_features = (index[3].shape[0] - 1) * ctx.block


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = csr_linear_grads(grad_out, x, weight, ctx.index, ctx.backward, ctx.out_features,
                                      ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    return (grad_x, grad_w) + (None,) * 7


def csr_linear_grads(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...],
                     backward: Strategy, out_features: int, need_x: bool, need_w: bool
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_x, grad_w)`` of ``csr_linear(x, weight, *index)`` (each ``None`` where not needed): the one autograd
    rule, for the Functions that enter it (here, and the fused product of ``delta_product.py``). ``backward`` (a
    parsed strategy, ``auto`` included) is resolved here; under ``create_graph=True`` or forward mode the gradients
    are built from differentiable ops, else the ``csr_linear_backward`` kernel runs."""
    block = layout_block(weight)
    grad_x = grad_w = None
    if need_x or need_w:
        grad_out = grad_out.contiguous()
        tracked = grad_out.requires_grad or x.requires_grad or weight.requires_grad
        differentiable = (torch.is_grad_enabled() and tracked) or _forward_mode_active()

        def measure(s: Strategy) -> object:  # a candidate backward, for tuning "auto" on real tensors
            return _OPS.csr_linear_backward(grad_out, x, weight, *index, s.value)

        tunable = _autotune.enabled and not differentiable and _tunable(x, weight)
        strategy = resolve_strategy(backward, x.device, x.shape[1], out_features, weight.shape[0], x.shape[0],
                                    dtype=x.dtype, measure=measure if tunable else None, block=block)
        if differentiable:
            # create_graph=True or forward mode over this backward: gradients that are themselves differentiable
            # (gradient penalties, Hessian-vector products, hessian), built from ops that carry autograd, instead
            # of the backward kernels, which do not
            grad_x, grad_w = _differentiable_backward(grad_out, x, weight, index, strategy.value, need_x, need_w)
        else:
            check_deterministic(strategy, x.device)  # torch's contract: raise (or warn) before a nondeterministic sum
            grad_x, grad_w = _BACKWARD(grad_out, x, weight, *index, strategy.value)
    return grad_x if need_x else None, grad_w if need_w else None


def _forward_mode_active() -> bool:
    """Whether forward-mode AD may push tangents through the ops called here: inside a dual level of
    ``torch.autograd.forward_ad``, or under a ``torch.func`` jvp (``jvp``, ``jacfwd``, ``hessian``) at any level.
    ``requires_grad`` does not show tangents, so the backward asks this before choosing its kernels."""
    if forward_ad_level() >= 0:
        return True
    return functorch_transforms_active() and any(
        interpreter.key() == TransformType.Jvp for interpreter in retrieve_all_functorch_interpreters())


def _tunable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call on these tensors may be timed to tune a bucket: real tensors with work to time."""
    return _real(x) and x.shape[0] > 0 and weight.shape[0] > 0  # sizes last: symbolic while tracing


def _real(t: torch.Tensor) -> bool:
    """Tensors that can be timed: not meta, fake (torch.compile tracing) or functorch-wrapped, and not inside a
    CUDA graph capture (timing synchronises, which a capture forbids)."""
    return (t.device.type != "meta" and not torch.compiler.is_compiling() and not is_fake(t)
            and not is_functorch_wrapped_tensor(t)
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
    product below. Both are Functions with reverse and forward rules, so derivatives of any order and mode exist.
    A layout over blocks of V outputs (the vector layout) takes its element-level edges' (a connection's V values
    are V consecutive edges)."""
    if layout_block(weight) > 1:
        edges = element_index(index, layout_block(weight))
        grad_x, grad_w = _differentiable_backward(grad_out, x, weight.reshape(-1), edges, strategy, need_x, need_w)
        return grad_x, None if grad_w is None else grad_w.view(weight.shape)
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
                                        DETERMINISTIC.value)[1]

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
    return forward_ad_level() >= 0 and forward_grad_enabled()


# torch.library.register_autograd's kernel, for the reverse rule. Its generated Function has no forward mode and
# would drop tangents silently (dual inputs need no grad): dual tensors enter FuncCSRLinear instead. Nor can it
# (or any Function) be applied here inside a torch.func grad or jvp, which reach this kernel after their
# transform has begun: those are refused, and sparse_linear enters FuncCSRLinear before the op for them.
_library_rule = make_autograd_impl(torch.ops.torch_sparse_metal.csr_linear.default,
                                   AutogradInfo(_backward, _setup_context))


def _refuse_differentiating_transforms(args: tuple) -> None:
    """Raise under a torch.func transform that differentiates: torch.library's rule of the raw op cannot run under
    them, and a tangent would be lost."""
    top = peek_interpreter_stack()
    if top is not None and _func_transform_differentiates(top.key(), args):
        raise NotImplementedError(
            "torch_sparse_metal: torch.func transforms that differentiate (grad, vjp, jacrev, jvp, jacfwd, hessian) "
            "are not supported through the raw op torch.ops.torch_sparse_metal.csr_linear (torch.library's rule "
            "cannot run under them, and a tangent would be lost); call torch_sparse_metal.sparse_linear or "
            "SparseLinear instead, which carry the same rule in a form these transforms accept")


def _check_layouts(args: tuple) -> None:
    """The raw ops' tensor arguments are dense, checked where every call of them enters (their Autograd kernels):
    a sparse tensor would otherwise reach the dispatcher, which has no kernel for its layout."""
    for name, t in zip(("x", "weight"), args):
        if isinstance(t, torch.Tensor):
            check_strided(name, t)


def _op_autograd(keyset, *args):
    _check_layouts(args)
    _refuse_differentiating_transforms(args)
    if _eager_tangents():
        return FuncCSRLinear.apply(*args)
    return _library_rule(keyset, *args)


def _func_transform_differentiates(key: TransformType, args: tuple) -> bool:
    if key == TransformType.Jvp:  # tangents are not visible here: refused whether or not there are any
        return True
    return key == TransformType.Grad and torch.is_grad_enabled() and any_requires_grad(*args)


_LIB = torch.library.Library("torch_sparse_metal", "IMPL")
_LIB.impl("csr_linear", _op_autograd, "Autograd", with_keyset=True)


class CSRLinearFunction(torch.autograd.Function):
    """``csr_linear`` with the rule above, entered directly: the forward runs the op below the autograd key.
    Takes the topology whose index arrays the op takes as one argument (for the vector layout, the topology over
    vectors): ``apply`` inspects every argument, so it is handed one object instead of six index tensors.

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
        with AutoDispatchBelowAutograd():
            # opt-in: time the forward's variants (eager calls only; they are the unstructured kernels')
            if _autotune.enabled and weight.dim() == 1 and _tunable(x, weight):
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

