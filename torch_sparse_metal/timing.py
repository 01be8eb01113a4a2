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

__all__ = ["median_ms", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall milliseconds of ``reps`` calls, each followed by a synchronisation, after one warm-up call."""
    fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
