"""Progress of long commands (training, the sparsify example, the benchmarks): a tqdm bar on a terminal; elsewhere
(a log file, a pipe, CI) plain lines, at least one every :data:`INTERVAL_S` seconds, so that a run never looks
hung. tqdm alone falls silent there: ``disable=None`` turns it off without a terminal, and a bar only redraws
when it is updated, never during one long step.

tqdm is imported only by :func:`progress_bar` (it comes with the training extras; the core commands use
:func:`heartbeat`).

Example:
    >>> import io
    >>> log = io.StringIO()
    >>> with progress_bar(total=3, desc="train", unit="step", file=log) as bar:
    ...     bar.update(3)
    >>> [line.split(":")[0] for line in log.getvalue().splitlines()]  # a line at the start and at the end
    ['train', 'train']
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

__all__ = ["INTERVAL_S", "heartbeat", "progress_bar"]

#: The longest silence of a command whose output is not a terminal, in seconds.
INTERVAL_S = 30.0


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Ticker:
    """Calls ``fn`` every ``interval`` seconds from a daemon thread until :meth:`stop`."""

    def __init__(self, fn: Callable[[], None], interval: float) -> None:
        self._fn, self._interval = fn, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self._fn()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


@contextlib.contextmanager
def heartbeat(what: str, interval: float = INTERVAL_S, stream: TextIO | None = None) -> Iterator[None]:
    """While the block runs, a line ``"<what>: still running (N s)"`` on ``stream`` (stderr) every ``interval``
    seconds; nothing when the block ends sooner.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with heartbeat("timing", interval=0.05, stream=out):
        ...     time.sleep(0.2)
        >>> out.getvalue().splitlines()[0].startswith("timing: still running (")
        True
    """
    start = time.monotonic()

    def beat() -> None:
        print(f"{what}: still running ({time.monotonic() - start:.0f} s)", file=stream or sys.stderr, flush=True)

    ticker = _Ticker(beat, interval)
    try:
        yield
    finally:
        ticker.stop()


class _Lines:
    """A stream for tqdm that turns each redraw (``\\r`` + status + padding) into one plain line."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self._stream.write(line + "\n")

    def flush(self) -> None:
        self._stream.flush()


@functools.cache
def _bar_class() -> type:
    from tqdm.auto import tqdm

    class Bar(tqdm):
        """tqdm, or where its stream is not a terminal, a line per redraw, at most and at least one every
        ``interval`` seconds (refreshes in between, e.g. ``set_postfix``, are held back; a ticker fills silences)."""

        def __init__(self, *args: Any, interval: float = INTERVAL_S, **kwargs: Any) -> None:
            stream = kwargs.get("file") or sys.stderr
            self._plain, self._interval, self._shown = not _is_terminal(stream), interval, -float("inf")
            self._ticker = None
            if self._plain:
                kwargs.update(file=_Lines(stream), mininterval=interval, miniters=1, ascii=True, dynamic_ncols=False)
            else:
                kwargs.setdefault("dynamic_ncols", True)
            super().__init__(*args, **kwargs)
            if self._plain and not self.disable:
                self._ticker = _Ticker(self._tick, interval)

        def _tick(self) -> None:
            if not self.disable and time.monotonic() - self._shown >= self._interval:
                self.refresh()

        def display(self, *args: Any, **kwargs: Any) -> Any:
            self._shown = time.monotonic()
            return super().display(*args, **kwargs)

        def refresh(self, *args: Any, **kwargs: Any) -> Any:
            if self._plain and time.monotonic() - self._shown < self._interval:
                return None
            return super().refresh(*args, **kwargs)

        def close(self) -> None:
            if self._ticker is not None:
                self._ticker.stop()
                self._ticker = None
            super().close()

    return Bar


def progress_bar(iterable: Any = None, *, enabled: bool = True, interval: float = INTERVAL_S, **kwargs: Any) -> Any:
    """A tqdm progress bar (``kwargs`` as for tqdm) that shows on a terminal as usual and, without one, writes a
    plain line at the start, at least every ``interval`` seconds, and at the end. ``enabled=False``: nothing."""
    return _bar_class()(iterable, disable=not enabled, interval=interval, **kwargs)
