"""The MPS backend: its declaration, and the registrar and router of the ``csr_linear`` ops' ``"mps"`` kernels
(``torch_sparse_metal::csr_linear``, ``csr_linear_backward``, ``take_index_errors``), registered once for every
layout. Each layout of the contract (``contract.LAYOUTS``) has its Metal host in a file of its own,
``backends/mps_<layout>_csr_linear.py`` (:func:`layout_hosts`): the unstructured layout's
(:mod:`.mps_unstructured_csr_linear`) and the vector layout's (:mod:`.mps_vector_csr_linear`). :class:`MetalCsrLinear`
checks each call once and sends it to the host of its weight's layout. The machinery every host shares is
:mod:`.metal`.

Example (on CPU tensors, with the MSL-on-CPU executor as ``compile_shader``, as the tests run it; on a Mac,
``torch.mps.compile_shader`` and ``device_type="mps"``)::

    >>> metal = MetalCsrLinear(compile_shader, device_type="cpu")
    >>> i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    >>> # one edge: input 1 -> output 0, weight 2
    >>> y = metal.forward(torch.tensor([[1.0, 3.0]]), torch.tensor([2.0]), i32(0, 0, 1), i32(0), i32(1),
    ...                   i32(0, 1), i32(1), i32(0))
    >>> y.tolist(), sorted(metal.layouts)
    ([[6.0]], ['unstructured', 'vector'])
"""

from __future__ import annotations

import importlib
import platform
from collections.abc import Callable
from typing import Any

import torch

from torch_sparse_metal import _autotune
from torch_sparse_metal.backends.metal import (
    COMMON_HEADER,
    KERNEL_DTYPES,
    MPS_ERROR_WORDS,
    MetalHost,
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
    MetalUnstructuredCsrLinear,
    kernel_names,
    load_source,
    values_per_lane,
)
from torch_sparse_metal.contract import LAYOUTS
from torch_sparse_metal.devices import Backend, cpu_model
from torch_sparse_metal.devices import register as register_backend
from torch_sparse_metal.ops._csr_linear import check_backward, check_backward_argument, check_forward

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
    "MetalUnstructuredCsrLinear",
    "check_mps_support",
    "default",
    "kernel_names",
    "layout_hosts",
    "load_source",
    "register",
    "use_reference",
    "values_per_lane",
]


def layout_hosts() -> dict[str, type[MetalHost]]:
    """The Metal host class of every layout of the contract (``contract.LAYOUTS``): ``HOST`` of
    ``backends/mps_<layout>_csr_linear.py``, so a layout added to ``csrc/contract.h`` without its Metal host fails
    at import, naming the module it needs.

    Example:
        >>> sorted(layout_hosts())
        ['unstructured', 'vector']
    """
    return {name: importlib.import_module(f"torch_sparse_metal.backends.mps_{name}_csr_linear").HOST
            for name in LAYOUTS}


class MetalCsrLinear(MetalUnstructuredCsrLinear):
    """The entry of the ``"mps"`` kernels: checks each call once and sends it to the host of its weight's layout
    (:attr:`layouts`, one per layout of the contract). It is the unstructured layout's host itself (its library,
    kernels and settings), so that host is not built twice.

    Arguments as for :class:`.mps_unstructured_csr_linear.MetalUnstructuredCsrLinear`; the other layouts' hosts get
    the same compile function, device type, poisoning, platform check and error words.
    """

    def __init__(self, compile_fn: Callable[[str], Any], device_type: str = "mps", *, poison: bool | None = None,
                 check_platform: Callable[[], None] | None = None, values_per_lane: int | None = None,
                 spmm: str | None = None, error_words: dict[torch.device, torch.Tensor] | None = None):
        super().__init__(compile_fn, device_type, poison=poison, check_platform=check_platform,
                         values_per_lane=values_per_lane, spmm=spmm, error_words=error_words)
        #: Each layout's host by name, as :func:`layout_hosts` lists them (this one for the unstructured layout).
        self.layouts: dict[str, MetalHost] = {}
        for name, host in layout_hosts().items():
            if isinstance(self, host):
                self.layouts[name] = self
            else:
                self.layouts[name] = host(compile_fn, device_type, poison=self.poison, check_platform=check_platform,
                                          error_words=self._error_words)
        # The host of a checked weight by (rank, block), the pairs that tell the layouts apart (contract.layout_of).
        self._host_by_shape = {(LAYOUTS[name].rank, block): host for name, host in self.layouts.items()
                               for block in LAYOUTS[name].blocks}

    @property
    def vector(self) -> MetalHost:
        """The vector layout's host (``self.layouts["vector"]``)."""
        return self.layouts["vector"]

    def forward(self, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor, dst: torch.Tensor,
                src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor, perm: torch.Tensor
                ) -> torch.Tensor:
        """The forward on the host of ``weight``'s layout, arguments as in the op contract."""
        self._check_device(x)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        sizes = check_forward(x, weight, *index)
        return self._host_by_shape[weight.dim(), sizes.block].run_forward(x, weight, index, sizes)

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, row_ptr: torch.Tensor,
                 dst: torch.Tensor, src: torch.Tensor, col_ptr: torch.Tensor, src_by_dst: torch.Tensor,
                 perm: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The backward on the host of ``weight``'s layout with a concrete ``strategy`` of the contract (``"auto"``
        is resolved by the autograd rule before any backend runs, and rejected here as by the CPU and CUDA
        kernels)."""
        self._check_device(x)
        index = (row_ptr, dst, src, col_ptr, src_by_dst, perm)
        sizes = check_backward(grad_out, x, weight, *index, strategy)
        return self._host_by_shape[weight.dim(), sizes.block].run_backward(grad_out, x, weight, index, sizes,
                                                                           strategy)


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
    check_backward_argument(backward)
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
