"""Functional form of the sparse linear layer."""

from __future__ import annotations

import math
import warnings

import torch

from . import devices
from ._checks import check_strided
from ._torch_private import forward_ad_level, functorch_transforms_active, jit_tracing_state
from .contract import DTYPES
from .ops._csr_linear import CSRLinearFunction, FuncCSRLinear
from .strategy import parse_strategy
from .topology import CSRTopology, check_layout

__all__ = ["sparse_linear", "SUPPORTED_DTYPES"]

_CSR_LINEAR = torch.ops.torch_sparse_metal.csr_linear

#: Value dtypes the kernels implement, per device type (from the op contract, csrc/contract.h).
SUPPORTED_DTYPES = {device: backend.dtypes for device, backend in devices.BACKENDS.items()}
#: Device types with an autocast state to follow (asking about others, such as meta, raises).
_AUTOCAST_DEVICES = frozenset(d for d in SUPPORTED_DTYPES if torch.amp.is_autocast_available(d))


def sparse_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    topology: CSRTopology,
    bias: torch.Tensor | None = None,
    backward: str = "auto",
) -> torch.Tensor:
    """``y = input @ W.T + bias`` with ``W`` sparse: ``W[dst[e], src[e]] = weight[e]``.

    ``input`` is ``(*, in_features)``; returns ``(*, out_features)``. All checks look at shapes, dtypes and
    devices only, so a call never waits on the device.

    Under ``torch.autocast`` it behaves as ``torch.nn.functional.linear``: floating-point arguments other than
    float64 are cast to the autocast dtype of the input's device, and the result has that dtype; gradients flow
    back through the casts to the original (e.g. float32 master) parameters.

    A topology of ``block`` V > 1 runs the vector layout of the same ops (``weight.view(-1, V)`` over
    ``topology.vectors``).

    Example:
        >>> topo = CSRTopology.random(6, 3, 0.5, generator=torch.Generator().manual_seed(0))
        >>> sparse_linear(torch.randn(2, 5, 6), torch.randn(topo.nnz), topo).shape
        torch.Size([2, 5, 3])
    """
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        if _is_proxy(input, weight, bias):  # torch.fx.symbolic_trace: one call_function node of tensors
            _check_topology(topology)
            return _sparse_linear_fx(input, weight, bias, *_kernel_topology(topology).kernel_args(), topology.block,
                                     parse_strategy(backward).value)
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.is_nested:
        raise ValueError("input is a nested tensor, which sparse layers do not take. nn.TransformerEncoder makes one "
                         "in eval mode from a src_key_padding_mask: build an encoder holding SparseLinear layers with "
                         "enable_nested_tensor=False (or set its use_nested_tensor = False; sparsify does this)")
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor):
            check_strided(name, t)
    if input.device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(input.device.type):
        input, weight, bias = _autocast(input.device.type, input, weight, bias)
    jit_tracing = jit_tracing_state() is not None
    if jit_tracing:
        with warnings.catch_warnings():  # sizes compared here are the layer's: constants of the trace, rightly
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            _check_inputs(input, weight, topology, bias)
    else:
        _check_inputs(input, weight, topology, bias)
    strategy = parse_strategy(backward)
    flat = input.dim() == 2
    x = input if flat else input.reshape(math.prod(input.shape[:-1]), topology.in_features)
    if not x.is_contiguous():
        x = x.contiguous()
    if not weight.is_contiguous():  # the kernels read raw memory: a strided or expanded weight is copied once
        weight = weight.contiguous()
    kernel_topology = _kernel_topology(topology)
    weight = weight.view(-1, topology.block) if kernel_topology is not topology else weight  # the vector layout's
    # Three entries to the one rule (ops/_csr_linear.py):
    if torch.compiler.is_compiling() or jit_tracing:
        # torch.compile, torch.export, torch.jit.trace: the op and its registered rule, recorded as one node
        y = _CSR_LINEAR(x, weight, *kernel_topology.kernel_args(), strategy.value)
    elif functorch_transforms_active() or forward_ad_level() >= 0:
        # torch.func or forward-mode dual tensors: the rule with setup_context, a jvp, and the ops' vmap rules
        y = FuncCSRLinear.apply(x, weight, *kernel_topology.kernel_args(), strategy.value)
    else:  # eager: the same rule through a lighter entry
        y = CSRLinearFunction.apply(x, weight, kernel_topology, strategy)
    if not flat:
        y = y.view(*input.shape[:-1], topology.out_features)
    return y if bias is None else y + bias


def _is_proxy(*args: object) -> bool:
    return any(isinstance(a, torch.fx.Proxy) for a in args)


@torch.fx.wrap
def _sparse_linear_fx(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_ptr: torch.Tensor,
                      dst: torch.Tensor, src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor,
                      perm: torch.Tensor, block: int, backward: str) -> torch.Tensor:
    """:func:`sparse_linear` with the topology as the index tensors the kernels take (for ``block`` V > 1, those of
    the topology over vectors): ``torch.fx`` records a call of this as a leaf whose arguments are tensors (the layer's
    buffers) and constants, which a graph module can hold, print and run."""
    kernel_topology = CSRTopology(row_ptr.shape[0] - 1, col_ptr.shape[0] - 1, row_ptr, dst, src, col_ptr, src_by_dst,
                                  perm)
    topology = CSRTopology.from_vectors(kernel_topology, block) if block > 1 else kernel_topology
    return sparse_linear(input, weight, topology, bias, backward)


def _kernel_topology(topology: CSRTopology) -> CSRTopology:
    """The topology whose index arrays the op takes: for block V > 1 the topology over vectors (with a weight
    ``[vectors, V]``), else ``topology`` (with the weight ``[nnz]``)."""
    return topology.vectors if topology.block > 1 else topology


def _autocast(device_type: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Autocast's rule for a lower-precision op (as for ``linear``): every floating-point tensor except float64
    is cast to the autocast dtype."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def _check_topology(topology: CSRTopology) -> None:
    if not isinstance(topology, CSRTopology):
        raise TypeError(f"topology must be a CSRTopology, got {type(topology).__name__}")


def _dtype_advice(input_dtype: torch.dtype, weight_dtype: torch.dtype, device_type: str) -> str:
    """How to make an input and a weight of different dtypes agree: the layer can be cast (``layer.to(dtype)``) only
    to a dtype its kernels run on this device; any other input (integer, bool, float8, ...) is cast to the layer's."""
    if input_dtype in SUPPORTED_DTYPES.get(device_type, DTYPES):  # other devices (meta): the contract's dtypes
        return f"cast one of them (input.to({weight_dtype}), or the layer: layer.to({input_dtype}))"
    return f"cast the input to the layer's dtype: input.to({weight_dtype})"


def _check_inputs(input: torch.Tensor, weight: torch.Tensor, topology: CSRTopology, bias: torch.Tensor | None):
    _check_topology(topology)
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and not (name == "bias" and t is None):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # The kernels take out_features from col_ptr's length; a topology whose fields disagree would change shapes.
    check_layout(topology)
    block = topology.block
    kernel = _kernel_topology(topology)
    rows = (topology.in_features + 1,), (topology.out_features // block + 1,)
    if (kernel.row_ptr.shape, kernel.col_ptr.shape) != rows or kernel.in_features != topology.in_features \
            or kernel.out_features * block != topology.out_features:
        what = "topology's" if block == 1 else f"topology's vectors' (block {block})"
        raise ValueError(f"the {what} row_ptr {tuple(kernel.row_ptr.shape)} and col_ptr {tuple(kernel.col_ptr.shape)} "
                         f"do not fit in_features={topology.in_features} and out_features={topology.out_features}; "
                         "build topologies with CSRTopology's builders")
    if input.dim() == 0:
        raise ValueError("input must have at least 1 dimension (*, in_features), got a 0-d tensor")
    if input.shape[-1] != topology.in_features:
        raise ValueError(
            f"input's last dimension is {input.shape[-1]} but the layer has in_features={topology.in_features}"
        )
    if weight.dim() != 1 or weight.shape[0] != topology.nnz:
        raise ValueError(f"weight must be 1-D with nnz={topology.nnz} values, got shape {tuple(weight.shape)}")
    if input.dtype != weight.dtype:
        raise TypeError(f"input has dtype {input.dtype} but the layer's weight is {weight.dtype}; "
                        f"{_dtype_advice(input.dtype, weight.dtype, input.device.type)}")
    for name, t in (("weight", weight), ("topology", kernel.dst)):
        if t.device != input.device:
            raise RuntimeError(f"input is on {input.device} but the layer's {name} is on {t.device}; "
                               f"move them to one device (e.g. layer.to('{input.device}'))")
    supported = SUPPORTED_DTYPES.get(input.device.type)
    if supported is not None and input.dtype not in supported:  # other devices (meta, ...) fail at dispatch
        names = ", ".join(str(d) for d in supported)
        raise TypeError(f"dtype {input.dtype} is not supported on {input.device.type} (supported: {names})")
    if bias is not None:
        if bias.shape != (topology.out_features,):
            raise ValueError(f"bias must have shape ({topology.out_features},), got {tuple(bias.shape)}")
        if bias.device != input.device or bias.dtype != input.dtype:
            raise RuntimeError(f"bias is {bias.dtype} on {bias.device} but input is {input.dtype} on {input.device}")
