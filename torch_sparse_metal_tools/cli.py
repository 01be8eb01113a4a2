"""What the command lines share beyond argparse types (:mod:`.argtypes`): the device option, output-file checks,
usage errors of a nested parser, and one start-up line about OpenMP's wait policy.

The rule for every command (training, ``bench``, ``tune``, ``selfcheck``, the examples, ``benchmarks/pairs.py``):
a bad argument or output path is a usage error (exit status 2, one ``error:`` line naming the option) found before
any work, so nothing is written and nothing measured is lost.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--device", type=device_type(allow_auto=True), default="auto")
    >>> p.parse_args(["--device", "cpu"]).device, p.parse_args([]).device
    (device(type='cpu'), 'auto')
    >>> device_type()("tpu")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: not a device name: 'tpu'; this machine has: cpu
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from torch_sparse_metal import settings

from .argtypes import available_device

__all__ = ["UsageError", "check_output_file", "check_plot_file", "device_type", "devices_here", "openmp_note",
           "print_openmp_note", "raising_errors"]


def devices_here(allow_auto: bool = False) -> str:
    """The ``--device`` values this machine can run, in words (only available ones: a Linux machine is never
    offered ``mps``).

    Example:
        >>> devices_here(allow_auto=True).startswith("auto, cpu")
        True
    """
    names = ["auto"] if allow_auto else []
    names.append("cpu")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names.append("cuda" if count == 1 else f"cuda, cuda:0 to cuda:{count - 1}")
    if torch.backends.mps.is_available():
        names.append("mps")
    return ", ".join(names)


def device_type(allow_auto: bool = False) -> Callable[[str], torch.device | str]:
    """An argparse type for ``--device``: a device of this machine with csr_linear kernels (or ``"auto"`` with
    ``allow_auto``, left for the command to resolve). A refusal names only the devices this machine has."""

    def convert(text: str) -> torch.device | str:
        if allow_auto and text == "auto":
            return text
        try:
            return available_device(text)
        except argparse.ArgumentTypeError as exc:
            # available_device lists every device type with kernels; a user can only pick among those present
            reason = str(exc).split("; use ", 1)[0]
            raise argparse.ArgumentTypeError(f"{reason}; this machine has: {devices_here(allow_auto)}") from None

    return convert


def check_output_file(parser: argparse.ArgumentParser, path: Path, option: str) -> None:
    """``path`` can be written as a file: not a folder, its folder exists, and a file can be made there (or the
    existing one opened for writing). Probed without changing anything: an existing file is opened for appending
    and left as it was, a probe file is removed again."""
    path = Path(path)
    if path.is_dir():
        parser.error(f"{option} {path}: a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        parser.error(f"{option} {path}: no folder {folder} to write it in")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        parser.error(f"{option} {path}: cannot write there ({exc.strerror or exc})")
    finally:
        if not existed:
            with contextlib.suppress(OSError):
                path.unlink()


def check_plot_file(parser: argparse.ArgumentParser, path: Path, option: str) -> None:
    """``path`` names a plot matplotlib can write (a format it knows from the suffix) where a file can be written
    (:func:`check_output_file`)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    formats = sorted(Figure().canvas.get_supported_filetypes())
    if Path(path).suffix.lstrip(".").lower() not in formats:
        parser.error(f"{option} {path}: give a file name ending in one of {', '.join('.' + f for f in formats)}")
    check_output_file(parser, path, option)


class UsageError(ValueError):
    """A usage error raised by a parser of :func:`raising_errors` instead of exiting."""


@contextlib.contextmanager
def raising_errors(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` with its usage errors raised as :class:`UsageError` (the message alone) instead of printing and
    exiting: for checking another command's arguments inside this one (``benchmarks/pairs.py`` checks each run's
    training arguments before it measures any)."""

    def error(message: str):
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        yield parser
    finally:
        del parser.error


def openmp_note(device: torch.device | str) -> str | None:
    """One start-up line for a CPU run whose OpenMP threads spin while they wait (``OMP_WAIT_POLICY`` unset, more
    than one thread), else None. libgomp reads the policy when torch loads, before any command can set it, and
    passive waits cost some speed on a machine to oneself, so the command says it rather than sets it."""
    if torch.device(device).type != "cpu" or settings.text("OMP_WAIT_POLICY") or torch.get_num_threads() < 2:
        return None
    return ("note: OpenMP threads spin while they wait (OMP_WAIT_POLICY unset); on a machine shared with other jobs "
            "start with OMP_WAIT_POLICY=passive or OMP_NUM_THREADS=1 (up to 16x faster there; docs/training.md)")


def print_openmp_note(device: torch.device | str) -> None:
    """Print :func:`openmp_note` to stderr, where there is one."""
    note = openmp_note(device)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
