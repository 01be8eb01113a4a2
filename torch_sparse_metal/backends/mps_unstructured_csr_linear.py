"""The unstructured layout's Metal host (a weight of ``E`` edge values): compiles ``shaders/csr_linear.metal``
(behind the common header) and runs its kernels for the ``"mps"`` kernels of ``torch_sparse_metal::csr_linear`` and
``csr_linear_backward``, which ``backends/mps.py`` registers. The machinery every host shares is :mod:`.metal`.

All dispatch logic lives in :class:`MetalUnstructuredCsrLinear`, parameterised by the compile function, so the very same
code (argument order, scalar widths, grid and threadgroup sizes) runs in CI with CPU tensors under the
MSL-on-CPU executor (:func:`tsm_dev.msl.compile_shader`). Nothing here waits on the
device: checks look at metadata only and kernels are encoded on the current MPS stream.

Example (on CPU tensors, with the MSL-on-CPU executor as ``compile_shader``, as the tests run it; on a Mac,
``torch.mps.compile_shader`` and ``device_type="mps"``)::

    >>> metal = MetalUnstructuredCsrLinear(compile_shader, device_type="cpu")
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> # one edge: input 1 -> output 0, weight 2
    >>> y = metal.forward(torch.tensor([[1.0, 3.0]]), torch.tensor([2.0]), i32(0, 0, 1), i32(0), i32(1),
    ...                   i32(0, 1), i32(1), i32(0))
    >>> y.tolist()
    [[6.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_sparse_metal import tuning
from torch_sparse_metal.backends import metal_source
from torch_sparse_metal.backends.metal import KERNEL_DTYPES, SIMD_WIDTH, MetalHost, strategy_methods
from torch_sparse_metal.contract import Strategy
from torch_sparse_metal.ops._csr_linear import Sizes, check_backward, check_forward

__all__ = ["BLOCK_ELEMS", "CONSTANTS", "PLAIN_STAGES", "SHADER_FILES", "SPMM_KERNELS", "TILED_STAGES", "TILE_WIDTH",
           "VALUES_PER_LANE", "VARIANTS", "VARIANT_OPS", "WINDOW_ROWS", "HOST", "MetalUnstructuredCsrLinear",
           "kernel_names", "load_source", "values_per_lane"]

#: The csr_linear family's shader files (compiled behind :data:`.metal.COMMON_HEADER`).
SHADER_FILES = ("csr_linear.metal",)
#: Batch values per lane that the tiled kernels are instantiated for (``_p<P>``); a SIMD-group covers 32 * P
#: consecutive batch columns. The tuner times each (:data:`VARIANTS`); the static rule is :func:`values_per_lane`.
VALUES_PER_LANE = (1, 4)
#: The SpMM kernels (the forward and atomic_free pass 2): ``"direct"`` reads every gathered segment from device
#: memory (``spmm``, the static rule), ``"window"`` stages the gathered operand in threadgroup memory for a window
#: of rows (``spmm_window``; docs/metal.md, "The row-window SpMM"). Tuned (:data:`VARIANTS`), never timed on Apple
#: hardware yet.
SPMM_KERNELS = {"direct": "spmm", "window": "spmm_window"}
#: Rows a SIMD-group owns in ``spmm_window``, per P (``TSM_WINDOW_ROWS_P<P>`` in the shader, :data:`CONSTANTS`): a
#: threadgroup of R SIMD-groups owns a window of R * WINDOW_ROWS[P] rows.
WINDOW_ROWS = {1: 16, 4: 8}
#: The kernel variants ``auto`` chooses among on MPS (registered with :mod:`torch_sparse_metal.tuning`), and the
#: ops each changes where not every op: the SpMM kernel is the forward's and atomic_free's (fused_atomic, the
#: static strategy, has its own kernel), so the backward of ``auto`` is not timed over it.
VARIANTS = {"values_per_lane": VALUES_PER_LANE, "spmm": tuple(SPMM_KERNELS)}
VARIANT_OPS = {"spmm": ("forward", Strategy.ATOMIC_FREE.value)}
#: Kernel stages: each op's preparation of its operands in one dispatch (the feature-major copies, and the forward's
#: weight gather or fused_atomic's zeroed grad_w), instantiated per dtype; the tiled ones, named as the CPU and CUDA
#: kernels' (docs/architecture.md, "Where the contract lives"), also per P.
PLAIN_STAGES = ("forward_operands", "fused_atomic_operands", "atomic_free_operands")
TILED_STAGES = ("spmm", "spmm_window", "spmm_sddmm_atomic", "sddmm")
#: The 32 x 32 tiles of a feature-major copy, and the elements of another job, that one threadgroup of an operands
#: kernel does (``kTileWidth``, ``kBlockElems`` in shaders/csr_linear.metal, from :data:`CONSTANTS`).
TILE_WIDTH = 32
BLOCK_ELEMS = 1024
#: This family's layout numbers as its shader is compiled with them (``TSM_<NAME>``,
#: :func:`.metal_source.shader_defines`).
CONSTANTS = {"TILE_WIDTH": TILE_WIDTH, "BLOCK_ELEMS": BLOCK_ELEMS,
             **{f"WINDOW_ROWS_P{p}": rows for p, rows in WINDOW_ROWS.items()}}


def kernel_names() -> list[str]:
    """Every kernel the host code dispatches, as the shaders must instantiate them.

    Example:
        >>> kernel_names()[:4]
        ['forward_operands_float', 'fused_atomic_operands_float', 'atomic_free_operands_float', 'spmm_float_p1']
    """
    names = []
    for suffix in KERNEL_DTYPES.values():
        names += [f"{stage}_{suffix}" for stage in PLAIN_STAGES]
        names += [f"{stage}_{suffix}_p{p}" for p in VALUES_PER_LANE for stage in TILED_STAGES]
    return names


def values_per_lane(batch: int) -> int:
    """The static rule for P (without tuning): 1 up to one SIMD-group's width of batch columns (less padding),
    else 4 (one 16-byte load per lane)."""
    return VALUES_PER_LANE[0] if batch <= SIMD_WIDTH * VALUES_PER_LANE[0] else VALUES_PER_LANE[-1]


def load_source(dtype: torch.dtype | None = None) -> str:
    """The complete Metal source of this family (``dtype``'s kernels only, where given): its constants, our header,
    then its shader files (``#line`` keeps error positions).

    Example:
        >>> "[[kernel]] void spmm" in load_source()
        True
    """
    return metal_source.load_source(SHADER_FILES, CONSTANTS, dtypes=None if dtype is None else (dtype,))


class MetalUnstructuredCsrLinear(MetalHost):
    """Dispatches the Metal kernels of the unstructured layout; one compiled library per instance (lazily).

    ``compile_fn``, ``device_type``, ``poison``, ``check_platform`` and ``error_words`` as for
    :class:`.metal.MetalHost` (the library is :func:`load_source`'s). ``values_per_lane``
    fixes P of the tiled kernels (one of VALUES_PER_LANE) and ``spmm`` the SpMM kernel (a key of SPMM_KERNELS),
    e.g. to compare variants; by default each call runs the static rule (:func:`values_per_lane`, ``"direct"``), or
    with tuning on the tuner's choice for its size bucket (:func:`torch_sparse_metal.tuning.variant`).
    """

    def __init__(self, compile_fn: Callable[[str], Any], device_type: str = "mps", *, poison: bool | None = None,
                 check_platform: Callable[[], None] | None = None, values_per_lane: int | None = None,
                 spmm: str | None = None, error_words: dict[torch.device, torch.Tensor] | None = None):
        if values_per_lane is not None and values_per_lane not in VALUES_PER_LANE:
            raise ValueError(f"values_per_lane must be one of {VALUES_PER_LANE}, got {values_per_lane}")
        if spmm is not None and spmm not in SPMM_KERNELS:
            raise ValueError(f"spmm must be one of {tuple(SPMM_KERNELS)}, got {spmm!r}")
        super().__init__(compile_fn, SHADER_FILES, device_type, poison=poison, check_platform=check_platform,
                         error_words=error_words)
        self.values_per_lane = values_per_lane
        self.spmm = spmm

    def source(self, dtype: torch.dtype | None = None) -> str:
        """:func:`load_source` (looked up when compiling, so a replacement of it is compiled instead)."""
        return load_source(dtype)

    def kernel_names(self, dtype: torch.dtype) -> list[str]:
        """:func:`kernel_names` of ``dtype``."""
        return [name for name in kernel_names() if KERNEL_DTYPES[dtype] in name.split("_")]

    # ------------------------------------------------------------------------------------------ launches
    def _operands(self, stage: str, dtype: torch.dtype, outputs: tuple[torch.Tensor, ...],
                  inputs: tuple[torch.Tensor, ...], sizes: tuple[int, ...], groups: int) -> None:
        """One operands kernel over ``groups`` threadgroups of (TILE_WIDTH, R) threads in a row: the feature-major
        copies' tiles first, then the blocks of the op's other job (the kernel tells them apart by threadgroup
        index)."""
        fn = self.kernel(stage, dtype)
        rows = self._rows(fn)
        fn(*outputs, *inputs, *sizes, threads=(groups * TILE_WIDTH, rows), group_size=(TILE_WIDTH, rows))

    def _feature_major(self, t: torch.Tensor, ldb: int) -> tuple[torch.Tensor, int]:
        """The ``[cols, ldb]`` feature-major, zero-padded buffer of a ``[batch, cols]`` operand (the layout of every
        gathered operand; an operands kernel fills it), and the threadgroups its copy takes."""
        cols = t.shape[1]
        return self._empty((cols, ldb), t), -(-cols // TILE_WIDTH) * (ldb // TILE_WIDTH)

    def _tiled(self, stage: str, outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
               sizes: tuple[int, ...], nrows: int, p: int, ldb: int) -> None:
        """One tiled kernel: a SIMD-group per CSR row and batch chunk of 32 * P columns; a threadgroup holds the
        rows of one chunk (whole groups: the tile moves through threadgroup memory between barriers)."""
        fn = self.kernel(stage, inputs[0].dtype, p)
        rows = self._rows(fn, p)
        chunks = ldb // (SIMD_WIDTH * p)
        window = rows * (WINDOW_ROWS[p] if stage == SPMM_KERNELS["window"] else 1)  # rows of a threadgroup
        fn(*outputs, *inputs, *sizes, ldb, threads=(-(-nrows // window) * SIMD_WIDTH * rows, chunks),
           group_size=(SIMD_WIDTH * rows, 1))

    def forward(self, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor, dst: torch.Tensor,
                src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor, perm: torch.Tensor
                ) -> torch.Tensor:
        """``y[n, o] = sum_k weight[perm[k]] * x[n, src_by_dst[k]]``, arguments as in the op contract."""
        self._check_device(x)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        return self.run_forward(x, weight, index, check_forward(x, weight, *index))

    def _forward_kernels(self, x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...], sizes: Sizes
                         ) -> torch.Tensor:
        """:meth:`run_forward` on the Metal kernels."""
        _, _, _, col_ptr, src_by_dst, perm = index
        n, n_in, n_out, nnz, _ = sizes
        y = self._empty((n, n_out), x)
        if n == 0 or n_out == 0:
            return y
        if nnz == 0:
            return y.zero_()
        bucket = (x.dtype, n_in, n_out, nnz, n, "forward")  # the tuner's size bucket, formed only with tuning on
        p = self._p(x, bucket)
        ldb = _padded(n, p)
        w_by_dst = self._empty((nnz,), weight)
        xt, tiles = self._feature_major(x, ldb)
        self._operands("forward_operands", x.dtype, (xt, w_by_dst), (x, weight, perm, self._errors(x.device, "perm")),
                       (n, n_in, ldb, nnz), tiles + -(-nnz // BLOCK_ELEMS))
        self._tiled(self._spmm(x, bucket), (y,), (w_by_dst, xt, col_ptr, src_by_dst, self._errors(x.device, "col_ptr")),
                    (n, n_out, n_in, nnz), n_out, p, ldb)
        return y

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor,
                 dst: torch.Tensor, src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor,
                 perm: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_x [N, in], grad_weight [E])`` with a concrete ``strategy`` of the contract.

        ``"auto"`` is resolved by the autograd rule (``strategy.resolve_strategy``) before any backend runs, so
        it is rejected here as by the CPU and CUDA kernels. The atomic strategy sums in a nondeterministic order.
        """
        self._check_device(x)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        return self.run_backward(grad_out, x, weight, index, check_backward(grad_out, x, weight, *index, strategy),
                                 strategy)

    def _backward_kernels(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          index: tuple[torch.Tensor, ...], sizes: Sizes, strategy: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run_backward` on the Metal kernels."""
        row_ptr, dst = index[:2]
        n, n_in, n_out, nnz, _ = sizes
        run = _BACKWARD_KERNELS[Strategy(strategy)]  # every strategy of the contract has an entry (strategy_methods)
        grad_x = self._empty((n, n_in), x)
        if n == 0 or n_in == 0 or nnz == 0:  # no kernel runs: the gradients are zero (or empty)
            return grad_x.zero_(), torch.zeros((nnz,), dtype=weight.dtype, device=weight.device)
        bucket = (x.dtype, n_in, n_out, nnz, n)
        p = self._p(x, bucket, strategy)
        ldb = _padded(n, p)
        grad_w = run(self, grad_x, grad_out, x, weight, row_ptr, dst, self._errors(x.device, "row_ptr"),
                     (n, n_in, n_out, nnz), p, ldb, self._spmm(x, bucket, strategy))
        return grad_x, grad_w.to(weight.dtype)

    # ---------------------------------------------- each strategy's kernels: a method named after it (strategy_methods)
    def fused_atomic(self, grad_x, grad_out, x, weight, row_ptr, dst, errors, sizes, p, ldb, spmm) -> torch.Tensor:
        """One pass: a SIMD-group owns (source row, batch chunk) of grad_x and adds its edges' parts into grad_w
        atomically (its own kernel: ``spmm`` does not apply). Float atomics: for every dtype grad_w is a float32
        buffer (rounded once by the caller for 16-bit values), zero-filled by the dispatch that copies grad_out
        feature-major."""
        n, n_in, n_out, nnz = sizes
        grad_w = self._empty((nnz,), weight, torch.float32)
        gt, tiles = self._feature_major(grad_out, ldb)
        self._operands("fused_atomic_operands", x.dtype, (gt, grad_w), (grad_out,), (n, n_out, ldb, nnz),
                       tiles + -(-nnz // BLOCK_ELEMS))
        self._tiled("spmm_sddmm_atomic", (grad_x, grad_w), (weight, gt, x, row_ptr, dst, errors), sizes, n_in, p, ldb)
        return grad_w

    def atomic_free(self, grad_x, grad_out, x, weight, row_ptr, dst, errors, sizes, p, ldb, spmm) -> torch.Tensor:
        """Two passes with exclusive ownership: a SIMD-group per source row owns its edges' grad_w over the whole
        batch (grad_out and x feature-major, copied by one dispatch), then the SpMM kernel ``spmm`` over the same
        rows owns grad_x."""
        n, n_in, n_out, nnz = sizes
        grad_w = self._empty((nnz,), weight)
        (gt, out_tiles), (xt, in_tiles) = self._feature_major(grad_out, ldb), self._feature_major(x, ldb)
        self._operands("atomic_free_operands", x.dtype, (gt, xt), (grad_out, x), (n, n_out, n_in, ldb),
                       out_tiles + in_tiles)
        fn = self.kernel("sddmm", x.dtype, p)
        fn(grad_w, gt, xt, row_ptr, dst, errors, n_in, n_out, nnz, ldb, threads=n_in * SIMD_WIDTH,
           group_size=SIMD_WIDTH * self._rows(fn))
        self._tiled(spmm, (grad_x,), (weight, gt, row_ptr, dst, errors), sizes, n_in, p, ldb)
        return grad_w

    def _p(self, x: torch.Tensor, bucket: tuple, strategy: str | None = None) -> int:
        """P of a call: fixed at construction, else the tuner's for the bucket (a lookup, no device wait), else the
        static rule."""
        if self.values_per_lane is not None:
            return self.values_per_lane
        p = tuning.tuned_variant(x.device, bucket, "values_per_lane", strategy)
        return p if type(p) is int and p in VALUES_PER_LANE else values_per_lane(x.shape[0])

    def _spmm(self, x: torch.Tensor, bucket: tuple, strategy: str | None = None) -> str:
        """The SpMM kernel's stage name for a call: fixed at construction, else the tuner's for the bucket, else
        ``spmm`` (the static rule: no timing on Apple hardware supports another)."""
        kind = self.spmm
        if kind is None:
            kind = tuning.tuned_variant(x.device, bucket, "spmm", strategy)
        return SPMM_KERNELS.get(kind, SPMM_KERNELS["direct"]) if isinstance(kind, str) else SPMM_KERNELS["direct"]



#: The kernels of each backward strategy.
_BACKWARD_KERNELS = strategy_methods(MetalUnstructuredCsrLinear)


def _padded(batch: int, p: int) -> int:
    """The feature-major operands' row length: the batch rounded up to whole chunks of 32 * P."""
    chunk = SIMD_WIDTH * p
    return -(-batch // chunk) * chunk


#: This layout's host, as ``mps.layout_hosts`` finds it.
HOST = MetalUnstructuredCsrLinear
