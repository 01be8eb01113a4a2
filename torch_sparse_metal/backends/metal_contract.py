"""What the Metal kernels are built for, read by the hosts (:mod:`.metal`), the platform checks
(:mod:`.metal_platform`) and the source loader (:mod:`.metal_source`): the Metal type of each dtype of the op contract
and the Metal language version it needs, the layout numbers the shaders are compiled with, the torch and macOS
floors, and :class:`MetalUnavailable`, the error of a family's kernels that cannot run here (raised by the platform's
errors, answered by the hosts and the reference path).

Example:
    >>> KERNEL_DTYPES[torch.float32], METAL_TYPE_VERSIONS["bfloat"], SHADER_CONSTANTS
    ('float', (310, 'macOS 14'), {'SIMD_WIDTH': 32, 'MAX_ROWS': 8})
"""

from __future__ import annotations

import torch

from torch_sparse_metal.contract import DTYPES

__all__ = ["COMMON_HEADER", "KERNEL_DTYPES", "METAL_TYPE_VERSIONS", "MIN_MACOS", "MIN_TORCH", "SHADER_CONSTANTS",
           "SIMD_WIDTH", "TARGET_ROWS", "TORCH_MIN_MACOS", "MetalUnavailable"]

#: The header of ours joined in front of every op family's shader files.
COMMON_HEADER = "csr_linear_common.h"
#: Value dtypes with Metal kernels (the op contract, csrc/contract.h), and the Metal type that names their kernels
#: (``<stage>_<type>[_p<P>]``).
KERNEL_DTYPES = {dtype: spec.metal for dtype, spec in DTYPES.items() if "mps" in spec.devices}
#: The first macOS whose Metal has a language version (``__METAL_VERSION__``) a Metal type may need.
_METAL_VERSION_MACOS = {310: "macOS 14", 320: "macOS 15", 400: "macOS 26"}
#: Metal types that need a newer Metal language than the oldest torch compiles at (the contract's dtype rows):
#: ``{type: (__METAL_VERSION__, the first macOS with it)}``. The shaders instantiate them only there
#: (``metal_source.shader_defines``), and the host refuses them clearly where they are missing.
METAL_TYPE_VERSIONS = {spec.metal: (spec.metal_version, _METAL_VERSION_MACOS[spec.metal_version])
                       for spec in DTYPES.values() if spec.metal and spec.metal_version}
#: The SIMD-group width the kernels are written for (every Apple GPU's threadExecutionWidth).
SIMD_WIDTH = 32
#: SIMD-groups per threadgroup the kernels aim for (capped by the pipeline's limits, see ``MetalHost.rows``), and the
#: most their threadgroup tiles hold.
TARGET_ROWS = 8
#: The layout numbers every family's shaders are compiled with (``metal_source.shader_defines``; ``tsm::kSimdWidth`` and
#: ``tsm::kMaxRows`` in csr_linear_common.h).
SHADER_CONSTANTS = {"SIMD_WIDTH": SIMD_WIDTH, "MAX_ROWS": TARGET_ROWS}
#: The oldest torch whose ``torch.mps.compile_shader`` the hosts use.
MIN_TORCH = (2, 7)
#: The one macOS floor of the Metal kernels: Metal 3.1 (bfloat; atomic<float> is Metal 3), which every supported
#: torch compiles at from macOS 14 on (torch's wheels from 2.12 on need macOS 14 anyway).
MIN_MACOS = (14, 0)
#: Torch releases whose own MPS needs a newer macOS than ours: (first release, macOS).
TORCH_MIN_MACOS = (((2, 15), (15, 0)),)


class MetalUnavailable(RuntimeError):
    """The Metal kernels of one family (``family``: its shader files) in one ``dtype`` cannot run here: the library
    failed to compile, or the pipeline of one of its kernels could not be created. The message says which, with the
    versions and the log to report; the calls of that family and dtype run the reference path instead."""

    def __init__(self, message: str, family: str, dtype: torch.dtype):
        super().__init__(message)
        self.family, self.dtype = family, dtype
