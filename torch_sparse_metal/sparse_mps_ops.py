"""Registers torch's sparse CSR / CSC matrix products on MPS (``aten`` kernels for the ``SparseCsrMPS``,
``SparseMPS`` and ``MPS`` keys), computed by the Metal kernels of ``SparseLinear``; the math is
:mod:`torch_sparse_metal.sparse_mps`.

What it registers, and only that: an ``(op, key)`` of :data:`PRODUCTS`, :data:`METADATA` (torch's own SparseCsrCPU
kernels, by redispatch), :data:`FACTORIES` or :data:`REFUSED` for which torch has no kernel of its own for that key
and no CompositeImplicitAutograd one (:func:`plan`; :func:`skipped` says why an entry was left to torch), so nothing
torch computes is replaced; no CPU or CUDA key is touched, nothing is compiled, and each kernel is made on its first
call (:func:`kernel`). :func:`registered` lists what is registered now. Importing the package registers
(:func:`register`) unless the environment sets ``TORCH_SPARSE_METAL_SPARSE_MPS=0`` (:data:`SWITCH`);
:func:`unregister` takes every registration back at run time and :func:`register` puts them back.

Example:
    >>> import torch, torch_sparse_metal
    >>> torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "SparseCsrMPS")
    True
    >>> ("aten::sparse_sampled_addmm", "SparseCsrMPS") in registered() and skipped() == {}
    True
    >>> unregister(); torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "SparseCsrMPS"), registered()
    (False, [])
    >>> len(register()) == len(entries())
    True
    >>> list(plan(lambda name: name != "mv", lambda name, key: False)[1])  # a torch without aten::mv
    [('aten::mv', 'SparseCsrMPS')]
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import settings, sparse_mps

__all__ = ["FACTORIES", "KEY", "METADATA", "PRODUCTS", "REFUSED", "SWITCH", "entries", "plan", "register",
           "register_products", "registered", "skipped", "to_register", "unregister", "CPU_STAND_INS", "kernel",
           "on_cpu_keys"]

#: The environment setting (a boolean, default on) read at import: off, the import registers nothing.
SWITCH = "TORCH_SPARSE_METAL_SPARSE_MPS"

#: The key of compressed (CSR, CSC, BSR, BSC) tensors on MPS.
KEY = "SparseCsrMPS"
#: The product kernels (``sparse_mps.product_kernels``), registered for :data:`KEY`.
PRODUCTS = ("mm", "addmm", "mv", "addmv", "sparse_sampled_addmm", "sparse_mask", "mul.Tensor")
#: Compressed-tensor metadata ops that torch's MPS wheels lack, served by torch's device-independent SparseCsrCPU
#: kernels (they read the tensor's members and move no data).
METADATA = ("crow_indices", "col_indices", "ccol_indices", "row_indices", "values", "clone", "zero_", "empty_like",
            "resize_as_sparse_", "copy_", "_to_sparse_csr", "_to_sparse_csc")
#: (op, key) -> the function of ``sparse_mps`` that implements it: compressed tensors made on the device.
FACTORIES = {("_to_sparse_csr", "MPS"): "dense_to_csr", ("_to_sparse_csr", "SparseMPS"): "coo_to_csr",
             ("_to_sparse_csc", "MPS"): "dense_to_csc", ("_to_sparse_csc", "SparseMPS"): "coo_to_csc",
             ("_convert_indices_from_coo_to_csr", "MPS"): "indices_coo_to_csr",
             ("_convert_indices_from_csr_to_coo", "MPS"): "indices_csr_to_coo"}
#: Ops refused on MPS compressed tensors: op -> what to do instead.
REFUSED = {
    "mm.out": "call torch.mm without out= (the result is a new dense tensor)",
    "addmm.out": "call torch.addmm without out=",
    "addmv.out": "call torch.addmv without out= (the result is a new dense tensor)",
    "bmm": "batched CSR is not supported: loop over the batch with torch.mm, or use COO (torch.bmm on MPS takes it)",
    "baddbmm": "batched CSR is not supported: loop over the batch with torch.addmm",
    "_sparse_mm_reduce_impl": "torch.sparse.mm(a, b, reduce=) is CPU-only: drop reduce= for 'sum', or use the CPU",
    "add.Tensor": "sparse + sparse is not implemented: add the values of same-pattern tensors, or use .to_dense()",
}
_registered: list[tuple[str, str]] = []
_skipped: dict[tuple[str, str], str] = {}
_library: torch.library.Library | None = None  # what register() holds; None: nothing registered


def registered() -> list[tuple[str, str]]:
    """``(aten::op[.overload], key)`` of every kernel :func:`register` has registered and not taken back."""
    return list(_registered)


def to_register() -> list[tuple[str, str]]:
    """The ``(op, key)`` entries :func:`register` registers: those registered now, or, while none is, those
    :func:`plan` keeps (which, once ours are registered, would see them as torch's)."""
    if _library is not None:
        return [(qualified.removeprefix("aten::"), key) for qualified, key in _registered]
    return plan()[0]


def skipped() -> dict[tuple[str, str], str]:
    """``(aten::op[.overload], key)`` -> why it was not registered (torch has a kernel, or no such op)."""
    return dict(_skipped)


def entries() -> list[tuple[str, str]]:
    """Every ``(op, key)`` :func:`register` considers: products, metadata and refusals for :data:`KEY`, factories."""
    return [*((name, KEY) for name in (*PRODUCTS, *METADATA, *REFUSED)), *FACTORIES]


def _exists(name: str) -> bool:
    return hasattr(getattr(torch.ops.aten, name.split(".")[0], None), (name.split(".") + ["default"])[1])


def _has_kernel(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)


def plan(exists: Callable[[str], bool] = _exists, has_kernel: Callable[[str, str], bool] = _has_kernel
         ) -> tuple[list[tuple[str, str]], dict[tuple[str, str], str]]:
    """The :func:`entries` to register and ``(aten::op, key) -> why not`` for the rest, given which ops exist and have
    a kernel of torch's for a key (default: this process's dispatcher; the tests pass each torch version's facts). A
    CompositeImplicitAutograd kernel counts for every key (a backend kernel would bypass it and its autograd)."""
    todo, why = [], {}
    for name, key in entries():
        have = [k for k in (key, "CompositeImplicitAutograd") if exists(name) and has_kernel(name, k)]
        if not exists(name) or have:
            why[(f"aten::{name}", key)] = (f"torch has a {have[0]} kernel" if have else
                                          f"torch {torch.__version__.split('+')[0]} has no aten::{name}")
        else:
            todo.append((name, key))
    return todo, why


_METADATA_SOURCE = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCsrCPU)


@functools.lru_cache(maxsize=256)
def kernel(name: str, key: str, kernels: sparse_mps.Kernels | None = None) -> Callable[..., Any]:
    """The kernel registered for the entry ``(name, key)``: a factory (:data:`FACTORIES`), a refusal
    (:data:`REFUSED`), a redispatch to torch's ``SparseCsrCPU`` kernel (:data:`METADATA`) or a product over
    ``kernels`` (default ``sparse_mps.OPS``).

    Example:
        >>> kernel("mm", "SparseCsrMPS")(torch.eye(2).to_sparse_csr(), torch.ones(2, 1)).tolist()
        [[1.0], [1.0]]
    """
    if (name, key) in FACTORIES:  # looked up at each call
        return lambda *args, **kw: getattr(sparse_mps, FACTORIES[(name, key)])(*args, **kw)
    if name in REFUSED:
        def refusal(*args: Any, **kw: Any) -> Any:
            raise sparse_mps.refuse(f"aten::{name}", "not implemented for compressed sparse tensors", REFUSED[name])
        return refusal
    if name in METADATA:
        base, _, variant = name.partition(".")
        overload = getattr(getattr(torch.ops.aten, base), variant or "default")
        return lambda *args, **kw: overload.redispatch(_METADATA_SOURCE, *args, **kw)
    return sparse_mps.product_kernels(sparse_mps.OPS if kernels is None else kernels)[name]


#: The CPU key standing in for each MPS key when the MPS path runs on CPU tensors (:func:`on_cpu_keys`).
CPU_STAND_INS = {"SparseCsrMPS": "SparseCsrCPU", "SparseMPS": "SparseCPU", "MPS": "CPU"}


@contextlib.contextmanager
def on_cpu_keys(kernels: sparse_mps.Kernels) -> Iterator[list[tuple[str, str]]]:
    """Within the block, torch's API on CPU tensors takes the path that MPS tensors take: every kernel that this
    module registers for an MPS key (products over ``kernels``, factories, refusals) is registered for the CPU key
    standing in for it (:data:`CPU_STAND_INS`), in place of torch's; the metadata ops are torch's CPU kernels
    already (the MPS ones redispatch to them). torch's kernels come back when the block ends. For running the MPS
    path without a Mac (the self-check through the MSL-on-CPU executor, the tests); it yields the
    ``(aten::op, CPU key)`` pairs it replaced.

    Example (the extension's CPU ops as the kernels):
        >>> a = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr()
        >>> with on_cpu_keys(sparse_mps.OPS) as replaced:
        ...     y = torch.mm(a, torch.ones(2, 1))
        >>> y.tolist(), ("aten::mm", "SparseCsrCPU") in replaced
        ([[2.0], [3.0]], True)
    """
    lib = torch.library.Library("aten", "IMPL")
    replaced: list[tuple[str, str]] = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for name, key in to_register():  # what the import registers (or would, with the switch off)
                if key in CPU_STAND_INS and not (key == KEY and name in METADATA):
                    lib.impl(name, kernel(name, key, kernels), CPU_STAND_INS[key])
                    replaced.append((f"aten::{name}", CPU_STAND_INS[key]))
        yield replaced
    finally:
        lib._destroy()


def _lazy(name: str, key: str, kernels: Any = None) -> Callable[..., Any]:  # the kernel, made on its first call
    return lambda *args, **kw: kernel(name, key, kernels)(*args, **kw)


def register_products(key: str, kernels: Any = None, *, only_missing: bool = True) -> torch.library.Library:
    """Register the product kernels (over ``kernels``, default the extension's ops) for ``key`` and return the
    library holding them (the registrations last as long as it does; not recorded in :func:`registered`). For running
    the MPS path on another key, as the tests do on ``SparseCsrCPU``."""
    lib = torch.library.Library("aten", "IMPL")
    for name in PRODUCTS:
        if not (only_missing and _has_kernel(name, key)):
            lib.impl(name, _lazy(name, KEY, kernels), key)
    return lib


def register() -> list[tuple[str, str]]:
    """Register every entry :func:`plan` keeps, for the MPS keys, and return :func:`registered` (idempotent)."""
    global _library
    if _library is None:
        todo, why = plan()
        lib = torch.library.Library("aten", "IMPL")
        for name, key in todo:
            lib.impl(name, _lazy(name, key), key)
        _library = lib
        _registered[:] = [(f"aten::{name}", key) for name, key in todo]
        _skipped.clear()
        _skipped.update(why)
    return registered()


def unregister() -> None:
    """Take back every kernel :func:`register` registered: torch's dispatch for the MPS keys is as without the
    package (idempotent)."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
    _registered.clear()
    _skipped.clear()


if settings.flag(SWITCH, True):
    register()
