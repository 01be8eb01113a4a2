"""torch_sparse_metal: unstructured-sparse (CSR) linear layers for PyTorch, with Metal, CUDA and CPU kernels.

Example:
    >>> import torch
    >>> from torch_sparse_metal import SparseLinear
    >>> layer = SparseLinear(128, 64, density=0.05)
    >>> layer(torch.randn(8, 128)).shape
    torch.Size([8, 64])
"""

from __future__ import annotations

# Import order matters: _C registers the op schemas and the CPU/CUDA kernels; then ops/ (each op family's fake
# kernels, vmap rules and autograd rule) and the MPS kernels (which compile nothing until an MPS tensor arrives)
# attach to them.
import torch  # noqa: F401  # isort: skip  (loads libtorch, which _C links against)

from . import _C  # noqa: F401  # isort: skip
from . import ops  # noqa: F401  # isort: skip
from .backends import cpu as _cpu  # noqa: F401  # isort: skip
from .backends import cuda as _cuda  # noqa: F401  # isort: skip
from .backends import mps as _mps  # noqa: F401  # isort: skip
from . import sparse_mps_ops as _sparse_mps_ops  # noqa: F401  # isort: skip
from . import followers as _followers  # noqa: F401  (AveragedModel of SparseLinear: index buffers copied)
from . import timing, tuning  # noqa: F401  (the tuner and its timer: torch_sparse_metal.tuning.enable())
from ._version import __version__ as __version__
from .checkpoint import load_sparse_checkpoint
from .convert import sparsify
from .delta import SparseDelta
from .finetune import add_sparse_deltas, load_deltas, merge_and_unload, save_deltas
from .functional import sparse_linear
from .nn import SparseLinear
from .ops import check_index_errors
from .strategy import Strategy
from .topology import CSRTopology

__all__ = ["CSRTopology", "SparseDelta", "SparseLinear", "Strategy", "add_sparse_deltas", "check_index_errors",
           "load_deltas", "load_sparse_checkpoint", "merge_and_unload", "save_deltas", "sparse_linear", "sparsify"]
