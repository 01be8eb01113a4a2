"""The ``vector_csr_linear`` family's Metal host: compiles ``shaders/vector_csr_linear.metal`` (behind the common
header) with ``torch.mps.compile_shader`` and registers the ``"mps"`` kernels of
``torch_sparse_metal::vector_csr_linear`` and ``torch_sparse_metal::vector_csr_linear_backward``. Imported by
``backends/mps.py``'s loop over ``backends/mps_*.py``.

The forward and ``atomic_free``'s weight gradient run on SIMD-group matrices, per group of ``V`` outputs;
the input gradient walks each source's vectors (docs/metal.md, "Vector layout on simdgroup matrices"). As for
``csr_linear``, :class:`MetalVectorCsrLinear` takes the compile function, so the same dispatch code runs in CI under
the MSL-on-CPU executor with CPU tensors. Nothing here waits on the device or reads index values.

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

from torch_sparse_metal.backends.metal import (
    KERNEL_DTYPES,
    MPS_ERROR_WORDS,
    SIMD_WIDTH,
    MetalHost,
    check_mps_support,
    load_source,
)
from torch_sparse_metal.contract import STRATEGIES, VECTOR_BLOCKS, Strategy
from torch_sparse_metal.ops._vector_csr_linear import check_vector_backward, check_vector_forward

__all__ = ["SHADER_FILES", "STAGES", "MetalVectorCsrLinear", "default", "kernel_names", "register"]

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

    def source(self) -> str:
        """The family's Metal source (our header, then :data:`SHADER_FILES`)."""
        return load_source(SHADER_FILES)

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
        n, n_in, groups, nv, block = check_vector_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)
        y = self._empty((n, groups * block), x)
        if n == 0 or groups == 0:
            return y
        if nv == 0:
            return y.zero_()
        fn, rows = self._vector_kernel("vector_spmm", x.dtype, block)
        rows = min(rows, -(-n // _FORWARD_ROWS))  # a small batch fills fewer SIMD-groups
        fn(y, weight, x.t().contiguous(), col_ptr, src_by_dst, perm, self._errors(x.device, "col_ptr"), n, n_in,
           groups, nv, threads=(groups * SIMD_WIDTH * rows, -(-n // (_FORWARD_ROWS * rows))),
           group_size=(SIMD_WIDTH * rows, 1))
        return y

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor,
                 dst: torch.Tensor, src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor,
                 perm: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_x [N, in], grad_weight [vectors, V])`` with a concrete ``strategy`` of the contract (``"auto"``
        is resolved by the autograd rule before any backend runs). fused_atomic sums grad_w in a nondeterministic
        order (float atomics across batch chunks of 32 rows); atomic_free is deterministic."""
        self._check_device(x)
        sizes = check_vector_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)
        n, n_in, groups, nv, block = sizes
        run = _BACKWARD_KERNELS[Strategy(strategy)]  # every strategy of the contract has an entry (checked below)
        # fused_atomic adds into grad_w with float atomics: a zeroed float32 buffer for every dtype, rounded once at
        # the end; atomic_free's pass 1 writes each element once, in the dtype.
        fused = run is MetalVectorCsrLinear._fused_atomic
        grad_w = torch.zeros((nv, block), dtype=torch.float32 if fused else weight.dtype, device=weight.device) \
            if fused or n == 0 else self._empty((nv, block), weight)
        grad_x = self._empty((n, n_in), x)
        if n == 0 or n_in == 0:
            return grad_x, grad_w.to(weight.dtype)
        if nv == 0:
            return grad_x.zero_(), grad_w.to(weight.dtype)
        run(self, grad_x, grad_w, grad_out, x, weight, (row_ptr, dst), (col_ptr, src_by_dst, perm), sizes)
        return grad_x, grad_w.to(weight.dtype)

    def _by_source(self, stage: str, outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
                   sizes: tuple[int, ...]) -> None:
        """A by-source kernel: a SIMD-group per (source, 32 batch rows), R sources a threadgroup."""
        n, n_in, groups, nv, block = sizes
        fn, rows = self._vector_kernel(stage, inputs[0].dtype, block)
        fn(*outputs, *inputs, n, n_in, groups, nv, threads=(-(-n_in // rows) * SIMD_WIDTH * rows,
                                                             -(-n // _SOURCE_ROWS)),
           group_size=(SIMD_WIDTH * rows, 1))

    def _fused_atomic(self, grad_x, grad_w, grad_out, x, weight, by_source, by_group, sizes) -> None:
        """One pass by source: grad_x owned, grad_w added atomically into the float32 buffer."""
        row_ptr, dst = by_source
        self._by_source("vector_spmm_sddmm_atomic", (grad_x, grad_w),
                        (weight, grad_out, x, row_ptr, dst, self._errors(x.device, "row_ptr")), sizes)

    def _atomic_free(self, grad_x, grad_w, grad_out, x, weight, by_source, by_group, sizes) -> None:
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


def _exhaustive(table: dict[Strategy, Callable[..., None]]) -> dict[Strategy, Callable[..., None]]:
    """``table`` if it maps every strategy of the contract, else an ImportError naming the ones missing."""
    missing = sorted(set(STRATEGIES) - set(table))
    if missing:
        raise ImportError(f"torch_sparse_metal.backends.mps_vector_csr_linear has no Metal kernels for strategies "
                          f"{missing}")
    return table


#: The kernels of each backward strategy.
_BACKWARD_KERNELS = _exhaustive({Strategy.FUSED_ATOMIC: MetalVectorCsrLinear._fused_atomic,
                                 Strategy.ATOMIC_FREE: MetalVectorCsrLinear._atomic_free})

# ------------------------------------------------------------------------------------ MPS registration
_default: MetalVectorCsrLinear | None = None
_registered = False


def default() -> MetalVectorCsrLinear:
    """The process-wide instance on MPS, compiling with ``torch.mps.compile_shader`` on first use; it shares the
    MPS error words of every family (:data:`.metal.MPS_ERROR_WORDS`)."""
    global _default
    if _default is None:
        _default = MetalVectorCsrLinear(lambda src: torch.mps.compile_shader(src), "mps",
                                        check_platform=check_mps_support, error_words=MPS_ERROR_WORDS)
    return _default


def _vector_csr_linear_mps(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    return default().forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)


def _vector_csr_linear_backward_mps(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
    return default().backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)


def register() -> bool:
    """Register the ``"mps"`` kernels of both vector ops; idempotent, harmless without MPS. Returns False when the
    op schemas (the ``_C`` extension) are not loaded."""
    global _registered
    if _registered:
        return True
    ns = torch.ops.torch_sparse_metal
    try:
        ns.vector_csr_linear, ns.vector_csr_linear_backward  # noqa: B018 - raises if the schemas are not defined
    except (AttributeError, RuntimeError):
        return False
    torch.library.register_kernel("torch_sparse_metal::vector_csr_linear", "mps", _vector_csr_linear_mps)
    torch.library.register_kernel("torch_sparse_metal::vector_csr_linear_backward", "mps",
                                  _vector_csr_linear_backward_mps)
    _registered = True
    return True


register()
