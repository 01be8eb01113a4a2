"""The CUDA backend's declaration (its kernels are C++, csrc/cuda, registered with the op schemas)."""

from __future__ import annotations

import torch

from ..devices import Backend, register

__all__ = ["BACKEND"]

BACKEND = register(Backend(
    "cuda",
    is_available=torch.cuda.is_available,
    synchronize=torch.cuda.synchronize,
    describe=torch.cuda.get_device_name,
    records_index_errors=True,
))
