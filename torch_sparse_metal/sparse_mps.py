"""torch's own sparse CSR / CSC matrix products, computed by the ``csr_linear`` Metal kernels.

A compressed matrix of torch (``torch.sparse_csr`` or ``torch.sparse_csc``, 2-D, no dense dimensions) is read as
a base CSR matrix ``M [r, c]`` (``crow``, ``col``, ``values``) and a flag: a CSC ``[m, k]`` is the transpose of the
CSR ``[k, m]`` with the same arrays. ``M`` is then a sparse layer from ``r`` inputs to ``c`` outputs whose edges, by
source, are exactly M's stored entries in storage order (:class:`CompressedOperand`), so ``values`` is the layer's
weight without any reordering, and:

- ``forward(x [n, r])`` is ``x @ M``; ``backward(G [n, c], x [n, r])`` gives ``G @ M^T`` and, per entry ``(i, j)``,
  ``sum_n G[n, j] x[n, i]``: the sampled product (``sparse_sampled_addmm``);
- the layer over the transposed edges (``c`` inputs to ``r`` outputs, weight ``values[order]``) has the forward
  ``x @ M^T``.

Every product below is one of these (transposes of dense operands are copies), so the functions here are the
implementations of ``aten::mm``, ``addmm`` and ``sparse_sampled_addmm`` that :mod:`torch_sparse_metal.sparse_mps_ops`
registers for torch's ``SparseCsrMPS`` dispatch key. They take a ``kernels`` object with the
``forward(x, weight, *topology)`` / ``backward(grad_out, x, weight, *topology, strategy)`` methods of
:class:`torch_sparse_metal.backends.mps.MetalCsrLinear`; the default, :data:`OPS`, calls the
``torch_sparse_metal::csr_linear`` ops (on MPS, the Metal kernels), and the tests pass a ``MetalCsrLinear`` over the
MSL-on-CPU executor with CPU tensors.

Example (CPU tensors; the CPU kernels of the ops):
    >>> a = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr()
    >>> mm(a, torch.tensor([[1.0], [10.0]])).tolist()
    [[20.0], [3.0]]
    >>> mm(torch.tensor([[1.0, 10.0]]), a).tolist()
    [[30.0, 2.0]]
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .contract import INT32_MAX
from .topology import CSRTopology

__all__ = ["OPS", "CompressedOperand", "Kernels", "RefusedError", "addmm", "coo_to_csc", "coo_to_csr",
           "dense_to_csc", "dense_to_csr", "indices_coo_to_csr", "indices_csr_to_coo", "mm",
           "operand", "product_kernels", "sampled_addmm", "sparse_mask"]

#: The value dtypes these paths take on MPS (those of the Metal kernels).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The backward strategy of the sampled product: deterministic (no atomics).
SAMPLED_STRATEGY = "atomic_free"
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc)


class RefusedError(NotImplementedError):
    """What these paths cannot do; the message names the operation and what to do instead."""


class Kernels(Protocol):
    """The two products every path here is made of (the signatures of ``MetalCsrLinear``)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, *topology: torch.Tensor) -> torch.Tensor: ...

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *topology_and_strategy: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


class _Ops:
    """:class:`Kernels` through the ``torch_sparse_metal`` ops (each device's registered kernels)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, *topology: torch.Tensor) -> torch.Tensor:
        return torch.ops.torch_sparse_metal.csr_linear(x, weight, *topology, SAMPLED_STRATEGY)

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *args: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.torch_sparse_metal.csr_linear_backward(grad_out, x, weight, *args)


#: The default kernels: the ops of the extension (on MPS tensors, the Metal kernels of SparseLinear).
OPS: Kernels = _Ops()


def refuse(op: str, why: str, instead: str) -> RefusedError:
    """The error of a refused path: ``"<op> on MPS: <why>; <instead>"``."""
    return RefusedError(f"{op} on MPS (torch_sparse_metal): {why}; {instead}")


@dataclass(eq=False)
class CompressedOperand:
    """A 2-D compressed torch tensor as a base CSR matrix ``M [rows, cols]`` (``transposed``: the tensor is ``M^T``,
    a CSC) with the layer topologies of ``M`` and of ``M^T`` (the latter built on first use)."""

    rows: int
    cols: int
    values: torch.Tensor
    transposed: bool
    topology: CSRTopology  # M: rows -> cols, edges in storage order
    order: torch.Tensor  # int64 [nnz]: storage positions sorted by (col, row)
    _t: CSRTopology | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # the kernels read the weight as raw memory; torch allows a compressed tensor with strided values
        self.values = self.values.contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        """The torch tensor's shape."""
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    def topology_t(self) -> CSRTopology:
        """The layer of ``M^T`` (``cols -> rows``), its edges sorted by (col, row): weight ``values[order]``."""
        if self._t is None:
            t = self.topology
            self._t = CSRTopology._derive(self.cols, self.rows, t.dst[self.order], t.src[self.order])
        return self._t


def _check_values(op: str, t: torch.Tensor, name: str) -> None:
    if t.dtype not in DTYPES:
        raise refuse(op, f"{name} has dtype {t.dtype}; the Metal kernels take {', '.join(map(str, DTYPES))}",
                     "convert with .to(torch.float32) (float64 and complex: compute on the CPU explicitly)")


def _check_matrix(op: str, a: torch.Tensor) -> None:
    """Refuses, naming ``op``, anything but a 2-D CSR or CSC matrix without dense dims."""
    if a.layout not in _COMPRESSED:
        raise refuse(op, f"a {a.layout} operand is not supported here",
                     "use a torch.sparse_csr or torch.sparse_csc tensor (tensor.to_sparse_csr())")
    if a.dim() != 2 or a.dense_dim() != 0:
        raise refuse(op, f"a compressed tensor with shape {tuple(a.shape)} and {a.dense_dim()} dense dims",
                     "only 2-D matrices without dense dims are supported: loop over the batch, or use a COO "
                     "tensor (torch.bmm on MPS takes COO)")


def operand(op: str, a: torch.Tensor) -> CompressedOperand:
    """``a`` (a 2-D CSR or CSC tensor) as a :class:`CompressedOperand`, its topology derived from ``a``'s index
    arrays as they are now (:func:`_derived`).

    Refuses batched tensors, dense dimensions, BSR/BSC and dtypes without kernels, naming ``op``.
    """
    _check_matrix(op, a)
    csr = a.layout == torch.sparse_csr
    crow, col = (a.crow_indices(), a.col_indices()) if csr else (a.ccol_indices(), a.row_indices())
    values = a.values()
    _check_values(op, values, "the sparse operand")
    if values.numel() >= INT32_MAX or max(a.shape) >= INT32_MAX:
        raise refuse(op, f"{values.numel()} stored entries of a {tuple(a.shape)} matrix exceed the int32 indices "
                     "of the kernels", "split the matrix into blocks of rows")
    rows, cols = (a.shape[0], a.shape[1]) if csr else (a.shape[1], a.shape[0])
    topology = _derived(rows, cols, crow.unsqueeze(0), col.unsqueeze(0), 1)
    return CompressedOperand(rows, cols, values, not csr, topology, topology.perm.long())


def _derived(rows: int, cols: int, crow: torch.Tensor, col: torch.Tensor, n: int) -> CSRTopology:
    """The layer of the ``[n rows, n cols]`` block-diagonal CSR matrix of ``n`` matrices ``[rows, cols]`` with
    ``crow [b, rows + 1]`` and ``col [b, nnz]`` (``b == n``, or ``b == 1``: one pattern for all), edges in storage
    order.

    Derived afresh on every call, never cached across calls: nothing proves that index arrays are unchanged since
    an earlier call. Below autograd (where these kernels run) ``crow_indices()`` and ``col_indices()`` are aliases
    with a version counter of their own that in-place writes elsewhere do not move, and a storage can be refilled
    through any other tensor on it (the one a CSR was built from, ``.data``) with the same data pointer; comparing
    contents would need a host wait on MPS. The derivation only runs device-side ops whose output sizes are known
    in advance, so it costs device work (a sort by column), never a host wait.
    """
    nnz, b = col.shape[-1], crow.numel() // (rows + 1)
    crow, col = crow.reshape(b, rows + 1).expand(n, rows + 1).long(), col.reshape(b, nnz).expand(n, nnz).long()
    counts = (crow[:, 1:] - crow[:, :-1]).reshape(-1)
    src = torch.repeat_interleave(torch.arange(n * rows, device=crow.device), counts, output_size=n * nnz)
    dst = (col + torch.arange(n, device=col.device).unsqueeze(1) * cols).reshape(-1)
    return CSRTopology._derive(n * rows, n * cols, src, dst)


def _dense(op: str, t: torch.Tensor, name: str) -> None:
    if t.layout != torch.strided:
        raise refuse(op, f"{name} is {t.layout}: sparse x sparse products are not implemented",
                     f"make {name} dense (.to_dense()) if it fits, or multiply on the CPU")
    if t.dim() != 2:
        raise refuse(op, f"{name} has shape {tuple(t.shape)}; only 2-D products are implemented",
                     "reshape to 2-D (a vector: .unsqueeze(-1))")
    _check_values(op, t, name)


def _forward(kernels: Kernels, a: CompressedOperand, x: torch.Tensor, through_t: bool) -> torch.Tensor:
    """``x @ M`` (``through_t``: ``x @ M^T``), ``x`` made contiguous."""
    x = x.contiguous()
    if through_t:
        w = a.values[a.order]
        return kernels.forward(x, w.to(x.dtype), *a.topology_t().kernel_args())
    return kernels.forward(x, a.values.to(x.dtype), *a.topology.kernel_args())


def _check_mm(op: str, left: torch.Tensor, right: torch.Tensor) -> None:
    if left.shape[1] != right.shape[0]:
        raise RuntimeError(f"{op}: mat1 and mat2 shapes cannot be multiplied ({left.shape[0]}x{left.shape[1]} and "
                           f"{right.shape[0]}x{right.shape[1]})")
    if left.dtype != right.dtype:
        raise RuntimeError(f"{op}: expected mat1 and mat2 to have the same dtype, but got: {left.dtype} != "
                           f"{right.dtype}")


def mm(mat1: torch.Tensor, mat2: torch.Tensor, kernels: Kernels = OPS, op: str = "torch.mm") -> torch.Tensor:
    """``mat1 @ mat2`` with one compressed (CSR or CSC) operand and one dense; a dense result, as torch's CPU.

    Example:
        >>> a = torch.eye(3).to_sparse_csr()
        >>> mm(a.t(), torch.ones(3, 2)).tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    sparse1, sparse2 = mat1.layout != torch.strided, mat2.layout != torch.strided  # BSR/BSC/COO: refused below
    if sparse1 and sparse2:
        raise refuse(op, "both operands are sparse (sparse x sparse)",
                     "make one operand dense (.to_dense()), or multiply on the CPU and move the result")
    if sparse1:  # the sparse operand first: a batched CSR is the problem, not the dense operand's batch
        a = operand(op, mat1)
        _dense(op, mat2, "mat2")
        _check_mm(op, mat1, mat2)
        # M @ D = (D^T @ M^T)^T; M^T @ D = (D^T @ M)^T
        return _forward(kernels, a, mat2.t(), through_t=not a.transposed).t().contiguous()
    if sparse2:
        a = operand(op, mat2)
        _dense(op, mat1, "mat1")
        _check_mm(op, mat1, mat2)
        return _forward(kernels, a, mat1, through_t=a.transposed)  # D @ M, D @ M^T
    raise refuse(op, "no operand is a compressed sparse tensor", "this kernel only handles CSR/CSC operands")


#: The torch calls that reach ``aten::addmm`` with a compressed operand: torch.sparse.mm and torch.sparse.addmm are
#: decompositions onto it, so its errors name all three.
ADDMM = "torch.addmm (or torch.sparse.mm, torch.sparse.addmm)"


def addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float = 1, alpha: float = 1,
          kernels: Kernels = OPS, op: str = "torch.addmm") -> torch.Tensor:
    """``beta * input + alpha * (mat1 @ mat2)`` with a dense ``input`` (broadcast to the result) and one compressed
    operand; with ``beta == 0`` ``input`` is ignored (NaN in it does not propagate), as torch does.

    Example:
        >>> a = torch.eye(2).to_sparse_csr()
        >>> addmm(torch.ones(2, 2), a, torch.full((2, 2), 3.0), beta=2, alpha=0.5).tolist()
        [[3.5, 3.5], [3.5, 3.5]]
    """
    if input.layout != torch.strided:
        raise refuse(op, f"input is {input.layout}: a sparse input (sparse result) is not implemented",
                     "pass a dense input, or add the sparse matrix afterwards")
    prod = mm(mat1, mat2, kernels, op)
    if input.dtype != prod.dtype:
        raise RuntimeError(f"{op}: expected input and mat1 to have the same dtype, but got {input.dtype} != "
                           f"{prod.dtype}")
    try:
        base = input.expand(prod.shape)
    except RuntimeError as e:
        raise RuntimeError(f"{op}: input of shape {tuple(input.shape)} does not broadcast to the product's "
                           f"{tuple(prod.shape)}") from e
    if alpha != 1:
        prod = prod.mul_(alpha)
    if beta == 0:
        return prod
    return prod.add_(base, alpha=beta) if beta != 1 else prod.add_(base)


def _compressed_like(a: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``a``'s layout (CSR or CSC) with ``a``'s index arrays (cloned) and ``values``."""
    csr = a.layout == torch.sparse_csr
    ptr, idx = (a.crow_indices(), a.col_indices()) if csr else (a.ccol_indices(), a.row_indices())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse (CS[RC] tensor support is in beta|invariant checks)")
        return torch.sparse_compressed_tensor(ptr.clone(), idx.clone(), values, size=a.shape, layout=a.layout,
                                              check_invariants=False)


def sampled_addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float = 1,
                  alpha: float = 1, kernels: Kernels = OPS, op: str = "torch.sparse.sampled_addmm"
                  ) -> torch.Tensor:
    """``beta * input + alpha * (mat1 @ mat2)`` at ``input``'s stored entries only: a CSR result with ``input``'s
    pattern (``input`` a CSR ``[m, k]``, ``mat1 [m, d]``, ``mat2 [d, k]`` dense). Batched as torch's CPU kernel:
    ``mat1 [*B, m, d]`` and ``mat2 [*B, d, k]`` with ``input`` ``[*B, m, k]`` (same batch shape) or ``[m, k]``
    (the same pattern for every batch), a ``[*B, m, k]`` CSR result, all in one kernel call (:func:`_batched`).

    Example:
        >>> mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).to_sparse_csr()
        >>> sampled_addmm(mask, torch.ones(2, 3), torch.ones(3, 2), beta=0).to_dense().tolist()
        [[3.0, 0.0], [0.0, 3.0]]
        >>> sampled_addmm(mask, torch.ones(4, 2, 3), torch.ones(4, 3, 2)).shape  # batched
        torch.Size([4, 2, 2])
    """
    if input.layout != torch.sparse_csr:
        raise refuse(op, f"input is {input.layout}; the sampled product needs a CSR mask",
                     "convert the mask with .to_sparse_csr()")
    if input.dim() > 2 or mat1.dim() > 2 or mat2.dim() > 2:
        return _batched_sampled_addmm(input, mat1, mat2, beta, alpha, kernels, op)
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        _dense(op, t, name)
    a = operand(op, input)
    m, k = input.shape
    if mat1.shape[0] != m or mat2.shape[1] != k or mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"{op}: expected mat1 {tuple(mat1.shape)} @ mat2 {tuple(mat2.shape)} to have the "
                           f"shape of input {tuple(input.shape)}")
    _same_dtypes(op, a.values, mat1, mat2)
    # grad_w of the layer M (m -> k) at x = mat1^T [d, m], grad_out = mat2 [d, k]: sum_d mat1[i, d] mat2[d, j]
    sampled = _sampled(kernels, a, mat1.t(), mat2)
    return _compressed_like(input, _combine(sampled, a.values, beta, alpha))


def _same_dtypes(op: str, values: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    if not (mat1.dtype == mat2.dtype == values.dtype):
        raise RuntimeError(f"{op}: expected input, mat1 and mat2 to have the same dtype, got {values.dtype}, "
                           f"{mat1.dtype} and {mat2.dtype}")


def _sampled(kernels: Kernels, a: CompressedOperand, x: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """``sum_d x[d, i] go[d, j]`` at each stored entry ``(i, j)`` of ``a`` (the layer's weight gradient)."""
    if a.values.numel() == 0 or x.shape[0] == 0:
        return torch.zeros_like(a.values)
    return kernels.backward(go.contiguous(), x.contiguous(), a.values, *a.topology.kernel_args(), SAMPLED_STRATEGY)[1]


def _combine(sampled: torch.Tensor, values: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    """``alpha * sampled + beta * values``, combined in float32 and rounded once more. As torch's CPU kernel, no term
    is dropped for a zero factor: ``beta == 0`` still multiplies the mask's values, so a NaN or an infinity stored
    in the mask gives NaN (torch's rule of ignoring ``input`` at ``beta == 0`` is for dense ``addmm``)."""
    return sampled.float().mul_(alpha).add_(values.float(), alpha=beta).to(values.dtype)


def _batched_sampled_addmm(input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, beta: float, alpha: float,
                           kernels: Kernels, op: str) -> torch.Tensor:
    """:func:`sampled_addmm` with batch dimensions: the ``B`` matrices of the batch are the diagonal blocks of one
    ``[B m, B k]`` CSR matrix (entries in the same storage order), ``mat1`` is ``[B m, d]`` and ``mat2`` is
    ``[d, B k]``, so one sampled product of the kernels computes every batch."""
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        if t.layout != torch.strided or t.dim() < 2:
            raise refuse(op, f"{name} is a {t.layout} tensor of shape {tuple(t.shape)}",
                         f"pass a dense {name} with at least 2 dims")
        _check_values(op, t, name)
    batch = mat1.shape[:-2]
    if mat2.shape[:-2] != batch or (input.dim() > 2 and input.shape[:-2] != batch):
        raise RuntimeError(f"{op}: expected input {tuple(input.shape)}, mat1 {tuple(mat1.shape)} and mat2 "
                           f"{tuple(mat2.shape)} to have the same batch shape (input may also be 2-D)")
    if input.dense_dim() != 0:
        raise refuse(op, f"input has {input.dense_dim()} dense dims", "pass a CSR input without dense dims")
    (m, k), d = input.shape[-2:], mat1.shape[-1]
    if mat1.shape[-2] != m or mat2.shape[-1] != k or mat2.shape[-2] != d:
        raise RuntimeError(f"{op}: expected mat1 {tuple(mat1.shape)} @ mat2 {tuple(mat2.shape)} to have the "
                           f"shape of input {tuple(input.shape)}")
    values = input.values()
    _check_values(op, values, "input")
    _same_dtypes(op, values, mat1, mat2)
    nnz, n = values.shape[-1], math.prod(batch)
    crow, col = input.crow_indices(), input.col_indices()
    a = _block_diagonal(op, crow, col, values.expand(*batch, nnz).reshape(-1), n, m, k)
    x = mat1.reshape(n * m, d).t()  # [d, B m]
    go = mat2.reshape(n, d, k).permute(1, 0, 2).reshape(d, n * k)  # [d, B k]
    out = _combine(_sampled(kernels, a, x, go), a.values, beta, alpha).view(*batch, nnz)
    crow, col = (t.expand(*batch, t.shape[-1]).clone(memory_format=torch.contiguous_format) for t in (crow, col))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse (CS[RC] tensor support is in beta|invariant checks)")
        return torch.sparse_csr_tensor(crow, col, out, size=(*batch, m, k), check_invariants=False)


def _block_diagonal(op: str, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, n: int, m: int, k: int
                    ) -> CompressedOperand:
    """The ``[n m, n k]`` block-diagonal CSR matrix of ``n`` matrices ``[m, k]`` with ``crow`` ``[*, m + 1]`` and
    ``col`` ``[*, nnz]`` (batched, or one pattern for all), as a :class:`CompressedOperand`."""
    nnz = col.shape[-1]
    if max(n * m, n * k, n * nnz) >= INT32_MAX:
        raise refuse(op, f"a batch of {n} matrices {m} x {k} with {nnz} entries each exceeds the int32 indices of "
                     "the kernels", "split the batch")
    topology = _derived(m, k, crow, col, n)
    return CompressedOperand(n * m, n * k, values, False, topology, topology.perm.long())


def sparse_mask(dense: torch.Tensor, mask: torch.Tensor, op: str = "Tensor.sparse_mask") -> torch.Tensor:
    """``dense``'s entries at ``mask``'s stored positions, as a tensor of ``mask``'s layout (CSR or CSC).

    Example:
        >>> mask = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).to_sparse_csr()
        >>> sparse_mask(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), mask).values().tolist()
        [2.0, 3.0]
    """
    if mask.dim() > 2:  # torch's formulas call it with a batched CSR only in the backward of a batched sampled_addmm
        raise refuse(op, f"a batched mask of shape {tuple(mask.shape)} (as in the backward of a batched "
                     "torch.sparse.sampled_addmm, which torch's CPU and CUDA kernels do not compute either)",
                     "loop over the batch with 2-D sampled_addmm calls where gradients are needed")
    if dense.shape != mask.shape or dense.layout not in (torch.strided, torch.sparse_csr):
        raise refuse(op, f"a {dense.layout} tensor of shape {tuple(dense.shape)} masked by {tuple(mask.shape)}",
                     "pass a dense or CSR tensor of the mask's shape")
    a = operand(op, mask)
    if dense.layout == torch.sparse_csr:  # CSR masked by CSR: match the entries' row-major keys on the device
        s = operand(op, dense)
        width = max(dense.shape[1], 1)
        have = s.topology.src.long() * width + s.topology.dst.long()
        rows, cols = (a.topology.dst.long(), a.topology.src.long()) if a.transposed else \
            (a.topology.src.long(), a.topology.dst.long())
        want = rows * width + cols
        pos = torch.searchsorted(have, want).clamp_(max=max(have.numel() - 1, 0))
        found = have[pos] == want if have.numel() else torch.zeros_like(want, dtype=torch.bool)
        picked = s.values[pos] if have.numel() else torch.zeros(want.shape, dtype=s.values.dtype, device=want.device)
        return _compressed_like(mask, torch.where(found, picked, torch.zeros_like(picked)))
    rows, cols = a.topology.src.long(), a.topology.dst.long()
    values = dense.t()[rows, cols] if a.transposed else dense[rows, cols]
    return _compressed_like(mask, values)


def indices_coo_to_csr(rows: torch.Tensor, size: int, *, out_int32: bool = False) -> torch.Tensor:
    """The compressed row pointers ``[size + 1]`` of sorted COO row indices, on their device (a search per row,
    no host round trip): ``aten::_convert_indices_from_coo_to_csr``.

    Example:
        >>> indices_coo_to_csr(torch.tensor([0, 0, 2]), 4).tolist()
        [0, 2, 2, 3, 3]
    """
    bounds = torch.arange(size + 1, device=rows.device, dtype=rows.dtype)
    return torch.searchsorted(rows, bounds, out_int32=out_int32)


def indices_csr_to_coo(crow_indices: torch.Tensor, col_indices: torch.Tensor, *, out_int32: bool = False,
                       transpose: bool = False) -> torch.Tensor:
    """``[2, nnz]`` COO indices of CSR arrays, on their device: ``aten::_convert_indices_from_csr_to_coo``. Batched
    arrays (``crow [*B, m + 1]``, ``col [*B, nnz]``) give ``[len(B) + 2, B nnz]``, the batch indices first, as
    torch's CPU kernel does.

    Example:
        >>> indices_csr_to_coo(torch.tensor([0, 2, 3]), torch.tensor([0, 1, 1])).tolist()
        [[0, 0, 1], [0, 1, 1]]
    """
    dtype, device = torch.int32 if out_int32 else torch.int64, crow_indices.device
    batch, rows = crow_indices.shape[:-1], crow_indices.shape[-1] - 1
    nnz, n = col_indices.shape[-1], math.prod(crow_indices.shape[:-1])
    counts = (crow_indices[..., 1:] - crow_indices[..., :-1]).reshape(-1)
    row = torch.repeat_interleave(torch.arange(rows, device=device, dtype=dtype).repeat(n), counts,
                                  output_size=n * nnz)
    col = col_indices.reshape(-1).to(dtype)
    pair = torch.stack((col, row) if transpose else (row, col))
    if not batch:
        return pair
    which = torch.arange(n, device=device).repeat_interleave(nnz)
    return torch.cat((torch.stack(torch.unravel_index(which, batch)).to(dtype), pair))


def _compressed(ptr: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, size: Any,
                layout: torch.layout = torch.sparse_csr) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse (CS[RC] tensor support is in beta|invariant checks)")
        return torch.sparse_compressed_tensor(ptr, idx, values, size=size, layout=layout, check_invariants=False)


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: torch.Size) -> torch.Tensor:
    return _compressed(crow, col, values, size)


def _dense_to_compressed(dense: torch.Tensor, dense_dim: int | None, layout: torch.layout, op: str) -> torch.Tensor:
    """CSR (or CSC: the CSR of the transpose) of a dense ``[*B, m, k]`` tensor's nonzeros, on its device; batches
    must have equal counts, as torch requires. ``nonzero`` waits for the count, as on CUDA."""
    if dense.dim() < 2 or dense_dim:
        raise refuse(op, f"a {dense.dim()}-D tensor (dense_dim={dense_dim})",
                     "only matrices (and batches of them) without dense dims convert here")
    batch, n = dense.shape[:-2], math.prod(dense.shape[:-2])
    if n == 0:
        raise RuntimeError(f"{op}: Expected product of batch dimensions to be non-zero.")
    mat = dense.transpose(-2, -1) if layout == torch.sparse_csc else dense  # compressed dim first
    rows, cols = mat.shape[-2:]
    flat = mat.reshape(n * rows, cols)
    idx = flat.nonzero()
    r, c = idx[:, 0].contiguous(), idx[:, 1].contiguous()
    values, ptr = flat[r, c], indices_coo_to_csr(r, n * rows)
    if batch:
        nnz = r.numel() // n
        starts = torch.arange(n + 1, device=dense.device) * nnz
        if r.numel() != n * nnz or not torch.equal(ptr[::rows] if rows else starts, starts):
            raise RuntimeError(f"{op}: Expect the same number of specified elements per batch.")
        ptr = torch.cat((ptr[:-1].view(n, rows) - starts[:-1, None], starts[1:, None] - starts[:-1, None]), 1)
        ptr, c, values = ptr.view(*batch, rows + 1), c.view(*batch, nnz), values.view(*batch, nnz)
    return _compressed(ptr, c, values, dense.shape, layout)


def dense_to_csr(dense: torch.Tensor, dense_dim: int | None = None, op: str = "Tensor.to_sparse_csr"
                 ) -> torch.Tensor:
    """The CSR tensor of a dense matrix's (or batch of matrices') nonzeros, built on its device:
    ``aten::_to_sparse_csr`` of a dense tensor.

    Example:
        >>> dense_to_csr(torch.tensor([[0.0, 1.0], [2.0, 0.0]])).crow_indices().tolist()
        [0, 1, 2]
    """
    return _dense_to_compressed(dense, dense_dim, torch.sparse_csr, op)


def dense_to_csc(dense: torch.Tensor, dense_dim: int | None = None, op: str = "Tensor.to_sparse_csc"
                 ) -> torch.Tensor:
    """The CSC tensor of a dense matrix's (or batch of matrices') nonzeros, built on its device:
    ``aten::_to_sparse_csc`` of a dense tensor.

    Example:
        >>> dense_to_csc(torch.tensor([[0.0, 1.0], [2.0, 3.0]])).row_indices().tolist()
        [1, 0, 1]
    """
    return _dense_to_compressed(dense, dense_dim, torch.sparse_csc, op)


def coo_to_csr(coo: torch.Tensor, dense_dim: int | None = None, op: str = "Tensor.to_sparse_csr") -> torch.Tensor:
    """The CSR tensor of a 2-D COO tensor, on its device: ``aten::_to_sparse_csr`` of a COO tensor.

    Example:
        >>> coo_to_csr(torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse()).col_indices().tolist()
        [1, 0]
    """
    if coo.sparse_dim() != 2 or coo.dense_dim() != 0 or dense_dim:
        raise refuse(op, f"a COO tensor of shape {tuple(coo.shape)} with {coo.dense_dim()} dense dims",
                     "convert a 2-D COO matrix without dense dims")
    c = coo.coalesce()
    idx = c.indices()
    return _csr(indices_coo_to_csr(idx[0].contiguous(), coo.shape[0]), idx[1].contiguous(), c.values(), coo.shape)


def coo_to_csc(coo: torch.Tensor, dense_dim: int | None = None, op: str = "Tensor.to_sparse_csc") -> torch.Tensor:
    """The CSC tensor of a 2-D COO tensor, on its device (entries sorted by column, then row):
    ``aten::_to_sparse_csc`` of a COO tensor.

    Example:
        >>> coo_to_csc(torch.tensor([[0.0, 1.0], [2.0, 3.0]]).to_sparse()).ccol_indices().tolist()
        [0, 1, 3]
    """
    if coo.sparse_dim() != 2 or coo.dense_dim() != 0 or dense_dim:
        raise refuse(op, f"a COO tensor of shape {tuple(coo.shape)} with {coo.dense_dim()} dense dims",
                     "convert a 2-D COO matrix without dense dims")
    c = coo.coalesce()
    rows, cols = c.indices()
    order = torch.argsort(cols * max(coo.shape[0], 1) + rows)
    ccol = indices_coo_to_csr(cols[order].contiguous(), coo.shape[1])
    return _compressed(ccol, rows[order].contiguous(), c.values()[order], coo.shape, torch.sparse_csc)


def _scalar(op: str, other: object) -> float:
    if isinstance(other, torch.Tensor):
        if other.dim() != 0 or other.layout != torch.strided:
            raise refuse(op, "only multiplication by a scalar is implemented for compressed tensors",
                         "multiply the values: torch.sparse_csr_tensor(a.crow_indices(), a.col_indices(), "
                         "a.values() * w, a.shape)")
        return other.item()
    return other  # type: ignore[return-value]


def product_kernels(kernels: Kernels = OPS) -> dict[str, Any]:
    """The aten product kernels (by op name, aten's signatures), each a plain function of tensors over ``kernels``.

    Example:
        >>> product_kernels()["mv"](torch.eye(2).to_sparse_csr(), torch.tensor([1.0, 2.0])).tolist()
        [1.0, 2.0]
    """

    def mv(self, vec):
        if vec.dim() != 1:
            raise RuntimeError(f"torch.mv: vector must be 1-D, got {vec.dim()}-D")
        return mm(self, vec.unsqueeze(1), kernels, "torch.mv").squeeze(1)

    def addmv(self, mat, vec, *, beta=1, alpha=1):
        _check_matrix("torch.addmv", mat)
        if vec.dim() != 1 or mat.shape[1] != vec.shape[0] or self.dim() > 1 or self.numel() not in (1, mat.shape[0]):
            raise RuntimeError(f"torch.addmv: size mismatch, got input {tuple(self.shape)}, mat {tuple(mat.shape)}, "
                               f"vec {tuple(vec.shape)} (a compressed 2-D mat, a 1-D vec and an input that "
                               "broadcasts to mat's rows)")
        column = self.reshape(-1, 1) if self.dim() == 1 else self  # [m] or [1] -> a column of the [m, 1] product
        return addmm(column, mat, vec.unsqueeze(1), beta=beta, alpha=alpha, kernels=kernels,
                     op="torch.addmv").squeeze(1)

    def mul(self, other):
        if self.layout not in _COMPRESSED:
            self, other = other, self
        return _compressed_like(self, operand("torch.mul", self).values * _scalar("torch.mul", other))

    return {"mm": lambda self, mat2: mm(self, mat2, kernels),
            "addmm": lambda self, m1, m2, *, beta=1, alpha=1: addmm(self, m1, m2, beta=beta, alpha=alpha,
                                                                    kernels=kernels, op=ADDMM),
            "mv": mv, "addmv": addmv,
            "sparse_sampled_addmm": lambda self, m1, m2, *, beta=1, alpha=1: sampled_addmm(
                self, m1, m2, beta=beta, alpha=alpha, kernels=kernels),
            "sparse_mask": lambda self, mask: sparse_mask(self, mask), "mul.Tensor": mul}
