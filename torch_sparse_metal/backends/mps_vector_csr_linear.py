"""The vector layout's Metal host (``SparseLinear(block=V)``, a weight ``[vectors, V]``): compiles
``shaders/vector_csr_linear.metal`` (behind the common header) and runs its kernels for the ``"mps"`` kernels of
``torch_sparse_metal::csr_linear`` and ``csr_linear_backward``, which :class:`~.mps.MetalCsrLinear` (the one
registration, ``backends/mps.py``) sends here by the weight's layout.

The forward and ``atomic_free``'s weight gradient run on SIMD-group matrices, per group of ``V`` outputs;
the input gradient walks each source's vectors (docs/metal.md, "Vector layout on simdgroup matrices").
:class:`MetalVectorCsrLinear` takes the compile function, so the same dispatch code runs in CI under the MSL-on-CPU
executor with CPU tensors. Nothing here waits on the device or reads index values.

Example (on CPU tensors, with the MSL-on-CPU executor as ``compile_shader``, as the tests run it; on a Mac,
``torch.mps.compile_shader`` and ``device_type="mps"``)::

    >>> from torch_sparse_metal import CSRTopology
    >>> metal = MetalVectorCsrLinear(compile_shader, device_type="cpu")
    >>> groups = CSRTopology.from_mask(torch.tensor([[False, True]]))  # input 1 -> group 0 (outputs 0..7)
    >>> y = metal.forward(torch.tensor([[1.0, 3.0]]), torch.full((1, 8), 2.0), *groups.kernel_args())
    >>> y.tolist()
    [[6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_sparse_metal.backends import metal_source
from torch_sparse_metal.backends.metal import KERNEL_DTYPES, SIMD_WIDTH, MetalHost, strategy_methods
from torch_sparse_metal.contract import STRATEGY_SPECS, VECTOR_BLOCKS, Strategy
from torch_sparse_metal.ops._csr_linear import Sizes, check_backward, check_forward

__all__ = ["HOST", "SHADER_FILES", "STAGES", "MetalVectorCsrLinear", "kernel_names"]

#: The family's shader files (compiled behind :data:`.metal.COMMON_HEADER`).
SHADER_FILES = ("vector_csr_linear.metal",)
#: Kernel stages (``<stage>_v<V>_<Metal type>``): the forward per group, atomic_free's pass 1 (grad_w per group) and
#: pass 2 (grad_x per source), and fused_atomic (grad_x per source, grad_w by float atomics).
STAGES = ("vector_spmm", "vector_sddmm", "vector_spmm_t", "vector_spmm_sddmm_atomic")
#: Batch rows a SIMD-group owns in the forward (one 8 x 8 matrix's rows) and in the by-source kernels (its lanes).
_FORWARD_ROWS = 8
_SOURCE_ROWS = SIMD_WIDTH
#: Vectors in one of the by-group kernels' tiles (one 8 x 8 matrix's depth).
_TILE = 8


def kernel_names() -> list[str]:
    """Every kernel the host dispatches, as the shader instantiates them.

    Example:
        >>> kernel_names()[:2]
        ['vector_spmm_v8_float', 'vector_sddmm_v8_float']
    """
    return [f"{stage}_v{v}_{suffix}" for suffix in KERNEL_DTYPES.values() for v in VECTOR_BLOCKS for stage in STAGES]


class MetalVectorCsrLinear(MetalHost):
    """Dispatches the Metal kernels of the vector ops; one compiled library per instance (lazily).

    ``compile_fn``, ``device_type``, ``poison``, ``check_platform`` and ``error_words`` as for
    :class:`.metal.MetalHost`."""

    def __init__(self, compile_fn: Callable[[str], Any], device_type: str = "mps", *, poison: bool | None = None,
                 check_platform: Callable[[], None] | None = None,
                 error_words: dict[torch.device, torch.Tensor] | None = None):
        super().__init__(compile_fn, SHADER_FILES, device_type, poison=poison, check_platform=check_platform,
                         error_words=error_words)

    def source(self, dtype: torch.dtype | None = None) -> str:
        """The vector layout's Metal source (the loader's defines, our header, then :data:`SHADER_FILES`)."""
        return metal_source.load_source(SHADER_FILES, dtypes=None if dtype is None else (dtype,))

    def kernel_names(self, dtype: torch.dtype) -> list[str]:
        """:func:`kernel_names` of ``dtype``."""
        return [name for name in kernel_names() if KERNEL_DTYPES[dtype] in name.split("_")]

    def _vector_kernel(self, stage: str, dtype: torch.dtype, block: int) -> tuple[Any, int]:
        """The kernel ``<stage>_v<block>_<type>`` and its SIMD-groups per threadgroup (TARGET_ROWS within the
        pipeline's thread limit; the threadgroup arrays are sized for TARGET_ROWS, so they hold any fewer)."""
        fn = self.kernel(f"{stage}_v{block}", dtype)
        return fn, self._rows(fn)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor, dst: torch.Tensor,
                src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor, perm: torch.Tensor
                ) -> torch.Tensor:
        """``y [N, groups * V]``, arguments as in the op contract (weight ``[vectors, V]``)."""
        self._check_device(x)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        return self.run_forward(x, weight, index, _vector_sizes(check_forward(x, weight, *index)))

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor,
                 dst: torch.Tensor, src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor,
                 perm: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_x [N, in], grad_weight [vectors, V])`` with a concrete ``strategy`` of the contract (``"auto"``
        is resolved by the autograd rule before any backend runs). fused_atomic sums grad_w in a nondeterministic
        order (float atomics across batch chunks of 32 rows); atomic_free is deterministic."""
        self._check_device(x)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        sizes = _vector_sizes(check_backward(grad_out, x, weight, *index, strategy))
        return self.run_backward(grad_out, x, weight, index, sizes, strategy)

    def _forward_kernels(self, x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...], sizes: Sizes
                         ) -> torch.Tensor:
        """:meth:`run_forward` on the Metal kernels."""
        n, n_in, n_out, nv, block = sizes
        groups = n_out // block
        y = self._empty((n, n_out), x)
        if n == 0 or groups == 0:
            return y
        if nv == 0:
            return y.zero_()
        _, _, _, col_ptr, src_by_dst, perm = index
        fn, rows = self._vector_kernel("vector_spmm", x.dtype, block)
        rows = min(rows, -(-n // _FORWARD_ROWS))  # a small batch fills fewer SIMD-groups
        fn(y, weight, x.t().contiguous(), col_ptr, src_by_dst, perm, self._errors(x.device, "col_ptr"), n, n_in,
           groups, nv, threads=(groups * SIMD_WIDTH * rows, -(-n // (_FORWARD_ROWS * rows))),
           group_size=(SIMD_WIDTH * rows, 1))
        return y

    def _backward_kernels(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          index: tuple[torch.Tensor, ...], sizes: Sizes, strategy: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run_backward` on the Metal kernels."""
        n, n_in, n_out, nv, block = sizes
        sizes = (n, n_in, n_out // block, nv, block)
        row_ptr, dst, _, col_ptr, src_by_dst, perm = index
        strategy = Strategy(strategy)
        # A strategy that adds into grad_w with float atomics (contract.h) takes a zeroed float32 buffer for every
        # dtype, rounded once at the end; the others write each element once, in the dtype.
        accumulates = STRATEGY_SPECS[strategy].accumulates
        grad_w = torch.zeros((nv, block), dtype=torch.float32 if accumulates else weight.dtype, device=weight.device) \
            if accumulates or n == 0 else self._empty((nv, block), weight)
        grad_x = self._empty((n, n_in), x)
        if n == 0 or n_in == 0:
            return grad_x, grad_w.to(weight.dtype)
        if nv == 0:
            return grad_x.zero_(), grad_w.to(weight.dtype)
        _BACKWARD_KERNELS[strategy](self, grad_x, grad_w, grad_out, x, weight, (row_ptr, dst),
                                    (col_ptr, src_by_dst, perm), sizes)
        return grad_x, grad_w.to(weight.dtype)

    def _by_source(self, stage: str, outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
                   sizes: tuple[int, ...]) -> None:
        """A by-source kernel: a SIMD-group per (source, 32 batch rows), R sources a threadgroup."""
        n, n_in, groups, nv, block = sizes
        fn, rows = self._vector_kernel(stage, inputs[0].dtype, block)
        fn(*outputs, *inputs, n, n_in, groups, nv, threads=(-(-n_in // rows) * SIMD_WIDTH * rows,
                                                             -(-n // _SOURCE_ROWS)),
           group_size=(SIMD_WIDTH * rows, 1))

    # ---------------------------------------------- each strategy's kernels: a method named after it (strategy_methods)
    def fused_atomic(self, grad_x, grad_w, grad_out, x, weight, by_source, by_group, sizes) -> None:
        """One pass by source: grad_x owned, grad_w added atomically into the float32 buffer."""
        row_ptr, dst = by_source
        self._by_source("vector_spmm_sddmm_atomic", (grad_x, grad_w),
                        (weight, grad_out, x, row_ptr, dst, self._errors(x.device, "row_ptr")), sizes)

    def atomic_free(self, grad_x, grad_w, grad_out, x, weight, by_source, by_group, sizes) -> None:
        """Two passes with exclusive ownership: grad_w per group (SIMD-group matrices, a threadgroup per group),
        then grad_x per source."""
        n, n_in, groups, nv, block = sizes
        col_ptr, src_by_dst, perm = by_group
        if groups:
            fn, rows = self._vector_kernel("vector_sddmm", x.dtype, block)
            rows = min(rows, -(-nv // (groups * _TILE)))  # about one tile of eight vectors per SIMD-group
            fn(grad_w, grad_out, x.t().contiguous(), col_ptr, src_by_dst, perm, self._errors(x.device, "col_ptr"),
               n, n_in, groups, nv, threads=groups * SIMD_WIDTH * rows, group_size=SIMD_WIDTH * rows)
        row_ptr, dst = by_source
        self._by_source("vector_spmm_t", (grad_x,), (weight, grad_out, row_ptr, dst,
                                                     self._errors(x.device, "row_ptr")), sizes)


def _vector_sizes(sizes: Sizes) -> Sizes:
    """``sizes`` of a call in the vector layout (this host has no kernels for a weight ``[nnz]``)."""
    if sizes.block == 1:
        raise ValueError("the vector layout's Metal host takes a weight [vectors, V]; a weight [nnz] is the "
                         "unstructured layout's (MetalCsrLinear)")
    return sizes


#: The kernels of each backward strategy.
_BACKWARD_KERNELS = strategy_methods(MetalVectorCsrLinear)
#: This layout's host, as :func:`.mps.layout_hosts` finds it.
HOST = MetalVectorCsrLinear
