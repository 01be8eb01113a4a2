"""The MPS reference path: the ``csr_linear`` ops of both layouts built from torch's own ops on the tensors' device,
for a family and dtype whose Metal kernels cannot run here (a library that does not compile, issue #40, or a kernel
whose pipeline cannot be created, issue #46), or wherever the user asks for it
(``TORCH_SPARSE_METAL_METAL=reference``, :func:`torch_sparse_metal.backends.mps.use_reference`). The hosts
(:class:`~.mps_unstructured_csr_linear.MetalCsrLinear`, :class:`~.mps_vector_csr_linear.MetalVectorCsrLinear`) call
it after their checks (:meth:`.metal.MetalHost.metal_or_reference`), so it sees the arguments the kernels would.

How: each output (or source) gathers its edges into a padded ``[segments, depth]`` table of positions (built with
an ``index_put`` of unique indices); the terms are gathered, multiplied and summed over the fixed depth axis (for the
vector layout a batched matmul of the small ``[depth, V]`` blocks), in float32 for every dtype and rounded once. No
atomics and no ``index_add_``: the path is **deterministic**, and both backward strategies compute the same thing
(the strategy only chooses kernels). Only gathers, ``index_put``, elementwise ops, ``sum`` and ``einsum``, which
MPS has for float32, float16 and bfloat16; no ``torch.sparse``. It reads index values (a table's depth) and so waits
for the device once per call: a fall-back, not a fast path. Index values are trusted here (the kernels' clamping
and error words do not apply).

Example (on CPU tensors, as the tests run it):
    >>> from torch_sparse_metal import CSRTopology
    >>> from torch_sparse_metal.ops._csr_linear import check_forward
    >>> args = CSRTopology.from_mask(torch.tensor([[False, True]])).kernel_args()  # input 1 -> output 0
    >>> x, w = torch.tensor([[1.0, 3.0]]), torch.tensor([2.0])
    >>> forward(x, w, args, check_forward(x, w, *args)).tolist()
    [[6.0]]
"""

from __future__ import annotations

import threading
import warnings

import torch

from torch_sparse_metal.backends.metal_contract import MetalUnavailable
from torch_sparse_metal.ops._csr_linear import Sizes

__all__ = ["MetalFallbackWarning", "backward", "forward", "warn_fallback"]

#: The most float32 terms one gathered block holds (a chunk of segments at a time bounds the path's memory).
_BLOCK_TERMS = 1 << 24
#: The (family, dtype) pairs already warned about in this process.
_warned: set[tuple[str, torch.dtype]] = set()
_warn_lock = threading.Lock()


class MetalFallbackWarning(RuntimeWarning):
    """A family's Metal kernels of one dtype cannot run here (failed to compile, or a pipeline could not be
    created), and its ops of that dtype run on the slower reference path."""


def warn_fallback(error: MetalUnavailable) -> None:
    """Warn, once per process for its family and dtype, that these ops run on the reference path because of
    ``error``."""
    with _warn_lock:
        if (error.family, error.dtype) in _warned:
            return
        _warned.add((error.family, error.dtype))
    warnings.warn(f"{error}\nUntil then the ops of {error.family} for {error.dtype} run on the reference path built "
                  "from torch's own ops (correct, deterministic, slower); set TORCH_SPARSE_METAL_METAL=reference to "
                  "choose it for every dtype. This warning is shown once per process for this family and dtype.",
                  MetalFallbackWarning, stacklevel=5)


def _table(ptr: torch.Tensor, segment_of: torch.Tensor, total: int) -> torch.Tensor:
    """``[segments, depth]`` positions of each segment's entries (``ptr`` its CSR pointers, ``segment_of`` each
    position's segment), padded with ``total`` (one past the last position)."""
    ptr = ptr.long()
    counts = ptr[1:] - ptr[:-1]
    depth = int(counts.max()) if counts.numel() else 0
    table = torch.full((counts.numel(), max(depth, 1)), total, dtype=torch.long, device=ptr.device)
    positions = torch.arange(total, device=ptr.device)
    table[segment_of, positions - ptr[segment_of]] = positions  # unique indices: deterministic
    return table


def _padded(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``values`` (indexed by position along dim 0) gathered by ``table``, zero at the padding."""
    return torch.cat([values, values.new_zeros((1, *values.shape[1:]))])[table]


def _step(per_segment: int) -> int:
    """Segments per chunk, each of ``per_segment`` terms."""
    return max(1, _BLOCK_TERMS // max(1, per_segment))


def _gather_sum(rows: torch.Tensor, table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[n, s(, j)] = sum_d rows[n, index[table[s, d]]] * weight[table[s, d](, j)]`` over a position table:
    ``rows`` ``[N, cols]`` (1-D weights) or ``[N, cols, V]``/``[N, cols]`` against ``[positions, V]`` weights; in
    float32. The padding's terms are masked, so an infinite value elsewhere in ``rows`` cannot leak NaN into them."""
    n, segments, depth = rows.shape[0], table.shape[0], table.shape[1]
    index, weight, total = _padded(index.long(), table), _padded(weight.float(), table), index.numel()
    valid = table < total
    width = weight.shape[-1] if weight.dim() == 3 else 1
    parts, step = [], _step(n * depth * width)
    for a in range(0, segments, step):
        idx, w, ok = index[a:a + step], weight[a:a + step], valid[a:a + step]
        g = rows[:, idx]  # [N, s, depth(, V)]
        mask = ok.view(1, *ok.shape, *([1] * (g.dim() - 3)))
        g = torch.where(mask, g.float(), 0.0)
        if weight.dim() == 3 and g.dim() == 3:  # vector forward: [N, s, depth] x [s, depth, V] -> [N, s, V]
            parts.append(torch.einsum("nsd,sdv->nsv", g, w))
        elif weight.dim() == 3:  # vector grad_x: [N, s, depth, V] . [s, depth, V] -> [N, s]
            parts.append((g * w).sum((2, 3)))
        else:
            parts.append((g * w).sum(2))
    return torch.cat(parts, 1) if parts else rows.new_zeros((n, 0), dtype=torch.float32)


def forward(x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...], sizes: Sizes) -> torch.Tensor:
    """``y [N, out]`` of the op contract, either layout (``sizes``: what the op's checks returned)."""
    _, dst, _, col_ptr, src_by_dst, perm = index
    n, _, n_out, nnz, block = sizes
    if n == 0 or n_out == 0 or nnz == 0:
        return torch.zeros((n, n_out), dtype=x.dtype, device=x.device)
    perm = perm.long()
    table = _table(col_ptr, dst.long()[perm], nnz)  # by-destination positions of each output (or group)
    y = _gather_sum(x, table, src_by_dst, weight[perm])
    return y.reshape(n, n_out).to(x.dtype)


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...],
             sizes: Sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x [N, in], grad_weight)`` of the op contract, either layout, any strategy (all compute the same)."""
    row_ptr, dst, src, _, _, _ = index
    n, n_in, n_out, nnz, block = sizes
    grad_w = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    if n == 0 or n_in == 0 or nnz == 0:
        return torch.zeros((n, n_in), dtype=x.dtype, device=x.device), grad_w
    dst, src = dst.long(), src.long()
    g = grad_out if block == 1 else grad_out.reshape(n, n_out // block, block)
    grad_x = _gather_sum(g, _table(row_ptr, src, nnz), dst, weight)  # by-source positions are the edge ids
    step = _step(n * block)
    for a in range(0, nnz, step):  # grad_w[e(, j)] = sum_n grad_out[n, dst[e](, j)] * x[n, src[e]]
        b = a + step
        xs = x[:, src[a:b]].float()
        grad_w[a:b] = (g[:, dst[a:b]].float() * (xs if block == 1 else xs.unsqueeze(-1))).sum(0).to(weight.dtype)
    return grad_x.to(x.dtype), grad_w
