"""What the command lines share beyond argparse types (:mod:`.argtypes`): the device option, output-file checks,
usage errors of a nested parser, and how OpenMP's threads wait on a shared machine (:func:`wait_passively`).

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
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from torch_sparse_metal import settings

from .argtypes import available_device

__all__ = ["UsageError", "check_output_file", "check_plot_file", "device_type", "devices_here", "openmp_note",
           "passive_wait_env", "print_openmp_note", "raising_errors", "wait_passively"]


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


#: Variables through which a user has chosen how OpenMP threads wait (libgomp's and LLVM libomp's): any of them set
#: leaves the choice to the user.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
#: Set beside ``OMP_WAIT_POLICY=passive`` where a command chose it, so that its start-up line can say so.
CHOSEN_BY_COMMAND = "TORCH_SPARSE_METAL_PASSIVE_WAIT"


def passive_wait_env(environ: dict[str, str], cpus: int | None) -> dict[str, str] | None:
    """The variables a command sets before OpenMP starts so that its idle threads sleep instead of spinning, or
    None where nothing is to be set: the user chose a wait policy or spin count, asked for one thread, or the
    machine has one CPU.

    A spinning thread holds its core for about 300,000 spins at every wait; where another job wants that core the
    two stall each other, and a 2-core machine with one busy process runs the training loop several times slower
    (docs/training.md, "CPU threads on a busy machine").

    Example:
        >>> passive_wait_env({}, cpus=2)
        {'OMP_WAIT_POLICY': 'passive', 'TORCH_SPARSE_METAL_PASSIVE_WAIT': '1'}
        >>> passive_wait_env({"OMP_WAIT_POLICY": "active"}, cpus=2) is None  # the user's choice stands
        True
        >>> passive_wait_env({"OMP_NUM_THREADS": "1"}, cpus=2), passive_wait_env({}, cpus=1)
        (None, None)
    """
    if any(environ.get(name, "").strip() for name in WAIT_SETTINGS):
        return None
    if environ.get("OMP_NUM_THREADS", "").strip() == "1" or (cpus or 1) < 2:
        return None
    return {"OMP_WAIT_POLICY": "passive", CHOSEN_BY_COMMAND: "1"}


def _relaunch_argv() -> list[str] | None:
    """The command line that started this process, to run it again (``sys.orig_argv``, interpreter options kept),
    where the code running as ``__main__`` is the program that command names (``python script.py ...`` or
    ``python -m module ...``); None otherwise (the program runs inside another one, e.g. through ``runpy``)."""
    orig, args = list(getattr(sys, "orig_argv", [])), sys.argv[1:]
    if len(orig) < 2 or (args and orig[-len(args):] != args):
        return None
    head = orig[:len(orig) - len(args)]
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name not in (None, "__main__"):
        named = head[-2:] == ["-m", spec.name]
    else:
        named = len(head) >= 2 and os.path.realpath(head[-1]) == os.path.realpath(sys.argv[0])
    return [sys.executable, *orig[1:]] if named else None


def wait_passively() -> None:
    """Make this command's OpenMP threads sleep while they wait, unless the user chose otherwise
    (:func:`passive_wait_env`). Called first thing in a command's ``if __name__ == "__main__"`` block.

    libgomp reads the policy once, when torch loads it, which is before any command of this package runs: so the
    command sets the variables and starts itself again in place (``os.execv``, same process id, same arguments).
    Where the program was not started by its own command line (run inside another program) it only sets the
    variables for the processes it starts, and the start-up line of :func:`openmp_note` still says how to choose.
    """
    env = passive_wait_env(dict(os.environ), os.cpu_count())
    if env is None or sys.platform == "win32":
        return
    argv = _relaunch_argv()
    os.environ.update(env)
    if "torch" not in sys.modules:
        return  # read when torch loads
    if argv is None:
        os.environ.pop("OMP_WAIT_POLICY")  # this process spins: the start-up line says so
        os.environ.pop(CHOSEN_BY_COMMAND)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def openmp_note(device: torch.device | str) -> str | None:
    """One start-up line for a CPU run with more than one thread: where its OpenMP threads spin while they wait
    (``OMP_WAIT_POLICY`` unset), how to stop them; where the command chose passive waits itself
    (:func:`wait_passively`), that it did and how to choose otherwise. None for other runs."""
    if torch.device(device).type != "cpu" or torch.get_num_threads() < 2:
        return None
    policy = settings.text("OMP_WAIT_POLICY")
    if policy is None:
        return ("note: OpenMP threads spin while they wait (OMP_WAIT_POLICY unset); on a machine shared with other "
                "jobs start with OMP_WAIT_POLICY=passive or OMP_NUM_THREADS=1 (docs/training.md)")
    if policy.lower() == "passive" and settings.text(CHOSEN_BY_COMMAND) == "1":
        return ("note: OpenMP threads sleep while they wait (OMP_WAIT_POLICY=passive, set by this command: fast on a "
                "machine shared with other jobs); on a machine to yourself OMP_WAIT_POLICY=active "
                "may be faster (docs/training.md)")
    return None


def print_openmp_note(device: torch.device | str) -> None:
    """Print :func:`openmp_note` to stderr, where there is one."""
    note = openmp_note(device)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
