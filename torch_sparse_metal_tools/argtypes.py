"""argparse types shared by the command lines (train, tune, bench, the examples): a bad value is a usage error
(exit status 2, one line naming the option and what it must be) before any work starts.

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--steps", type=positive_int)
    >>> p.parse_args(["--steps", "3"]).steps
    3
    >>> positive_int("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: must be a positive integer, got -1
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from torch_sparse_metal import devices

__all__ = ["available_device", "existing_path", "fraction", "non_negative_float", "non_negative_int", "number",
           "positive_float", "positive_int", "probability", "seed", "unit_interval"]

T = TypeVar("T")


def number(parse: Callable[[str], T], ok: Callable[[T], bool], expected: str, must: str) -> Callable[[str], T]:
    """An argparse type: ``parse(text)`` (a ValueError: "expected ...") that ``ok`` accepts (else "must be ...")."""

    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
        return value

    return convert


def unit_interval(interval: str, note: str = "") -> Callable[[str], float]:
    """An argparse type for a number in ``interval``, "(0, 1]", "[0, 1)" or "[0, 1]"; NaN fails every bound."""

    def ok(value: float) -> bool:
        above = value > 0.0 if interval.startswith("(") else value >= 0.0
        below = value <= 1.0 if interval.endswith("]") else value < 1.0
        return above and below

    return number(float, ok, f"a number in {interval}", f"in {interval}{note}")


fraction = unit_interval("(0, 1]", " (the fraction of connections kept)")
probability = unit_interval("[0, 1)")
positive_int = number(int, lambda v: v > 0, "a positive integer", "a positive integer")
non_negative_int = number(int, lambda v: v >= 0, "an integer >= 0", ">= 0")
positive_float = number(float, lambda v: v > 0 and not math.isinf(v), "a positive number", "a positive number")
non_negative_float = number(float, lambda v: 0 <= v < math.inf, "a number >= 0", "a number >= 0")


def seed(text: str) -> int:
    """A seed for torch generators: an integer in [0, 2**63)."""
    value = non_negative_int(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {text}")
    return value


def existing_path(text: str) -> Path:
    """A file or folder that exists (checked when the arguments are parsed, not when it is first read)."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    return path


def available_device(text: str) -> torch.device:
    """A device of this machine with csr_linear kernels: ``cpu``, ``cuda``, ``cuda:N`` (N below the GPU count) or
    ``mps``, each only where this torch can use it."""
    choices = "cpu, cuda, cuda:N or mps"
    try:
        device = torch.device(text)
    except RuntimeError:  # torch's message lists two dozen device types without kernels here
        raise argparse.ArgumentTypeError(f"not a device name: {text!r}; use {choices}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: this torch has no usable CUDA device")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device{'s' * (count != 1)}")
    elif devices.get(device.type) is None:
        raise argparse.ArgumentTypeError(f"{text}: no csr_linear kernels on {device.type}; use {choices}")
    elif not devices.get(device.type).is_available():
        raise argparse.ArgumentTypeError(f"{text}: {device.type.upper()} is not available on this machine")
    if device.type != "cuda" and device.index not in (None, 0):
        raise argparse.ArgumentTypeError(f"{text}: {device.type} has one device, {device.type}")
    return device


def check_writable(parser: argparse.ArgumentParser, out: Path, described: str) -> None:
    """The output folder can be created and written (checked before any work, not after it); folders the probe
    creates are removed again, so a run refused later leaves nothing behind."""
    created = [d for d in (out, *out.parents) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        parser.error(f"{described}: cannot write there ({exc.strerror or exc})")
    finally:
        for d in created:
            with contextlib.suppress(OSError):
                d.rmdir()
