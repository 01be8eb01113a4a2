"""Registers torch's sparse CSR / CSC matrix products on MPS (``aten`` kernels for the ``SparseCsrMPS``,
``SparseMPS`` and ``MPS`` keys), computed by the Metal kernels of ``SparseLinear``; the math is
:mod:`torch_sparse_metal.sparse_mps`, loaded on the first call. Registers nothing torch already has for a key,
compiles nothing, and touches no CPU or CUDA key (docs/torch_sparse_mps.md).

Registered: :data:`PRODUCTS`; :data:`METADATA` that torch's MPS wheels lack (torch's own device-independent kernels
of ``SparseCsrCPU``, by redispatch: they read the members, move no data); :data:`FACTORIES`; :data:`REFUSED`.

Example:
    >>> import torch, torch_sparse_metal
    >>> torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "SparseCsrMPS")
    True
    >>> ("aten::sparse_sampled_addmm", "SparseCsrMPS") in registered()
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FACTORIES", "KEY", "METADATA", "PRODUCTS", "REFUSED", "register", "register_products", "registered"]

#: The key of compressed (CSR, CSC, BSR, BSC) tensors on MPS.
KEY = "SparseCsrMPS"
#: The product kernels (``sparse_mps.product_kernels``), registered for :data:`KEY`.
PRODUCTS = ("mm", "addmm", "mv", "sparse_sampled_addmm", "sparse_mask", "mul.Tensor")
#: Compressed-tensor metadata ops served by torch's own device-independent kernels.
METADATA = ("crow_indices", "col_indices", "ccol_indices", "row_indices", "values", "clone", "zero_", "empty_like",
            "resize_as_sparse_", "copy_", "_to_sparse_csr", "_to_sparse_csc")
_METADATA_SOURCE = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCsrCPU)
#: (op, key) -> the function of ``sparse_mps`` that implements it: CSR tensors made on the device.
FACTORIES = {("_to_sparse_csr", "MPS"): "dense_to_csr", ("_to_sparse_csr", "SparseMPS"): "coo_to_csr",
             ("_convert_indices_from_coo_to_csr", "MPS"): "indices_coo_to_csr",
             ("_convert_indices_from_csr_to_coo", "MPS"): "indices_csr_to_coo"}
#: Ops refused on MPS compressed tensors: op -> what to do instead.
REFUSED = {
    "mm.out": "call torch.mm without out= (the result is a new dense tensor)",
    "addmm.out": "call torch.addmm without out=",
    "addmv.out": "use A @ v (torch.mv) without out=",
    "bmm": "batched CSR is not supported: loop over the batch with torch.mm, or use COO (torch.bmm on MPS takes it)",
    "baddbmm": "batched CSR is not supported: loop over the batch with torch.addmm",
    "_sparse_mm_reduce_impl": "torch.sparse.mm(a, b, reduce=) is CPU-only: drop reduce= for 'sum', or use the CPU",
    "add.Tensor": "sparse + sparse is not implemented: add the values of same-pattern tensors, or use .to_dense()",
}

_registered: list[tuple[str, str]] = []
_libraries: list[torch.library.Library] = []


def _math() -> Any:  # the math, loaded on the first call
    return importlib.import_module("torch_sparse_metal.sparse_mps")


def registered() -> list[tuple[str, str]]:
    """``(aten::op[.overload], key)`` of every kernel this module registered in this process."""
    return list(_registered)


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, variant = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), variant or "default")


def _product(name: str, kernels: Any) -> Callable[..., Any]:
    table: dict[str, Callable[..., Any]] = {}

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not table:
            table.update(_math().product_kernels(_math().OPS if kernels is None else kernels))
        return table[name](*args, **kwargs)

    return kernel


def _metadata(name: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: _overload(name).redispatch(_METADATA_SOURCE, *args, **kwargs)


def _factory(function: str) -> Callable[..., Any]:
    return lambda *args, **kwargs: getattr(_math(), function)(*args, **kwargs)


def _refusal(name: str, instead: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise _math().refuse(f"aten::{name}", "not implemented for compressed sparse tensors", instead)

    return kernel


def _impl(lib: torch.library.Library, name: str, key: str, fn: Callable[..., Any], only_missing: bool) -> None:
    qualified = _overload(name).name()
    if only_missing and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
        return
    lib.impl(name, fn, key)
    _registered.append((qualified if "." in name else qualified.split(".")[0], key))


def register_products(key: str, kernels: Any = None, *, only_missing: bool = True) -> torch.library.Library:
    """Register the product kernels (over ``kernels``, default the ops of the extension) for dispatch key ``key``;
    returns the library holding them. The tests register them for ``SparseCsrCPU`` in a separate process, to run
    torch's API and derivative formulas through them with CPU tensors."""
    lib = torch.library.Library("aten", "IMPL")
    for name in PRODUCTS:
        _impl(lib, name, key, _product(name, kernels), only_missing)
    _libraries.append(lib)
    return lib


def register() -> None:
    """Register everything for the MPS keys (idempotent; only where torch has no kernel)."""
    if _libraries:
        return
    register_products(KEY)
    lib = torch.library.Library("aten", "IMPL")
    for name in METADATA:
        _impl(lib, name, KEY, _metadata(name), True)
    for name, instead in REFUSED.items():
        _impl(lib, name, KEY, _refusal(name, instead), True)
    for (name, key), function in FACTORIES.items():
        _impl(lib, name, key, _factory(function), True)
    _libraries.append(lib)


register()
