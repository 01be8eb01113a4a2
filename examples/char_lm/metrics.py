"""Training metrics that stay on the device until they are read, and the timing of sampled steps.

A training step only adds its loss to a device tensor (:class:`DeviceMean`); the host reads that tensor
every N steps, which is the one place the host waits for the device. Step times come from the wall-clock
time between two reads (each read waits for the queued work, so a window's time is the device's time for
its steps); forward and backward times come from a few sampled steps timed with synchronisation
(:class:`PhaseTimer`), outside the steady-state path.

Example:
    >>> acc = DeviceMean(torch.device("cpu"))
    >>> for v in (1.0, 2.0, 3.0):
    ...     acc.add(torch.tensor(v))
    >>> acc.read(), acc.count
    (2.0, 0)
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from torch_sparse_metal.timing import synchronize

__all__ = ["DeviceMean", "PhaseTimer", "StepClock", "median_window_ms", "nats_to_bpc", "synchronize"]

LN2 = math.log(2.0)


def nats_to_bpc(nats: float) -> float:
    """Cross-entropy in nats per character to bits per character.

    Example:
        >>> round(nats_to_bpc(math.log(2.0)), 6)
        1.0
    """
    return nats / LN2


class DeviceMean:
    """Mean of scalar tensors accumulated on their device; :meth:`read` is its only host read.

    The sum is float32 on every device (MPS has no float64), so a resumed run on any device continues the
    same arithmetic; windows are a few hundred steps, well inside float32's precision.
    """

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.count = 0

    def add(self, value: torch.Tensor) -> None:
        """Queue ``total += value`` on the device (no host wait)."""
        self.add_on_device(value)
        self.count += 1

    def add_on_device(self, value: torch.Tensor) -> None:
        """Only the device half of :meth:`add` (``total += value``), the part a CUDA graph captures; whoever replays
        the graph counts each replay (``count += 1``)."""
        self.total.add_(value.detach())

    def read(self) -> float | None:
        """The mean since the last read (``None`` when nothing was added), then reset. Waits for the device."""
        if self.count == 0:
            return None
        mean = self.total.item() / self.count
        self.total.zero_()
        self.count = 0
        return mean

    def state_dict(self) -> dict:
        return {"total": self.total.detach().cpu().clone(), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total.copy_(state["total"])
        self.count = state["count"]


class StepClock:
    """Training time that excludes pauses (evaluation, checkpoints), and per-window step times.

    Call :meth:`window` right after a host read of device results: the time since the previous window,
    divided by the steps in between, is the step time of that window. ``step`` is the step the clock starts
    at (a resumed run's), so the first window counts only the steps taken since then.

    Example:
        >>> clock = StepClock(elapsed=60.0, step=1000)
        >>> ms = clock.window(1010)  # ten steps since the start, not 1010
        >>> clock.window_ms == [ms] and ms < 1000.0
        True
    """

    def __init__(self, elapsed: float = 0.0, window_ms: list[float] | None = None, step: int = 0) -> None:
        self._base = elapsed
        self._start = time.perf_counter()
        self._paused_at: float | None = None
        self._window_start = self._start
        self._window_step = step
        self.window_ms = window_ms if window_ms is not None else []  # appended to in place

    def elapsed(self) -> float:
        """Seconds of training so far (including the time before a resume)."""
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return self._base + now - self._start

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    def resume(self, step: int) -> None:
        """Continue counting; the next window starts now, at ``step``."""
        if self._paused_at is not None:
            self._start += time.perf_counter() - self._paused_at
            self._paused_at = None
        self._window_start, self._window_step = time.perf_counter(), step

    def window(self, step: int) -> float | None:
        """Close the window at ``step``; returns its mean step time in ms (None for an empty window)."""
        now = time.perf_counter()
        steps = step - self._window_step
        ms = (now - self._window_start) * 1e3 / steps if steps > 0 else None
        if ms is not None:
            self.window_ms.append(ms)
        self._window_start, self._window_step = now, step
        return ms


def median_window_ms(window_ms: list[float]) -> float | None:
    """Median step time over windows; the first (warm-up, allocator growth) is left out when others exist.

    Example:
        >>> median_window_ms([50.0, 10.0, 12.0, 11.0])
        11.0
    """
    windows = window_ms[1:] or window_ms
    return statistics.median(windows) if windows else None


class PhaseTimer:
    """Times the phases of a sampled step, synchronising the device around each phase.

    Example:
        >>> timer = PhaseTimer(torch.device("cpu"))
        >>> with timer.phase("forward"):
        ...     _ = torch.ones(4).sum()
        >>> sorted(timer.medians())
        ['forward']
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: dict[str, list[float]] = {}

    def phase(self, name: str):
        return _Phase(self, name)

    def medians(self) -> dict[str, float]:
        """Median milliseconds of each phase over the sampled steps."""
        return {name: statistics.median(v) for name, v in self.samples.items() if v}


class _Phase:
    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        synchronize(self.timer.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        synchronize(self.timer.device)
        self.timer.samples.setdefault(self.name, []).append((time.perf_counter() - self.t0) * 1e3)
