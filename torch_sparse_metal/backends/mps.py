"""The MPS backend: its declaration, and the host code of the ``csr_linear`` ops, which registers their ``"mps"``
kernels (``torch_sparse_metal::csr_linear`` and ``csr_linear_backward``) once for every layout: the unstructured
layout's kernels are ``shaders/csr_linear.metal``'s, run here; another layout's (the vector layout's, a weight
``[vectors, V]``) are its own host's (``backends/mps_<layout>_csr_linear.py``, :func:`layout_hosts`), which this
host holds and sends such calls to. The machinery every host shares is :mod:`.metal`.

All dispatch logic lives in :class:`MetalCsrLinear`, parameterised by the compile function, so the very same
code (argument order, scalar widths, grid and threadgroup sizes) runs in CI with CPU tensors under the
MSL-on-CPU executor (:func:`tsm_dev.msl.compile_shader`). Nothing here waits on the
device: checks look at metadata only and kernels are encoded on the current MPS stream.

Example (on CPU tensors, with the MSL-on-CPU executor as ``compile_shader``, as the tests run it; on a Mac,
``torch.mps.compile_shader`` and ``device_type="mps"``)::

    >>> metal = MetalCsrLinear(compile_shader, device_type="cpu")
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> # one edge: input 1 -> output 0, weight 2
    >>> y = metal.forward(torch.tensor([[1.0, 3.0]]), torch.tensor([2.0]), i32(0, 0, 1), i32(0), i32(1),
    ...                   i32(0, 1), i32(1), i32(0))
    >>> y.tolist()
    [[6.0]]
"""

from __future__ import annotations

import platform

import torch

from torch_sparse_metal import _autotune
from torch_sparse_metal.backends import Backend, cpu_model
from torch_sparse_metal.backends import register as register_backend
from torch_sparse_metal.backends.metal import (
    COMMON_HEADER,
    KERNEL_DTYPES,
    MPS_ERROR_WORDS,
    check_mps_support,
    use_reference,
)
from torch_sparse_metal.backends.mps_unstructured_csr_linear import (
    BLOCK_ELEMS,
    CONSTANTS,
    PLAIN_STAGES,
    SHADER_FILES,
    SPMM_KERNELS,
    TILE_WIDTH,
    TILED_STAGES,
    VALUES_PER_LANE,
    VARIANT_OPS,
    VARIANTS,
    WINDOW_ROWS,
    MetalCsrLinear,
    kernel_names,
    layout_hosts,
    load_source,
    values_per_lane,
)

__all__ = [
    "BACKEND",
    "BLOCK_ELEMS",
    "COMMON_HEADER",
    "CONSTANTS",
    "KERNEL_DTYPES",
    "PLAIN_STAGES",
    "SHADER_FILES",
    "SPMM_KERNELS",
    "TILED_STAGES",
    "TILE_WIDTH",
    "VALUES_PER_LANE",
    "VARIANTS",
    "VARIANT_OPS",
    "WINDOW_ROWS",
    "MetalCsrLinear",
    "check_mps_support",
    "default",
    "kernel_names",
    "layout_hosts",
    "load_source",
    "register",
    "use_reference",
    "values_per_lane",
]

# ------------------------------------------------------------------------------------ MPS registration
_default: MetalCsrLinear | None = None


def default() -> MetalCsrLinear:
    """The process-wide instance on MPS, compiling with ``torch.mps.compile_shader`` on first use."""
    global _default
    if _default is None:
        _default = MetalCsrLinear(lambda src: torch.mps.compile_shader(src), "mps", check_platform=check_mps_support,
                                  error_words=MPS_ERROR_WORDS)
    return _default


def _csr_linear_mps(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, backward):
    return default().forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm)


def _csr_linear_backward_mps(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
    return default().backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy)


_registered = False
BACKEND = register_backend(Backend(
    "mps",
    is_available=torch.backends.mps.is_available,
    synchronize=lambda device: torch.mps.synchronize(),
    describe=lambda device: f"mps {cpu_model()} macOS {platform.mac_ver()[0]}",
    records_index_errors=True,
    variants=VARIANTS,
))
_autotune.register_variants("mps", VARIANTS, VARIANT_OPS)


def register() -> bool:
    """Register the ``"mps"`` kernels of both ops, both layouts; idempotent. Harmless without MPS (nothing is compiled
    until an MPS tensor arrives). Returns False when the op schemas (the ``_C`` extension) are not loaded."""
    global _registered
    if _registered:
        return True
    ns = torch.ops.torch_sparse_metal
    try:
        ns.csr_linear, ns.csr_linear_backward  # noqa: B018 - raises if the schemas are not defined
    except (AttributeError, RuntimeError):
        return False
    torch.library.register_kernel("torch_sparse_metal::csr_linear", "mps", _csr_linear_mps)
    torch.library.register_kernel("torch_sparse_metal::csr_linear_backward", "mps", _csr_linear_backward_mps)
    torch.library.register_kernel("torch_sparse_metal::take_index_errors", "mps",
                                  lambda like: default().take_index_errors(like.device))
    _registered = True
    return True


register()
