"""The package's one timer, used by the benchmark, the tuner, ``tune``, the self-check and the scripts in
``benchmarks/``: the median over interleaved rounds of each callable's time (docs/benchmarks.md says why).

Two methods, by device:

- **CUDA, queued rounds**: each round of calls is queued behind a spinning kernel that outlasts the host's time
  to issue the round (checked, :meth:`Timer._queued_round`), and device events bracket each call while the host
  runs ahead, as in a training loop. A call's time is its kernels and the gaps between them, not the host's
  launch latency. The host's own time inside each call is measured beside it (:attr:`Timing.host_ms`).
- **CPU and MPS, synchronised wall clock**: each call's wall time from an idle device to the end of a
  synchronisation after it, so it includes the host's time (:func:`synchronised_call`).

Synchronisation comes from the backend seam (:func:`torch_sparse_metal.devices.get`).

Example:
    >>> t = Timer(torch.device("cpu"), reps=3).many({"sum": lambda: torch.ones(8).sum()})["sum"]
    >>> t.ms > 0 and t.host_ms > 0 and t.spread_ms >= 0
    True
    >>> median_ms(lambda: sum(range(100)), torch.device("cpu"), reps=3) >= 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from . import devices

__all__ = ["Timer", "Timing", "median_ms", "synchronised_call", "synchronize", "wall_ms"]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, through its backend (nothing to wait for on the CPU or a device type
    without kernels)."""
    backend = devices.get(device.type)
    if backend is not None:
        backend.synchronize(device)


def synchronised_call(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """``(wall ms, host ms)`` of one call of ``fn`` started on an idle device: the wall time runs to the end of a
    synchronisation after the call, the host time to the call's return."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3, host * 1e3


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Synchronised wall milliseconds of one call of ``fn`` (:func:`synchronised_call`)."""
    return synchronised_call(fn, device)[0]


@dataclass(frozen=True)
class Timing:
    """One callable's times over the rounds: the median of its time (``ms``: device time on CUDA, synchronised
    wall time elsewhere), the median of the host's time inside the call (``host_ms``: Python, dispatch, checks,
    allocation, launches), and the spread of its times (``spread_ms``: max - min, the noise of the run)."""

    ms: float
    host_ms: float
    spread_ms: float = 0.0


class Timer:
    """Median times of callables on one device (:meth:`many`): one warm-up call each, then ``reps`` rounds that
    call every callable once, in alternating order (so that a slow phase of a noisy machine hits all of them
    alike and the ratios between them stay fair). With ``budget_s`` the rounds stop early where they would take
    longer than about ``budget_s`` seconds per callable (5 rounds at least).

    With ``graphs`` (CUDA), each callable is captured once in a CUDA graph and its replays are timed; callables
    whose name starts with one of ``eager`` are never captured (torch.sparse: cuSPARSE allocates inside).
    """

    def __init__(self, device: torch.device, reps: int, budget_s: float | None = None, graphs: bool = False,
                 eager: tuple[str, ...] = ("torch_sparse",)) -> None:
        self.device, self.reps, self.budget_s = device, reps, budget_s
        self.queued = device.type == "cuda"
        self.graphs, self.eager = graphs and self.queued, eager
        self._spin_cycles = 1 << 20  # the lead of a queued round, grown until the host stays ahead

    @property
    def mode(self) -> str:
        """How the times were taken, as the benchmark's rows record it."""
        if self.graphs:
            return "graph replay"
        return "events, host ahead" if self.queued else "synchronised wall"

    def many(self, fns: Mapping[str, Callable[[], object]]) -> dict[str, Timing]:
        """Each callable's :class:`Timing`."""
        samples = self.samples(fns)
        return {k: Timing(statistics.median(t for t, _ in v), statistics.median(h for _, h in v),
                          max(t for t, _ in v) - min(t for t, _ in v)) for k, v in samples.items()}

    def samples(self, fns: Mapping[str, Callable[[], object]]) -> dict[str, list[tuple[float, float]]]:
        """Each callable's ``(ms, host ms)`` per round."""
        fns = dict(fns)
        if not fns:
            return {}
        if self.graphs:
            fns = {k: f if k.startswith(self.eager) else self._graph(f) for k, f in fns.items()}
        for fn in fns.values():  # warm-up: module load, allocator, handles
            fn()
            synchronize(self.device)
        reps = self.reps
        if self.budget_s is not None:
            per_round = sum(t for t, _ in self._round(fns).values())
            reps = max(5, min(reps, int(self.budget_s * len(fns) * 1e3 / max(per_round, 1e-3))))
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
        order = list(fns)
        for r in range(reps):
            round_fns = {k: fns[k] for k in (order if r % 2 == 0 else reversed(order))}  # alternate who goes first
            for k, t in self._round(round_fns).items():
                times[k].append(t)
        return times

    def _round(self, fns: Mapping[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
        if self.queued:
            return self._queued_round(fns)
        return {k: synchronised_call(fn, self.device) for k, fn in fns.items()}

    def _graph(self, fn: Callable[[], object]) -> Callable[[], object]:
        """The replay of ``fn`` captured in a CUDA graph (after one eager warm-up call)."""
        fn()
        synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def _queued_round(self, fns: Mapping[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
        """(device ms, host ms) of one call of each callable, in order, queued behind a spinning kernel.

        The round is repeated with a twice longer spin until the device reached every call only after the host
        had issued it, i.e. no kernel of a call waited for its launch (host and device times are compared through
        an event recorded on the idle device). A spin that outlasts twice the host's time to issue the round
        and still leaves the device waiting means a call synchronises with the host; that round is kept (as is
        any round once the spin would pass 2^40 cycles, minutes on any GPU).
        """
        with torch.cuda.device(self.device):  # the spin and the events on the timed device, whichever is current
            while True:
                synchronize(self.device)
                anchor, spun = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t_anchor = time.perf_counter()
                anchor.record()
                torch.cuda._sleep(self._spin_cycles)
                spun.record()
                marks = []
                for k, fn in fns.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    end.record()
                    marks.append((k, start, end, (t1 - t0) * 1e3, (t1 - t_anchor) * 1e3))
                synchronize(self.device)
                waited = any(anchor.elapsed_time(start) < issued for _, start, _, _, issued in marks)
                if not waited or anchor.elapsed_time(spun) > 2 * marks[-1][4] or self._spin_cycles >= 1 << 40:
                    return {k: (start.elapsed_time(end), host) for k, start, end, host, _ in marks}
                self._spin_cycles *= 2


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """The median milliseconds of ``fn`` over ``reps`` rounds of :class:`Timer` (after one warm-up call)."""
    return Timer(device, reps).many({"fn": fn})["fn"].ms
