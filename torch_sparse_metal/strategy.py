"""Backward strategies and the per-device rule behind ``backward="auto"``.

``fused_atomic``: one pass; a worker owns (source, batch chunk) of grad_x and adds into grad_w atomically.
``atomic_free``: two passes with exclusive ownership: grad_w per edge, then grad_x per source.

``auto`` is resolved when the backward runs. By default it is tuned on the machine (:mod:`torch_sparse_metal.tuning`:
the first backward of a size bucket times both strategies, once, and the decision is cached on disk). Without
tuning (``TORCH_SPARSE_METAL_TUNE=0``, or where tensors are not real) it follows this static rule, from the device
and the problem size only (never from tensor values, so it costs no host synchronisation):

- MPS: ``fused_atomic``. The published M1 Pro figures (docs/metal.md) have it 2.8-10x faster than
  ``atomic_free``.
- CUDA: the rule in :mod:`torch_sparse_metal._cuda_auto`, derived from H200 measurements (fused_atomic at
  every measured size).
- CPU: ``fused_atomic``. Measured with ``python -m torch_sparse_metal.bench --device cpu`` (methods
  interleaved, median of 31) on a 2-core AMD EPYC (Zen 3) with torch 2.13 and the AVX2 float32 kernels:
  fused 2.14 / 10.4 / 37.8 ms against two-pass 2.99 / 12.3 / 48.7 ms at 1024x1024 5%, 4096x4096 1% and 5%
  (batch 256), 1.2-1.4x (and 1.38-1.43x at 1024x1024 in three more runs); the fused pass reads each
  output-gradient tile once where the two-pass strategy reads it twice.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from . import tuning
from ._cuda_auto import choose_cuda_strategy

__all__ = ["CONCRETE", "Strategy", "parse_strategy", "resolve_strategy", "static_strategy"]


class Strategy(str, enum.Enum):
    FUSED_ATOMIC = "fused_atomic"
    ATOMIC_FREE = "atomic_free"
    AUTO = "auto"


def parse_strategy(value: str | Strategy) -> str:
    """Validate a user's strategy name and return its canonical string.

    Example:
        >>> parse_strategy("atomic_free")
        'atomic_free'
    """
    try:
        return Strategy(value).value
    except ValueError:
        choices = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"backward must be one of {choices}, got {value!r}") from None


#: The strategies ``auto`` chooses between.
CONCRETE = (Strategy.FUSED_ATOMIC.value, Strategy.ATOMIC_FREE.value)


def resolve_strategy(strategy: str, device: torch.device, in_features: int, out_features: int, nnz: int,
                     batch: int, *, dtype: torch.dtype = torch.float32,
                     measure: Callable[[str], object] | None = None) -> str:
    """The concrete strategy a backward on ``device`` with these sizes runs.

    ``auto``: the tuned decision for this size bucket on this machine (:mod:`torch_sparse_metal.tuning`); if
    there is none yet and ``measure`` (a backward with a given strategy on real tensors) is given, it is tuned
    now; otherwise, or with ``TORCH_SPARSE_METAL_TUNE=0``, the static rule above.
    """
    if strategy != Strategy.AUTO.value:
        return strategy
    if tuning.enabled():
        bucket = tuning.bucket_key(dtype, in_features, out_features, nnz, batch)
        tuned = tuning.choose(device, bucket, CONCRETE, measure)
        if tuned is not None:
            return tuned
    return static_strategy(device, in_features, out_features, nnz, batch)


def static_strategy(device: torch.device, in_features: int, out_features: int, nnz: int, batch: int) -> str:
    """The documented rule ``auto`` follows without tuning."""
    if device.type == "cuda":
        return choose_cuda_strategy(in_features, out_features, nnz, batch)
    return Strategy.FUSED_ATOMIC.value
