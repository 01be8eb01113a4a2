"""torch_sparse_metal: unstructured-sparse (CSR) linear layers for PyTorch, with Metal, CUDA and CPU kernels.

Example:
    >>> import torch
    >>> from torch_sparse_metal import SparseLinear
    >>> layer = SparseLinear(128, 64, density=0.05)
    >>> layer(torch.randn(8, 128)).shape
    torch.Size([8, 64])
"""

from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers the op schemas and the CPU/CUDA kernels)
from . import _autograd, _fake  # noqa: F401  (fake kernels and the autograd rule)
from .functional import sparse_linear
from .nn import SparseLinear
from .strategy import Strategy
from .topology import CSRTopology

__all__ = ["CSRTopology", "SparseLinear", "Strategy", "sparse_linear"]
__version__ = "0.1.0"
