"""The ops: one module per op family (``ops/_<op>.py``: its typed wrappers over ``torch.ops.torch_sparse_metal.*``,
Python-boundary checks, fake kernels, vmap rules and autograd rule; schemas in ``csrc/<op>.cpp``), each imported
here, so that a new family's module registers itself; and :func:`check_index_errors`, which every op's GPU index
guards report through.

A family's module is private (``_csr_linear``) and its public wrappers are re-exported here, so that the wrapper
``ops.csr_linear`` and the module never share a name.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch

from .. import devices
from ..contract import INDEX_ARRAYS

# Every op-family module, in name order: importing one registers its fake kernels, vmap rules and autograd rule.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

from ._csr_linear import csr_linear, csr_linear_backward  # noqa: E402

__all__ = ["check_index_errors", "csr_linear", "csr_linear_backward"]


def check_index_errors(device: torch.device | str | None = None) -> None:
    """Raise if a CUDA or Metal kernel on ``device`` met an out-of-range index since the last check.

    The GPU kernels do not read index values on the host (that would wait for the device in every call): they
    clamp each index they read into its tensor, so that a malformed topology cannot reach other memory, and
    record the index array it came from. This reads and clears those records, waiting for the device; call it
    where the program synchronises anyway (``DynamicSparsity`` and the training loop do). The CPU kernels check
    index values before they run, so on the CPU this never raises. ``None``: the first available device whose
kernels record errors (CUDA, else MPS), else the CPU.

    Example:
        >>> check_index_errors("cpu")
    """
    if device is None:
        device = next((name for name in devices.available() if devices.get(name).records_index_errors), "cpu")
    like = torch.empty(0, device=device)
    backend = devices.get(like.device.type)
    if backend is None or not backend.records_index_errors:  # no kernels there, or none that record errors
        return
    bad = [name for name, word in zip(INDEX_ARRAYS, torch.ops.torch_sparse_metal.take_index_errors(like)) if word]
    if bad:
        raise RuntimeError(f"torch_sparse_metal: a kernel on {like.device} read out-of-range values of "
                           f"{', '.join(bad)} (a malformed topology given to the ops: pointer arrays must start at "
                           "0, never decrease and end at nnz; indices must lie inside the dimension they index). "
                           "The results computed with it are meaningless; build index tensors with CSRTopology, "
                           "which validates them")
