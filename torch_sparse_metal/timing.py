"""Host-side timing shared by the tuner, the self-check and the benchmark scripts.

Example:
    >>> median_ms(lambda: sum(range(100)), torch.device("cpu"), reps=3) >= 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_ms", "synchronize", "wall_ms"]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall milliseconds of one call of ``fn`` and a synchronisation (the device's queue is assumed idle)."""
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall milliseconds of ``reps`` calls, each followed by a synchronisation, after one warm-up call."""
    fn()
    synchronize(device)
    return statistics.median(wall_ms(fn, device) for _ in range(reps))
