"""Registers torch's sparse CSR / CSC matrix products on MPS (``aten`` kernels for the ``SparseCsrMPS``,
``SparseMPS`` and ``MPS`` dispatch keys), computed by the Metal kernels of ``SparseLinear``
(:mod:`torch_sparse_metal.sparse_mps`). Imported by ``import torch_sparse_metal``; registers nothing that torch
already has for a key (a later torch's own kernel wins), compiles nothing, and touches no CPU or CUDA key.

What gets registered (:data:`PRODUCTS`, :data:`METADATA`, :data:`FACTORIES`, :data:`REFUSED`):

- the products: ``mm`` (``torch.mm``, ``torch.sparse.mm``, ``@``, ``torch.matmul``, ``F.linear``), ``addmm``
  (``torch.addmm``, ``torch.sparse.addmm``), ``mv``, ``sparse_sampled_addmm``, and ``sparse_mask`` and scalar
  ``mul`` (torch's derivative formulas use them);
- the metadata torch's MPS wheels lack for compressed tensors (``crow_indices``, ``values``, ``clone``, ...): torch's
  own device-independent kernels for these (those of ``SparseCsrCPU``, which read the tensor's members and move no
  data), reached by redispatch;
- conversions: ``dense.to_sparse_csr()`` (``MPS``), ``coo.to_sparse_csr()`` (``SparseMPS``), and the index
  conversions ``_convert_indices_from_coo_to_csr`` / ``_convert_indices_from_csr_to_coo`` (``MPS``), on the device;
- refusals, with a message naming the op and what to do instead, for the products these paths do not implement.

Example:
    >>> import torch, torch_sparse_metal
    >>> torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "SparseCsrMPS")
    True
    >>> ("aten::sparse_sampled_addmm", "SparseCsrMPS") in registered()
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import sparse_mps
from .sparse_mps import Kernels, refuse

__all__ = ["FACTORIES", "METADATA", "PRODUCTS", "REFUSED", "register", "register_products", "registered"]

#: The key of compressed (CSR, CSC, BSR, BSC) tensors on MPS.
KEY = "SparseCsrMPS"
#: Compressed-tensor metadata ops served by torch's own device-independent kernels (redispatched to this key's).
METADATA = ("crow_indices", "col_indices", "ccol_indices", "row_indices", "values", "clone", "zero_", "empty_like",
            "resize_as_sparse_", "copy_", "_to_sparse_csr", "_to_sparse_csc")
_METADATA_SOURCE = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCsrCPU)
#: Ops refused on MPS compressed tensors (where torch has no kernel either): op -> what to do instead.
REFUSED = {
    "mm.out": "call torch.mm without out= (the result is a new dense tensor)",
    "addmm.out": "call torch.addmm without out=",
    "addmv.out": "use A @ v (torch.mv) without out=",
    "bmm": "batched CSR is not supported: loop over the batch with torch.mm, or use a COO tensor (torch.bmm on MPS "
           "takes COO)",
    "baddbmm": "batched CSR is not supported: loop over the batch with torch.addmm",
    "_sparse_mm_reduce_impl": "torch.sparse.mm(a, b, reduce=...) is CPU-only: call torch.sparse.mm(a, b) for "
                              "'sum', or reduce on the CPU",
    "add.Tensor": "sparse + sparse is not implemented: add the values of tensors with the same pattern, or densify "
                  "explicitly with .to_dense()",
}

_registered: list[tuple[str, str]] = []
_libraries: list[torch.library.Library] = []


def registered() -> list[tuple[str, str]]:
    """``(aten::op, key)`` of every kernel this module registered in this process."""
    return list(_registered)


def _scalar(op: str, other: object) -> float:
    if isinstance(other, torch.Tensor):
        if other.dim() != 0 or other.layout != torch.strided:
            raise refuse(op, "only multiplication by a scalar is implemented for compressed tensors",
                         "multiply the values: torch.sparse_csr_tensor(a.crow_indices(), a.col_indices(), "
                         "a.values() * w, a.shape)")
        return other.item()
    return other  # type: ignore[return-value]


def product_kernels(kernels: Kernels = sparse_mps.OPS) -> dict[str, Callable[..., torch.Tensor]]:
    """The product kernels by aten op name, each a plain function of tensors over ``kernels``."""

    def mm(self, mat2):
        return sparse_mps.mm(self, mat2, kernels)

    def addmm(self, mat1, mat2, *, beta=1, alpha=1):
        return sparse_mps.addmm(self, mat1, mat2, beta=beta, alpha=alpha, kernels=kernels)

    def mv(self, vec):
        if vec.dim() != 1:
            raise RuntimeError(f"torch.mv: vector must be 1-D, got {vec.dim()}-D")
        return sparse_mps.mm(self, vec.unsqueeze(1), kernels, "torch.mv").squeeze(1)

    def sampled(self, mat1, mat2, *, beta=1, alpha=1):
        return sparse_mps.sampled_addmm(self, mat1, mat2, beta=beta, alpha=alpha, kernels=kernels)

    def sparse_mask(self, mask):
        return sparse_mps.sparse_mask(self, mask)

    def mul(self, other):
        if self.layout not in (torch.sparse_csr, torch.sparse_csc):
            self, other = other, self
        factor = _scalar("torch.mul", other)
        a = sparse_mps.operand("torch.mul", self)
        return sparse_mps._compressed_like(self, a.values * factor)

    return {"mm": mm, "addmm": addmm, "mv": mv, "sparse_sampled_addmm": sampled, "sparse_mask": sparse_mask,
            "mul.Tensor": mul}


#: The product ops registered for SparseCsrMPS.
PRODUCTS = tuple(product_kernels())


def _metadata_kernel(name: str) -> Callable[..., torch.Tensor]:
    overload = _overload(name)

    def kernel(*args, **kwargs):
        return overload.redispatch(_METADATA_SOURCE, *args, **kwargs)

    return kernel


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, variant = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), variant or "default")


def _refusal(name: str, instead: str) -> Callable[..., torch.Tensor]:
    def kernel(*args, **kwargs):
        raise refuse(f"aten::{name}", "not implemented for compressed sparse tensors", instead)

    return kernel


def _dense_to_csr(self, dense_dim=None):
    if dense_dim:
        raise refuse("Tensor.to_sparse_csr", f"dense_dim={dense_dim}", "convert a 2-D matrix without dense dims")
    return sparse_mps.dense_to_csr(self)


def _coo_to_csr(self, dense_dim=None):
    if self.sparse_dim() != 2 or self.dense_dim() != 0 or dense_dim:
        raise refuse("Tensor.to_sparse_csr", f"a COO tensor of shape {tuple(self.shape)} with {self.dense_dim()} "
                     "dense dims", "convert a 2-D COO matrix without dense dims")
    c = self.coalesce()
    idx = c.indices()
    crow = sparse_mps.indices_coo_to_csr(idx[0].contiguous(), self.shape[0])
    return torch.sparse_csr_tensor(crow, idx[1].contiguous(), c.values(), size=self.shape, check_invariants=False)


def _coo_rows_to_crow(self, size, *, out_int32=False):
    return sparse_mps.indices_coo_to_csr(self, size, out_int32=out_int32)


def _crow_to_coo(crow_indices, col_indices, *, out_int32=False, transpose=False):
    dtype = torch.int32 if out_int32 else torch.int64
    n = crow_indices.numel() - 1
    rows = torch.repeat_interleave(torch.arange(n, device=crow_indices.device, dtype=dtype),
                                   crow_indices[1:] - crow_indices[:-1], output_size=col_indices.numel())
    pair = (col_indices.to(dtype), rows) if transpose else (rows, col_indices.to(dtype))
    return torch.stack(pair)


#: Conversions registered for (op, key): creation of CSR tensors on MPS without a CPU round trip.
FACTORIES = {("_to_sparse_csr", "MPS"): _dense_to_csr, ("_to_sparse_csr", "SparseMPS"): _coo_to_csr,
             ("_convert_indices_from_coo_to_csr", "MPS"): _coo_rows_to_crow,
             ("_convert_indices_from_csr_to_coo", "MPS"): _crow_to_coo}


def _impl(lib: torch.library.Library, name: str, key: str, fn: Callable[..., torch.Tensor], *, only_missing: bool
          ) -> None:
    qualified = "aten::" + name.split(".")[0]
    overload = _overload(name)
    if only_missing and torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key):
        return
    lib.impl(name, fn, key)
    _registered.append((overload.name() if "." in name else qualified, key))


def register_products(key: str, kernels: Kernels = sparse_mps.OPS, *, only_missing: bool = True
                      ) -> torch.library.Library:
    """Register the product kernels (over ``kernels``) for dispatch key ``key`` and return the library holding them.

    Used for :data:`KEY` at import; the tests register them for ``SparseCsrCPU`` in a separate process, to run
    torch's own API and derivative formulas through them with CPU tensors.
    """
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in product_kernels(kernels).items():
        _impl(lib, name, key, fn, only_missing=only_missing)
    _libraries.append(lib)
    return lib


def register() -> None:
    """Register everything for the MPS keys (idempotent; only where torch has no kernel)."""
    if _libraries:
        return
    register_products(KEY)
    lib = torch.library.Library("aten", "IMPL")
    for name in METADATA:
        _impl(lib, name, KEY, _metadata_kernel(name), only_missing=True)
    for name, instead in REFUSED.items():
        _impl(lib, name, KEY, _refusal(name, instead), only_missing=True)
    for (name, key), fn in FACTORIES.items():
        _impl(lib, name, key, fn, only_missing=True)
    _libraries.append(lib)


register()
